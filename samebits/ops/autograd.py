"""Differentiable invariant ops: the forward is the invariant kernel's bits, the backward the
vector-Jacobian product of a stock reference formula at the same inputs.

The invariant kernels (tiled CPU GEMMs, Triton) have no autograd. ``DifferentiableOps(inner)``
wraps any op backend: each op runs ``inner``'s kernel under ``no_grad`` in the forward (so its
output is bitwise what the engine computes) and, in the backward, recomputes a stock PyTorch
formula of the same math with autograd and returns its gradients. The backward is therefore not
batch-invariant, but it is deterministic (fixed shapes, no atomics: the same step gives the same
gradient bits), and it is the exact gradient of the reference formula, which agrees with the
invariant forward to float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from samebits.ops.backend import AttentionMetadata, OpBackend

__all__ = ["DifferentiableOps", "invariant_apply", "attention_reference"]


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
        with torch.enable_grad():
            out = ctx.ref(*xs)
            grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return (None, None, *[next(grads) if x is not None and x.requires_grad else None
                              for x in xs])


def invariant_apply(fwd: Callable, ref: Callable, *xs: torch.Tensor | None) -> torch.Tensor:
    """``fwd(*xs)`` with gradients of ``ref``; plain ``fwd`` when nothing needs a gradient."""
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs):
        return _Invariant.apply(fwd, ref, *xs)
    return fwd(*xs)


def _rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention over the paged cache in plain fp32 matmuls and softmax, one sequence at
    a time (the backward's formula; deterministic: fixed shapes, each key slot read once)."""
    hq, hkv, bs = q.shape[1], k_cache.shape[2], meta.block_size
    k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    tables, qsl, outs = meta.block_tables.long(), meta.query_start_loc_list, []
    for b, seq_len in enumerate(meta.seq_lens_list):
        n = qsl[b + 1] - qsl[b]
        pos = torch.arange(seq_len, device=q.device)
        slots = tables[b, pos // bs] * bs + pos % bs
        k = k_flat[slots].float().repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
        v = v_flat[slots].float().repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[qsl[b]:qsl[b + 1]].float() * scale, k)
        causal = pos[None, :] <= (seq_len - n + torch.arange(n, device=q.device))[:, None]
        p = torch.softmax(s.masked_fill(~causal, -math.inf), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, v).to(q.dtype))
    return torch.cat(outs)


class DifferentiableOps:
    """An ``OpBackend`` whose ops are ``inner``'s kernels (same bits) with a backward."""

    def __init__(self, inner: OpBackend) -> None:
        self.inner = inner
        self.name, self.batch_invariant = inner.name, inner.batch_invariant

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
               ) -> torch.Tensor:
        return invariant_apply(self.inner.linear, F.linear, x, w, b)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return invariant_apply(partial(self.inner.rms_norm, eps=eps),
                               partial(_rms_norm_reference, eps=eps), x, w)

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_apply(self.inner.softmax, partial(torch.softmax, dim=-1), x)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_apply(self.inner.log_softmax, partial(torch.log_softmax, dim=-1), x)

    def plan_attention(self, meta: AttentionMetadata) -> AttentionMetadata:
        return self.inner.plan_attention(meta)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return invariant_apply(partial(self.inner.attention, meta=meta, scale=scale),
                               partial(attention_reference, meta=meta, scale=scale),
                               q, k_cache, v_cache)
