"""Rotary position embedding and the attention prologue as a composition of stock ops.

``qkv_rope_store`` is the definition every backend's op of that name must reproduce bit for bit:
split the qkv projection's output into q, k, v heads; RMSNorm q and k over the head dim when the
model has per-head norms (Qwen3's q_norm / k_norm, through the backend's own ``rms_norm``); rotate
q and k (``apply_rope``, in the model's dtype); write k and v into their paged-cache slots; return
q. The CPU backends run it as it stands; the CUDA backend fuses it into one kernel
(``samebits.ops.triton.rope``); ``DifferentiableOps`` runs it with autograd.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from samebits.ops.backend import store_kv

RMSNorm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D] already in x's dtype (HF's rotate_half convention): each
    product and the sum rounded to x's dtype, as torch's elementwise ops do."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def qkv_rope_store(rms_norm: RMSNorm, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   hq: int, hkv: int, d: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D] -> q = rope(norm(q)) [T, Hq, D], contiguous (written into
    ``out`` when given); k = rope(norm(k)) and v written to ``slot_mapping``'s slots of the caches
    [num_blocks, block_size, Hkv, D]."""
    t = qkv.shape[0]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    store_kv(k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping)
    return q.contiguous() if out is None else out.copy_(q)
