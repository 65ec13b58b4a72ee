"""``samebits.batch_invariant()``: the op-level overrides (``samebits.ops.override``) plus, on
CUDA, the HF RMSNorm classes of the architecture table routed to the engine's kernel, and
transformers' sparse MoE blocks routed to the engine's MoE ops (``samebits.ops.hf_moe``): routes
this module adds to every block (``override.add_route``).

On CUDA the engine's RMSNorm is one Triton kernel, one row per lane group, whose bits no aten-level
mean can reproduce; so inside the block the ``forward`` of every RMSNorm class an architecture
entry names (``Architecture.hf_norm``, HF's formula ``w * (x.float() * rsqrt(mean + eps)).to(x)``),
where its modeling module is imported when the outermost block opens, runs that kernel (with a
recompute backward, ``samebits.ops.autograd``). CPU tensors keep the stock forward, whose
``mean`` the op-level override already makes the engine's.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch

from samebits.models.registry import hf_rms_norms
from samebits.ops import override
from samebits.ops.autograd import invariant_apply, rms_norm_reference
from samebits.ops.backend import get_backend

__all__ = ["batch_invariant"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _routable(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (x.is_cuda and x.dtype in _FLOATS and w.dtype in _FLOATS and x.numel() > 0
            and x.layout == torch.strided and w.device == x.device and x.shape[-1] == w.shape[0])


def _engine_rms_norm(stock: Callable, module: torch.nn.Module, hidden_states: torch.Tensor
                     ) -> torch.Tensor:
    """HF RMSNorm ``forward`` -> the engine's kernel on CUDA (stock ``forward`` elsewhere)."""
    w = module.weight
    if not _routable(hidden_states, w):
        return stock(module, hidden_states)
    eps = float(module.variance_epsilon)
    backend = get_backend(hidden_states.device, batch_invariant=True)
    with override.busy():
        return invariant_apply(functools.partial(backend.rms_norm, eps=eps),
                               functools.partial(rms_norm_reference, eps=eps), hidden_states, w)


def _norm_forward(stock: Callable) -> Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]:
    def forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return _engine_rms_norm(stock, self, hidden_states)
    return forward


def _route_hf_rms_norms() -> Callable[[], None]:
    """Point the imported HF RMSNorm classes' ``forward`` at the engine's CUDA kernel (only when
    CUDA exists); returns the undo."""
    if not torch.cuda.is_available():
        return lambda: None
    undo = []
    for module_name, class_name in hf_rms_norms():
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is None:
            continue
        stock = cls.__dict__["forward"]
        cls.forward = _norm_forward(stock)
        undo.append((cls, stock))
    return lambda: [setattr(cls, "forward", stock) for cls, stock in undo]


def _route_hf_moe() -> Callable[[], None]:
    from samebits.ops.hf_moe import route_hf_moe
    return route_hf_moe(override.busy)


override.add_route(_route_hf_rms_norms)
override.add_route(_route_hf_moe)
batch_invariant = override.batch_invariant
