"""``batch_invariant()``: torch.library overrides that make stock PyTorch code batch-invariant.

``samebits.batch_invariant()`` is this block with, on CUDA, the HF RMSNorm classes the
architecture table names routed to the engine's kernel (``samebits.models.hf_route`` adds that
route, ``add_route``).

Inside ``with batch_invariant():`` the CPU (and, where CUDA exists, CUDA) kernels of these aten ops
are replaced by the invariant implementations of ``get_backend(device, batch_invariant=True)``:

- ``mm``, ``addmm``, ``mv``: the backend's ``linear`` (``F.linear`` and ``matmul`` reduce to these;
  ``matmul`` of [B, S, K] x [K, N] folds B into M, so row invariance is what makes them agree);
- ``bmm``, ``baddbmm``: batch item i is ``linear(a[i], b[i].T)``, one item at a time, or all rows
  through one ``linear`` when b is one matrix expanded over the batch;
- ``_softmax``, ``_log_softmax``: the backend's softmax / log_softmax over ``dim`` moved last;
- ``mean.dim``: reduced dims moved last and flattened; rows reduced by the stock mean on fixed
  ``[TILE_M, count]`` tiles -- the very op the engine's RMSNorm runs, so HF's RMSNorm
  (``pow(2).mean(-1) -> rsqrt``) gives the engine's bits;
- transformers' ``"sdpa"`` attention (its ``AttentionInterface`` registry entry, while transformers
  is imported): the engine's paged split attention (``samebits.ops.hf_attention``);
- the row-parallel linears of an HF decoder (the ``o_proj`` / ``down_proj`` ``nn.Linear`` of a
  module whose ``config`` has ``num_key_value_heads``): the engine's K chains on one device
  (``samebits.ops.backend.one_device_bounds``). A global module forward pre-hook
  registers their weights as such a module runs; ``mm`` / ``addmm`` of a registered weight then
  pass its K chains to the backend's ``linear``, as the engine's decoder does.

The decision: the override maps HF's ops onto the engine's arithmetic, never the reverse. The engine
keeps one reference arithmetic per op (tiled linear, tiled stock mean / softmax / log_softmax,
fixed-split attention); under ``batch_invariant()`` a stock HF model of the engine's weights
(``attn_implementation="sdpa"``) runs that same arithmetic op for op, so its logits' log_softmax
is bitwise the engine's sampled logprobs (CPU fp32 tested). Elementwise ops (embedding, RoPE,
SiLU, residual adds, the casts) already agree (the engine's CPU SiLU runs per down_proj segment;
HF's one call over the row agrees when the segment lengths are multiples of the vector width,
as in the default model, not in general). On CUDA the engine's RMSNorm is one Triton kernel,
so there ``samebits.batch_invariant()`` routes the norm module itself to it. Backward: the aten
overrides sit below autograd, so stock derivative formulas run (their matmuls invariant too); the
attention entry and the CUDA norm route have a recompute backward (``samebits.ops.autograd``).

Guarantee: for fp32, bf16 and fp16 inputs, the bits of an output row (a row of a matrix product, a
batch item's row of ``bmm``, a softmax row, a mean over the reduced dims) depend only on that row's
own inputs and the other operand -- not on how many rows or batch items there are, where the row
sits, or on whether PyTorch folded batch dims into M. Other dtypes, empty tensors and full
reductions run the stock kernel. The overrides are process-wide while any ``batch_invariant()``
block is open (nesting is counted) and all are removed, restoring stock kernels, when the outermost
block exits, also on an exception.

Recursion: each override is registered ``with_keyset=True`` and keeps the stock kernel captured by
``torch.library.get_kernel`` before registration. The backends themselves call ``torch.bmm``,
``torch.softmax``, ``mean`` on fixed shapes; while an override runs (a thread-local flag), nested
calls of these ops go straight to the stock kernel via ``call_boxed``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator

import torch

from samebits.ops.backend import KBounds, OpBackend, get_backend, one_device_bounds
from samebits.ops.tiles import by_tiles

__all__ = ["batch_invariant", "is_batch_invariant_enabled"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _backend(x: torch.Tensor) -> OpBackend:
    return get_backend(x.device, batch_invariant=True)


def _supported(*ts: torch.Tensor) -> bool:
    """Dense, non-empty, same dtype (fp32/bf16/fp16), same device: else the stock kernel runs."""
    t0 = ts[0]
    return all(t.dtype == t0.dtype and t.device == t0.device and t.numel() > 0
               and t.layout == torch.strided for t in ts) and t0.dtype in _FLOATS


def _scaled(out: torch.Tensor, bias: torch.Tensor, beta: float, alpha: float) -> torch.Tensor:
    """beta * bias + alpha * out, with stock semantics for beta == 0 (bias ignored)."""
    if alpha != 1:
        out = out * alpha
    if beta == 0:
        return out.contiguous()
    return out + (bias if beta == 1 else bias * beta)


# ----- HF decoders' row-parallel linears: the engine's K segments -----

ROW_PARALLEL = ("o_proj", "down_proj")  # the HF Llama family's names (the engine's too)
# (data_ptr, shape, stride, dtype, device) of a registered weight's transpose -- the operand
# F.linear hands to mm / addmm -- -> (a weak reference to the weight, the model's KV heads)
_row_parallel: dict[tuple, tuple[weakref.ref, int]] = {}


def _operand_key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def _register_row_parallel(module: torch.nn.Module, args: tuple) -> None:
    """Forward pre-hook of every module: an HF decoder (or a part with its ``config``) registers
    the weights of its o_proj / down_proj with S = ``config.num_key_value_heads`` segments."""
    heads = getattr(getattr(module, "config", None), "num_key_value_heads", None)
    if not isinstance(heads, int):
        return
    for name, sub in module.named_modules():
        if name.rpartition(".")[2] in ROW_PARALLEL and isinstance(sub, torch.nn.Linear):
            w = sub.weight
            _row_parallel[_operand_key(w.t())] = (weakref.ref(w), heads)


def _registered_heads(b: torch.Tensor) -> int | None:
    """The KV heads mm's operand ``b`` was registered with, if it is a live registered weight's
    transpose."""
    entry = _row_parallel.get(_operand_key(b))
    if entry is None:
        return None
    w = entry[0]()
    return entry[1] if w is not None and w.data_ptr() == b.data_ptr() else None


# ----- the invariant implementations (called with the stock kernels active) -----

def _chains(backend: OpBackend, b: torch.Tensor) -> KBounds | None:
    """The K chains ``backend`` runs mm's operand ``b`` over if it is a registered row-parallel
    weight (as the engine's decoder does on one device), else None."""
    heads = _registered_heads(b)
    return None if heads is None else one_device_bounds(backend, b.shape[0], heads)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    backend = _backend(a)
    return backend.linear(a, b.t(), k_bounds=_chains(backend, b))


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1,
           alpha: float = 1) -> torch.Tensor:
    if beta == 1 and alpha == 1 and bias.dim() == 1:  # same bits as samebits.ops.linear
        backend = _backend(a)
        return backend.linear(a, b.t(), bias, k_bounds=_chains(backend, b))
    return _scaled(_mm(a, b), bias, beta, alpha)


def _mv(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _backend(a).linear(a, v.unsqueeze(0)).squeeze(-1)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    batch, m, k = a.shape
    linear = _backend(a).linear
    if b.stride(0) == 0:  # one matrix expanded over the batch: row invariance lets us fold
        return linear(a.reshape(batch * m, k), b[0].t()).view(batch, m, -1)
    return torch.stack([linear(a[i], b[i].t()) for i in range(batch)])


def _baddbmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1,
             alpha: float = 1) -> torch.Tensor:
    return _scaled(_bmm(a, b), bias, beta, alpha)


def _last_dim(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, dim: int
              ) -> torch.Tensor:
    """Apply a last-dim row op ``fn`` along ``dim``."""
    dim = dim % x.dim()
    if dim == x.dim() - 1:
        return fn(x)
    return fn(x.movedim(dim, -1)).movedim(-1, dim).contiguous()


def _softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    x = x.float() if half_to_float else x
    return _last_dim(_backend(x).softmax, x, dim)


def _log_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    x = x.float() if half_to_float else x
    return _last_dim(_backend(x).log_softmax, x, dim)


def _mean(x: torch.Tensor, dim: list[int], keepdim: bool = False, *,
          dtype: torch.dtype | None = None) -> torch.Tensor:
    x = x if dtype is None else x.to(dtype)
    dims = sorted({d % x.dim() for d in dim})
    kept = [d for d in range(x.dim()) if d not in dims]
    count = math.prod(x.shape[d] for d in dims)
    rows = x.permute(*kept, *dims).reshape(-1, count).contiguous()
    out = by_tiles(lambda t: t.mean(-1, keepdim=True), rows)  # the engine's RMSNorm mean
    shape = [1 if d in dims else n for d, n in enumerate(x.shape)] if keepdim else \
        [x.shape[d] for d in kept]
    return out.reshape(shape)


# ----- which calls take the invariant path -----

def _mm_supported(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() == 2 and a.shape[1] == b.shape[0] and _supported(a, b)


def _mv_supported(a: torch.Tensor, v: torch.Tensor) -> bool:
    return a.dim() == 2 and v.dim() == 1 and a.shape[1] == v.shape[0] and _supported(a, v)


def _bmm_supported(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dim() == b.dim() == 3 and a.shape[0] == b.shape[0] and a.shape[2] == b.shape[1]
            and _supported(a, b))


def _mean_supported(x: torch.Tensor, dim: list[int] | None, keepdim: bool = False, *,
                    dtype: torch.dtype | None = None) -> bool:
    if not dim or x.dim() == 0 or dtype not in (None, *_FLOATS) or not _supported(x):
        return False
    wrapped = [d % x.dim() for d in dim if -x.dim() <= d < x.dim()]
    return len(set(wrapped)) == len(dim)  # else the stock kernel raises its own error


def _rowop_supported(x: torch.Tensor, dim: int, half_to_float: bool) -> bool:
    return x.dim() > 0 and _supported(x)


_OVERRIDES: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., bool]]] = {
    "mm": (_mm, _mm_supported),
    "addmm": (_addmm, lambda bias, a, b, **_: _mm_supported(a, b) and _supported(bias, a)),
    "mv": (_mv, _mv_supported),
    "bmm": (_bmm, _bmm_supported),
    "baddbmm": (_baddbmm, lambda bias, a, b, **_: _bmm_supported(a, b) and _supported(bias, a)),
    "_softmax": (_softmax, _rowop_supported),
    "_log_softmax": (_log_softmax, _rowop_supported),
    "mean.dim": (_mean, _mean_supported),
}


# ----- registration -----

_local = threading.local()  # .busy: an override is running on this thread
_lock = threading.Lock()
_depth = 0
_lib: torch.library.Library | None = None
_undo_routes: list[Callable[[], None]] = []
# installers run when the outermost block opens, each returning its undo: transformers'
# attention here; higher layers add theirs (``add_route``: the HF RMSNorm classes)
_ROUTES: list[Callable[[], Callable[[], None]]] = []


def add_route(install: Callable[[], Callable[[], None]]) -> None:
    """Run ``install`` (which returns its undo) whenever an outermost block opens."""
    if install not in _ROUTES:
        _ROUTES.append(install)
_hook: torch.utils.hooks.RemovableHandle | None = None


def _kernel(op: str, key: str) -> Callable[..., torch.Tensor]:
    """The override of ``aten::op`` for dispatch ``key``; nested and unsupported calls go stock."""
    stock = torch.library.get_kernel(f"aten::{op}", key)
    impl, supported = _OVERRIDES[op]

    def kernel(keyset: torch._C.DispatchKeySet, *args, **kwargs) -> torch.Tensor:
        if getattr(_local, "busy", False) or not supported(*args, **kwargs):
            return stock.call_boxed(keyset, *args, **kwargs)
        _local.busy = True
        try:
            return impl(*args, **kwargs)
        finally:
            _local.busy = False

    return kernel


def _dispatch_keys() -> list[str]:
    return ["CPU", "CUDA"] if torch.cuda.is_available() else ["CPU"]


def _register() -> torch.library.Library:
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # "Overriding a previously registered kernel": intended
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            for key in _dispatch_keys():
                for op in _OVERRIDES:
                    lib.impl(op, _kernel(op, key), key, with_keyset=True)
    except BaseException:
        lib._destroy()
        raise
    return lib


@contextlib.contextmanager
def busy() -> Iterator[None]:
    """Nested aten calls go to the stock kernels (as inside an override)."""
    before = getattr(_local, "busy", False)
    _local.busy = True
    try:
        yield
    finally:
        _local.busy = before


def _route_hf_attention() -> Callable[[], None]:
    """Point transformers' ``"sdpa"`` attention at the engine's (if transformers is imported);
    returns the undo."""
    if "transformers" not in sys.modules:
        return lambda: None
    from samebits.ops.hf_attention import engine_sdpa
    registry = importlib.import_module("transformers.modeling_utils").AttentionInterface
    stock = registry._global_mapping.get("sdpa")
    if stock is None:
        return lambda: None
    registry._global_mapping["sdpa"] = functools.partial(engine_sdpa, stock, busy)
    return lambda: registry._global_mapping.__setitem__("sdpa", stock)


def is_batch_invariant_enabled() -> bool:
    """Whether a ``batch_invariant()`` block is open (in any thread)."""
    return _depth > 0


@contextlib.contextmanager
def batch_invariant() -> Iterator[None]:
    """Route stock aten matmul / softmax / log_softmax / mean to the invariant backends.

    Re-entrant: nested blocks share one registration, removed when the outermost block exits
    (normally or by an exception). The overrides are process-wide while registered.
    """
    global _depth, _lib, _hook
    with _lock:
        if _depth == 0:
            _lib = _register()
            _undo_routes[:] = [install() for install in [_route_hf_attention, *_ROUTES]]
            _hook = torch.nn.modules.module.register_module_forward_pre_hook(
                _register_row_parallel)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _lib is not None:
                _lib._destroy()
                _lib = None
                for undo in reversed(_undo_routes):
                    undo()
                _hook.remove()
                _row_parallel.clear()
