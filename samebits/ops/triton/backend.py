"""The CUDA batch-invariant backend: Triton kernels whose reduction orders ignore the batch.

Each op's module docstring states its invariance guarantee; tests/gpu checks them bit for bit
against the stock ops (which do change with the batch) and tests/unit/test_triton_interpret.py
runs the same kernels on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from contextlib import AbstractContextManager
from pathlib import Path

import torch
import torch.nn.functional as F

from samebits.ops import encoder_cuda
from samebits.ops.backend import AttentionMetadata, KBounds, paired_chains, register
from samebits.ops.encoder import InvariantEncoderOps
from samebits.ops.pending_merge import PendingMerge
from samebits.ops.pending_rank_sum import PendingRankSum
from samebits.ops.rope import qkv_rope_store as composed_prologue
from samebits.ops.triton import (
    activation,
    attention,
    gemv_staged,
    launcher,
    linear,
    rms_norm,
    rope,
    softmax,
)
from samebits.ops.triton.linear_tiles import FUSED_MIN_M

# The sources whose arithmetic decides the bits (kernels and the host code choosing segments,
# splits and key blocks); launch tuning that cannot change the bits lives in them too, so the
# digest errs on the side of a new fingerprint.
_ARITHMETIC_SOURCES = ("activation.py", "attention.py", "attention_kernels.py", "attention_gluon.py",
                       "linear.py", "linear_kernels.py", "rms_norm.py", "rope.py", "softmax.py",
                       "moe.py", "gemv_staged.py",
                       "../backend.py")  # ../backend.py: tree_sum, the segments' order


def _arithmetic_digest() -> str:
    h = hashlib.sha256()
    for name in _ARITHMETIC_SOURCES:
        h.update((Path(__file__).parent / name).read_bytes())
    return h.hexdigest()[:12]


@register("cuda", True)
class TritonBackend(InvariantEncoderOps):
    # enters the numerics fingerprint (prefix-cache keys): derived from the kernels' sources
    name = f"triton-cuda|{_arithmetic_digest()}"
    batch_invariant = True
    # Two K chains on one device (the second chain's accumulator beside the first costs a few
    # percent of a prefill GEMM and nothing at decode: benchmarks/segmented_linear.py), one a
    # rank at TP 2: TP 1 == TP 2. Larger N run N chains (their own bits).
    row_parallel_chains = staticmethod(paired_chains)
    # rms_norm takes a PendingRankSum for x (a row-parallel layer's gathered rank sums, left to
    # the residual add + norm: samebits.models.parallel)
    sums_in_norm = True
    # up to FUSED_MIN_M rows the segmented linear writes each chain's fp32 partial and sums them
    # in a second launch (linear_tiles.py); the norm's kernel adds them instead
    partials_into_norm_rows = FUSED_MIN_M
    # decode GEMVs in Hopper graphs (qkv, o_proj's chains, a router) stage their weights in
    # shared memory before their wait (gemv_staged.py): the same bits as linear.py's kernels
    staged_gemv = True

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
               k_bounds: KBounds | None = None) -> torch.Tensor:
        """With ``k_bounds``: one fp32 partial per K segment, added in ``tree_sum``'s order
        (linear.py); CUDA-graph safe (no host values of the batch)."""
        if k_bounds is None and self.staged_gemv and gemv_staged.takes(x, w, b):
            return gemv_staged.gemv_staged(x, w, b)
        return linear.linear(x, w, b, k_bounds)

    def linear_partials(self, x: torch.Tensor | PendingMerge, w: torch.Tensor,
                        k_bounds: KBounds) -> torch.Tensor:
        """``PendingMerge`` x (``attention_deferred``): the staged GEMV merges the partials
        itself where it takes them, else the merge kernel runs first; the same bits."""
        segments = len(k_bounds)
        if isinstance(x, PendingMerge):
            if gemv_staged.merges(w, x, segments) and \
                    gemv_staged.even_bounds(k_bounds, w.shape[1]):
                return gemv_staged.merged_partials(x, w, segments)
            x = x.resolve()
        if self.staged_gemv and gemv_staged.takes(x, w, None, segments, partials=True) and \
                gemv_staged.even_bounds(k_bounds, x.shape[-1]):
            return gemv_staged.gemv_staged(x, w, segments=segments, partials=True)
        return linear.partials(x, w, k_bounds)

    def linear_sum(self, x: torch.Tensor, w: torch.Tensor, k_bounds: KBounds,
                   out: torch.Tensor | None = None, peer_out: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """The segments tree-summed in fp32 (linear.py's schedules), written into ``out`` and
        ``peer_out`` when given (the kernel that stores the sum stores each tile into both:
        no copy)."""
        return linear.linear_sum(x, w, k_bounds, out, peer_out)

    def sum_tree(self, partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """One tree sum kernel launch (power-of-two counts), else torch."""
        return linear.sum_tree(partials, dtype)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor, k_bounds: KBounds | None = None
                 ) -> torch.Tensor:
        """One kernel with the bits of ``F.silu(gate) * up`` (activation.py); gate and up may be
        the halves of gate_up's rows. A CUDA element's bits do not depend on the tensor's shape,
        so ``k_bounds`` changes nothing."""
        if activation.supports(gate, up):
            return activation.silu_mul(gate, up)
        return F.silu(gate) * up

    def rms_norm(self, x: torch.Tensor | PendingRankSum, w: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With ``residual``: (rms_norm(x + residual), x + residual) in one pass, the bits of the
        add then the norm. x may be a row-parallel layer's ``PendingRankSum`` (``sums_in_norm``):
        with a residual and a count the kernel takes, its tree sum and cast run in the same pass
        (the bits of ``sum_tree`` first); else it is resolved first."""
        if isinstance(x, PendingRankSum):
            if residual is not None and rms_norm.takes_rank_sum(x):
                return rms_norm.rank_sum_add_rms_norm(x, residual, w, eps)
            x = x.resolve(self)
        if residual is None:
            return rms_norm.rms_norm(x, w, eps)
        return rms_norm.add_rms_norm(x, residual, w, eps)

    def qkv_rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       hq: int, hkv: int, d: int, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """One kernel (rope.py) with the composition's bits; the composition where it does not
        apply (mixed dtypes, strided operands)."""
        args = (qkv, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, slot_mapping, hq, hkv, d,
                out)
        if rope.supports(qkv, cos, sin, q_norm, k_norm, k_cache, v_cache, hq, hkv, d):
            return rope.qkv_rope_store(*args)
        return composed_prologue(rms_norm.rms_norm, *args)

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        return softmax.softmax(x)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return softmax.log_softmax(x)

    def plan_attention(self, meta: AttentionMetadata) -> AttentionMetadata:
        return attention.plan_attention(meta)

    def plan_decode(self, meta: AttentionMetadata, positions: torch.Tensor, max_len: int
                    ) -> AttentionMetadata:
        """Pure-decode plan over caller-owned tensors (CUDA graphs); the split size stays fixed."""
        plan = attention.plan_decode(meta, positions, -(-max_len // meta.split_size))
        return dataclasses.replace(meta, plan=plan)

    def as_captured(self) -> AbstractContextManager[None]:
        """Programmatic dependent launch on: the engine's graph variants (launcher.py)."""
        return launcher.as_captured()

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
        return attention.attention(q, k_cache, v_cache, meta, scale, out)

    def attention_deferred(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float) -> torch.Tensor | PendingMerge:
        """One decode token on Hopper with the staged GEMVs: its merge left to o_proj's GEMV
        (``linear_partials``), up to ``gemv_staged.MAX_MERGED_SPLITS`` splits."""
        if not (self.staged_gemv and launcher.programmatic(q)):  # in captured graphs only
            return self.attention(q, k_cache, v_cache, meta, scale)
        return attention.attention_deferred(q, k_cache, v_cache, meta, scale,
                                            gemv_staged.MAX_MERGED_SPLITS)

    # encoder attention: fixed-shape torch products (samebits.ops.encoder_cuda)
    plan_encoder = staticmethod(encoder_cuda.plan_encoder)
    encoder_attention = staticmethod(encoder_cuda.encoder_attention)
