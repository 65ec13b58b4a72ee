"""Differentiable invariant ops: the forward is the invariant kernel's bits, the backward the
vector-Jacobian product of a stock reference formula at the same inputs.

The invariant kernels (tiled CPU GEMMs, Triton) have no autograd. ``DifferentiableOps(inner)``
wraps any op backend: each op runs ``inner``'s kernel under ``no_grad`` in the forward (so its
output is bitwise what the engine computes) and, in the backward, recomputes a stock PyTorch
formula of the same math with autograd and returns its gradients (attention), or applies the
formula's derivative directly: ``linear`` (``g @ w``, ``g^T @ x``), softmax / log_softmax (aten's
backward of the saved output), RMSNorm (the reference's exact gradient in closed form, fp32;
one Triton pass on CUDA), ``silu_mul`` (the VJP of ``F.silu(g) * u``). Ops that fuse several
steps run their differentiable composition when a gradient is needed -- ``rms_norm`` with a
residual (the stock add, then the norm), ``qkv_rope_store`` (this norm, stock RoPE,
``index_copy_`` into the caches) -- and the inner fused op otherwise: the same bits either way.
On CUDA in bf16/fp16, attention's VJP for prefills from position 0 is stock flash attention's
(``attention_sdpa``), its backward run in deterministic mode.
The backward is therefore not batch-invariant, but it is deterministic (fixed shapes, no
atomics: the same step gives the same gradient bits), and it is the gradient of a stock
formula of the same math, which agrees with the invariant forward to float rounding.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from functools import partial

import torch

from samebits.ops import rope
from samebits.ops.backend import (
    AttentionMetadata,
    KBounds,
    NothingDeferred,
    OpBackend,
    norm_with_residual,
)

__all__ = ["DifferentiableOps", "invariant_apply", "attention_reference", "attention_sdpa",
           "attention_vjp", "rms_norm_reference", "silu_mul_reference"]

# The backward's fast paths on CUDA (module switches, so a test can compare with the formulas):
# attention's VJP through stock SDPA's flash kernel in its deterministic mode, and a one-pass
# Triton RMSNorm backward.
SDPA_BACKWARD = True
TRITON_RMS_NORM_BACKWARD = True


class _Deterministic:
    """A reference whose backward kernels run under ``torch.use_deterministic_algorithms``
    (flash attention's backward then reduces dQ in a fixed order instead of by atomics)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, *xs: torch.Tensor | None) -> torch.Tensor:
        return self.fn(*xs)


@contextlib.contextmanager
def _deterministic_algorithms():
    was, warn = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    import torch.utils.deterministic as det
    fill = det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    det.fill_uninitialized_memory = False  # no reads of uninitialized memory here: skip the fills
    try:
        yield
    finally:
        det.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(was, warn_only=warn)


class _Invariant(torch.autograd.Function):
    """forward(fwd, ref, *xs) = fwd(*xs); backward = vjp of ref(*xs)."""

    @staticmethod
    def forward(ctx, fwd: Callable, ref: Callable, *xs: torch.Tensor | None) -> torch.Tensor:
        ctx.ref = ref
        ctx.save_for_backward(*xs)
        return fwd(*xs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xs = [None if x is None else x.detach().requires_grad_(need)
              for x, need in zip(ctx.saved_tensors, ctx.needs_input_grad[2:], strict=True)]
        wanted = [x for x in xs if x is not None and x.requires_grad]
        det = (_deterministic_algorithms() if isinstance(ctx.ref, _Deterministic)
               else contextlib.nullcontext())
        with torch.enable_grad():
            out = ctx.ref(*xs)
            with det:
                grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return (None, None, *[next(grads) if x is not None and x.requires_grad else None
                              for x in xs])


def invariant_apply(fwd: Callable, ref: Callable, *xs: torch.Tensor | None) -> torch.Tensor:
    """``fwd(*xs)`` with gradients of ``ref``; plain ``fwd`` when nothing needs a gradient."""
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs):
        return _Invariant.apply(fwd, ref, *xs)
    return fwd(*xs)


def rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


ATTENTION_CHUNK_ELEMENTS = 1 << 27  # score elements per padded group of the attention backward


@functools.lru_cache(maxsize=16)
def _reference_plan(lens: tuple[int, ...], qsl: tuple[int, ...], hq: int, device: torch.device
                    ) -> tuple[list[tuple[torch.Tensor, ...]], torch.Tensor | None]:
    """The padded groups of ``attention_reference`` as device index tensors, built once per batch
    layout (every layer's backward reuses them: no host-to-device copy, no sync, per call)."""
    nq = [qsl[b + 1] - qsl[b] for b in range(len(lens))]
    groups, group = [], []
    for b in sorted(range(len(lens)), key=lambda i: (lens[i], nq[i])):
        grown = group + [b]
        if group and len(grown) * hq * max(nq[i] for i in grown) * lens[b] > ATTENTION_CHUNK_ELEMENTS:
            groups.append(group)
            grown = [b]
        group = grown
    groups.append(group)
    plans, order = [], []
    for group in groups:
        n_q, n_k = max(nq[b] for b in group), max(lens[b] for b in group)
        rows = [[qsl[b] + min(i, nq[b] - 1) for i in range(n_q)] for b in group]
        qpos = [[lens[b] - nq[b] + min(i, nq[b] - 1) for i in range(n_q)] for b in group]
        keep = [(j, i) for j, b in enumerate(group) for i in range(nq[b])]
        host = [torch.tensor(group), torch.arange(n_k), torch.tensor(rows), torch.tensor(qpos),
                torch.tensor([j for j, _ in keep]), torch.tensor([i for _, i in keep])]
        plans.append(tuple(t.to(device) for t in host))
        order += [qsl[b] + i for b in group for i in range(nq[b])]
    inverse = None
    if order != list(range(len(order))):
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        inverse = inverse.to(device)
    return plans, inverse


def attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention over the paged cache by plain matmuls and softmax (the backward's formula).

    Hugging Face's eager attention, op for op: scores ``(q @ k^T) * scale`` and ``p @ v`` in the
    input dtype, the softmax in fp32, its probabilities cast back to the input dtype (fp32 inputs:
    fp32 throughout). Sequences run in padded groups (sorted by length; at most
    ``ATTENTION_CHUNK_ELEMENTS`` score elements a group, a longer sequence alone), masked keys
    and padded query rows never reach an output. Deterministic: fixed shapes for a given batch,
    each key slot gathered once per group, no atomics.
    """
    hq, hkv, bs, d = q.shape[1], k_cache.shape[2], meta.block_size, q.shape[2]
    k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    plans, inverse = _reference_plan(meta.seq_lens_list, meta.query_start_loc_list, hq, q.device)
    tables, outs = meta.block_tables.long(), []
    for g, kpos, rows, qpos, keep_j, keep_i in plans:
        blocks = tables[g][:, (kpos // bs).clamp(max=tables.shape[1] - 1)]  # [G, L]
        slots = blocks * bs + kpos % bs
        k = k_flat[slots].repeat_interleave(hq // hkv, dim=2).permute(0, 2, 3, 1)  # [G, Hq, D, L]
        v = v_flat[slots].repeat_interleave(hq // hkv, dim=2).transpose(1, 2)  # [G, Hq, L, D]
        qb = q[rows].transpose(1, 2)  # [G, Hq, Q, D]; padded rows repeat the last query
        causal = kpos[None, None, :] <= qpos[:, :, None]  # [G, Q, L]
        s = (torch.matmul(qb, k) * scale).float()
        p = torch.softmax(s.masked_fill(~causal[:, None], -math.inf), dim=-1).to(q.dtype)
        o = torch.matmul(p, v).transpose(1, 2)  # [G, Q, Hq, D]
        outs.append(o[keep_j, keep_i])
    out = torch.cat(outs)
    return (out if inverse is None else out[inverse]).reshape(-1, hq, d)


def _fresh(meta: AttentionMetadata) -> bool:
    """Every sequence's queries are all its tokens (a prefill from position 0)."""
    qsl = meta.query_start_loc_list
    return all(qsl[b + 1] - qsl[b] == n for b, n in enumerate(meta.seq_lens_list))


@functools.lru_cache(maxsize=16)
def _varlen_plan(lens: tuple[int, ...], qsl: tuple[int, ...], device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence of each token, its position, cumulative query starts as int32), on device."""
    seq = [b for b, n in enumerate(lens) for _ in range(n)]
    pos = [p for n in lens for p in range(n)]
    return (torch.tensor(seq, device=device), torch.tensor(pos, device=device),
            torch.tensor(qsl, dtype=torch.int32, device=device))


_VARLEN_OK = [True]


def _attention_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float) -> torch.Tensor | None:
    """Fresh prefills through flash attention's variable-length kernel: the tokens stay packed
    (no padding, no query / output gathers), GQA native; None where the op is missing."""
    if not _VARLEN_OK[0]:
        return None
    seq, pos, cu = _varlen_plan(meta.seq_lens_list, meta.query_start_loc_list, q.device)
    bs = meta.block_size
    slots = meta.block_tables.long()[seq, pos // bs] * bs + pos % bs
    k, v = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]  # [T, Hkv, D]
    n = max(meta.seq_lens_list)
    try:
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, n, n, 0.0, True, False,
                                                       scale=scale)[0]
    except (RuntimeError, TypeError, AttributeError, NotImplementedError):
        _VARLEN_OK[0] = False
        return None


def attention_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """``attention_reference``'s math through stock flash attention (causal), for prefills from
    position 0 (``_fresh``) in bf16/fp16 on CUDA: the variable-length kernel on the packed tokens
    (``_attention_varlen``), else SDPA (``is_causal``, flash backend) on padded groups:

    the same padded groups as the reference: each sequence's queries and keys are right-padded
    to the group's longest, so under the top-left causal mask a real query row sees only its own
    sequence's keys; padded rows repeat the last query and never reach an output (their output
    gradient is zero, so they add exactly zero to dK / dV).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = _attention_varlen(q, k_cache, v_cache, meta, scale)
    if out is not None:
        return out
    hq, hkv, bs, d = q.shape[1], k_cache.shape[2], meta.block_size, q.shape[2]
    k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    plans, inverse = _reference_plan(meta.seq_lens_list, meta.query_start_loc_list, hq, q.device)
    tables, outs = meta.block_tables.long(), []
    for g, kpos, rows, _qpos, keep_j, keep_i in plans:
        blocks = tables[g][:, (kpos // bs).clamp(max=tables.shape[1] - 1)]  # [G, L]
        slots = blocks * bs + kpos % bs
        k = k_flat[slots].transpose(1, 2)  # [G, Hkv, L, D]
        v = v_flat[slots].transpose(1, 2)
        if hq != hkv:
            k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
        qb = q[rows].transpose(1, 2)  # [G, Hq, L, D]
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            o = torch.nn.functional.scaled_dot_product_attention(qb, k, v, is_causal=True,
                                                                 scale=scale)
        outs.append(o.transpose(1, 2)[keep_j, keep_i])
    out = torch.cat(outs)
    return (out if inverse is None else out[inverse]).reshape(-1, hq, d)


def attention_vjp(q: torch.Tensor, meta: AttentionMetadata, scale: float) -> Callable:
    """The reference whose VJP is attention's backward: stock SDPA's flash kernel (deterministic
    mode) where it applies, else ``attention_reference``."""
    if (SDPA_BACKWARD and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256 and _fresh(meta)
            and torch.cuda.get_device_capability(q.device) >= (8, 0)):
        return _Deterministic(partial(attention_sdpa, meta=meta, scale=scale))
    return partial(attention_reference, meta=meta, scale=scale)


class _RMSNorm(torch.autograd.Function):
    """forward(fwd, x, w, eps) = fwd(x, w, eps); backward = the exact gradient of
    ``rms_norm_reference`` in closed form, in fp32 (no recompute graph)."""

    @staticmethod
    def forward(ctx, fwd: Callable, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.eps = eps
        ctx.save_for_backward(x, w)
        return fwd(x, w, eps=eps)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        if TRITON_RMS_NORM_BACKWARD and x.is_cuda:
            from samebits.ops.triton.rms_norm_backward import rms_norm_backward
            gx, gw = rms_norm_backward(x, w, grad, ctx.eps, ctx.needs_input_grad[1],
                                       ctx.needs_input_grad[2])
            return None, gx, gw, None
        h = x.float()
        r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + ctx.eps)
        g = grad.float()
        gx = gw = None
        if ctx.needs_input_grad[1]:
            dn = g * w.float()
            gx = (r * (dn - h * (r * r * (dn * h).mean(-1, keepdim=True)))).to(x.dtype)
        if ctx.needs_input_grad[2]:
            n = (h * r).to(x.dtype).float()
            gw = (g * n).reshape(-1, w.shape[-1]).sum(0).to(w.dtype)
        return None, gx, gw, None


class _Linear(torch.autograd.Function):
    """forward(fwd, x, w, b) = fwd(x, w, b); backward = the stock ``F.linear`` formulas
    (``g @ w``, ``g^T @ x``, ``sum g``) without recomputing the product."""

    @staticmethod
    def forward(ctx, fwd: Callable, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
                ) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return fwd(x, w, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        gx = (g2 @ w).view(x.shape) if ctx.needs_input_grad[1] else None
        gw = g2.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[2] else None
        gb = g2.sum(0) if ctx.needs_input_grad[3] else None
        return None, gx, gw, gb


class _RowSoftmax(torch.autograd.Function):
    """forward(fwd, x, log) = fwd(x) over the last dim; backward = aten's own (log_)softmax
    backward formula applied to the forward's output (no recompute)."""

    @staticmethod
    def forward(ctx, fwd: Callable, x: torch.Tensor, log: bool) -> torch.Tensor:
        out = fwd(x)
        ctx.log, ctx.dtype = log, x.dtype
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (out,) = ctx.saved_tensors
        backward = (torch._log_softmax_backward_data if ctx.log
                    else torch._softmax_backward_data)
        return None, backward(grad, out, -1, ctx.dtype), None


def _needs_grad(*xs: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)


class DifferentiableOps(NothingDeferred):
    """An ``OpBackend`` whose ops are ``inner``'s kernels (same bits) with a backward."""

    def __init__(self, inner: OpBackend) -> None:
        self.inner = inner
        self.name, self.batch_invariant = inner.name, inner.batch_invariant
        self.row_parallel_chains = inner.row_parallel_chains
        self.sums_in_norm = False  # the differentiable norm takes tensors
        self.partials_into_norm_rows = 0

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
               k_bounds: KBounds | None = None) -> torch.Tensor:
        """The inner backend's product (segmented K with ``k_bounds``); F.linear's gradients."""
        fwd = self.inner.linear if k_bounds is None else partial(self.inner.linear,
                                                                 k_bounds=k_bounds)
        if _needs_grad(x, w, b):
            return _Linear.apply(fwd, x, w, b)
        return fwd(x, w, b)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor, k_bounds: KBounds | None = None
                 ) -> torch.Tensor:
        """The inner backend's bits (one kernel on CUDA); the gradients of ``F.silu(g) * u``."""
        return invariant_apply(partial(self.inner.silu_mul, k_bounds=k_bounds), silu_mul_reference,
                               gate, up)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With ``residual`` and gradients: the stock add, then this norm (the one-pass kernel's
        bits)."""
        if residual is not None and _needs_grad(x, w, residual):
            return norm_with_residual(self.rms_norm, x, w, eps, residual)
        if residual is None and _needs_grad(x, w):
            return _RMSNorm.apply(self.inner.rms_norm, x, w, eps)
        return self.inner.rms_norm(x, w, eps, residual)

    def qkv_rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       hq: int, hkv: int, d: int) -> torch.Tensor:
        """With gradients: the composition (``samebits.ops.rope``) over this ``rms_norm``, stock
        RoPE and ``index_copy_`` into the caches, all differentiable; else the inner backend's op
        (fused on CUDA). Both give the inner backend's bits."""
        args = (qkv, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, slot_mapping, hq, hkv, d)
        if _needs_grad(qkv, q_norm, k_norm):
            return rope.qkv_rope_store(self.rms_norm, *args)
        return self.inner.qkv_rope_store(*args)

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        if _needs_grad(x):
            return _RowSoftmax.apply(self.inner.softmax, x, False)
        return self.inner.softmax(x)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        if _needs_grad(x):
            return _RowSoftmax.apply(self.inner.log_softmax, x, True)
        return self.inner.log_softmax(x)

    def plan_attention(self, meta: AttentionMetadata) -> AttentionMetadata:
        return self.inner.plan_attention(meta)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return invariant_apply(partial(self.inner.attention, meta=meta, scale=scale),
                               attention_vjp(q, meta, scale), q, k_cache, v_cache)

