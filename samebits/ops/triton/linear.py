"""Batch-invariant ``linear`` on CUDA: a Triton GEMM whose K order is fixed by (K, N) alone.

Arithmetic contract (what fixes the bits of ``out[i, j]``):

- K is cut into ordered segments, functions of the weight shape and the caller's ``k_bounds``
  only: by default ``num_segments(K, N)`` segments of ``segment_len(K, N)`` elements (a multiple of
  ``SEGMENT_ALIGN``; the last one may be shorter); with ``k_bounds`` (the row-parallel linears'
  segmented K, ``samebits.ops.backend``) exactly those, which must be near-equal (a run of lengths
  q+1 then q, as ``samebits.distributed.segments.bounds`` cuts them: a ``SegmentLayout``).
- Each segment is accumulated from zero in fp32 by ``tl.dot`` over ascending K (the tensor cores
  take 16 K-elements per step; fp32 inputs use ``input_precision="ieee"``, plain FMAs).
  Today ``num_segments`` is 1 for every shape, i.e. a plain fp32 accumulation over all of K.
- The segment partials are summed in order, ``((p0 + p1) + p2) + ...``, then the bias is added in
  fp32 and the sum is cast once to the output dtype (with ``k_bounds``: cast first, then the bias
  added in the output dtype, as every backend does for segmented K). ``partials`` returns the
  fp32 partials unsummed (a tensor-parallel rank's share).

Tile shapes (BLOCK_M/N/K, warps, stages) follow the row count M for speed; on Hopper they do not
change the bits (design.md section 2, re-checked by tests/gpu/test_linear_bits.py). Two schedules
give the same bits: *fused* (one program per output tile walks every segment, the partials kept in
registers) and *split* (one program per tile and segment writes an fp32 partial, and
``_sum_partials_kernel`` adds them in order) -- split-K parallelism for small M. With one segment,
rows above 64 take ``_linear_tma_kernel`` (persistent, TMA loads), smaller ones the pointer kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from samebits.ops.backend import KBounds, check_k_bounds
from samebits.ops.triton import linear_kernels as K
from samebits.ops.triton.launcher import Launcher, aligned, programmatic

SEGMENT_ALIGN = 256  # segment lengths are multiples of this (every BLOCK_K divides it)
SPLIT_MAX_M = 64  # at or below this many rows, segments run as separate programs (split-K)
PREFETCH = 64 * 1024  # weight bytes a GEMV program prefetches while the previous kernel runs


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    tma: bool = False  # persistent TMA kernel (16-bit dtypes, 16-byte aligned rows)
    prefetch: int = 0  # bytes of its weight rows a program asks L2 for before its input is ready

    def __post_init__(self) -> None:
        threads = self.num_warps * 32
        if self.prefetch and (threads % self.block_n or self.prefetch % (16 * threads)):
            raise ValueError(f"prefetch needs BLOCK_N | threads and 16 * threads | bytes: {self}")


@dataclasses.dataclass(frozen=True)
class SegmentLayout:
    """``count`` K segments: segment s starts at ``s * base + min(s, extra)`` and has ``base``
    columns, one more when s < extra; the last one is clipped to K."""

    count: int
    base: int
    extra: int = 0

    def __post_init__(self) -> None:
        if self.count < 1 or self.base < 1 or not 0 <= self.extra < self.count:
            raise ValueError(f"bad segment layout {self}")

    @classmethod
    def uniform(cls, k: int, segments: int) -> SegmentLayout:
        """``segments`` segments of a multiple of SEGMENT_ALIGN columns (fewer if K is short)."""
        seg_k = -(-k // (segments * SEGMENT_ALIGN)) * SEGMENT_ALIGN
        return cls(-(-k // seg_k), seg_k)

    @classmethod
    @functools.lru_cache(maxsize=256)
    def from_bounds(cls, k_bounds: KBounds, k: int) -> SegmentLayout:
        """The layout of near-equal ``k_bounds`` (lengths q+1 ... then q ...); else ValueError."""
        check_k_bounds(k_bounds, k)
        lengths = [hi - lo for lo, hi in k_bounds]
        base, extra = min(lengths), sum(1 for n in lengths if n > min(lengths))
        layout = cls(len(lengths), base, extra)
        if lengths != [base + (s < extra) for s in range(len(lengths))]:
            raise ValueError(f"the Triton linear takes near-equal K segments, got {k_bounds}")
        return layout

    def even(self, k: int, block_k: int) -> bool:
        """Every segment a whole number of BLOCK_K steps (the kernel's loads need no masks)."""
        return self.extra == 0 and self.base % block_k == 0 and k % block_k == 0


# the pointer kernel's tile for segmented products above SPLIT_MAX_M rows (the fused schedule)
SEGMENTED_FUSED = GemmConfig(128, 128, 64, 8, 3)


def num_segments(k: int, n: int) -> int:
    """Ordered K segments: a function of the weight shape alone (never of M).

    One everywhere: on the H200 an ordered split-K never beat the best single-segment tile
    (benchmarks/NOTES-kernels.md). The machinery stays tested for shapes that may need it.
    """
    return 1


def segment_len(k: int, n: int) -> int:
    s = num_segments(k, n)
    return -(-k // (s * SEGMENT_ALIGN)) * SEGMENT_ALIGN


@functools.lru_cache(maxsize=4096)
def pick_config(m: int, n: int, k: int, dtype: torch.dtype) -> GemmConfig:
    """Tile shape for an M-row product (free to vary: it does not change the bits)."""
    if dtype == torch.float32:  # FMA path: small tiles, BLOCK_K divides SEGMENT_ALIGN
        return GemmConfig(32 if m <= 32 else 64, 64, 32, 4, 3)
    if m <= 8:
        if n < 24576:
            return GemmConfig(16, 64, 256, 4, 4, prefetch=PREFETCH)
        return GemmConfig(16, 64, 128, 4, 5, prefetch=PREFETCH)
    if m <= 16:
        return GemmConfig(16, 64, 256, 4, 4, prefetch=PREFETCH)
    if m <= 32:
        return GemmConfig(32, 32, 256, 4, 4, prefetch=PREFETCH)
    if m <= 64:
        return GemmConfig(64, 64, 128, 4, 4, prefetch=PREFETCH)
    if m <= 128:  # tiles picked on the H200 sweep (benchmarks/NOTES-kernels.md)
        if n <= 4096:
            return GemmConfig(64, 64, 256, 4, 3, tma=True)
        return GemmConfig(64, 128, 128, 4, 4, tma=True)
    if m <= 1024 and n < 16384:
        return GemmConfig(64, 128, 128, 4, 4, tma=True)
    return GemmConfig(128, 256, 64, 8, 3, group_m=16, tma=True)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           k_bounds: KBounds | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K].T (+ b) -> [..., N]; see the module docstring for the contract."""
    k, n = x.shape[-1], w.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = x.new_empty(m, n)
    if k_bounds is None:
        cfg = pick_config(m, n, k, x.dtype)
        if m and n:
            run(x2, w, b, out, cfg, num_segments(k, n))
        return out.reshape(*x.shape[:-1], n)
    segments = SegmentLayout.from_bounds(k_bounds, k)
    cfg = pick_config(m, n, k, x.dtype)
    if m > SPLIT_MAX_M and x.dtype != torch.float32:
        cfg = SEGMENTED_FUSED  # two tile accumulators in registers: the TMA tiles would spill
    if m and n:
        run(x2, w, None, out, cfg, segments)
    if b is not None:
        out = out + b
    return out.reshape(*x.shape[:-1], n)


def partials(x: torch.Tensor, w: torch.Tensor, k_bounds: KBounds) -> torch.Tensor:
    """[S, ..., N] fp32: each K segment's partial, the very values ``linear`` with ``k_bounds``
    adds (the split schedule, whatever M)."""
    *lead, k = x.shape
    n = w.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    layout = SegmentLayout.from_bounds(k_bounds, k)
    out = x.new_empty(layout.count, m, n, dtype=torch.float32)
    if m and n:
        run(x2, w, None, out, pick_config(m, n, k, x.dtype), layout, split=True)
    return out.reshape(layout.count, *lead, n)


def run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor,
        cfg: GemmConfig, segments: int | SegmentLayout, split: bool | None = None) -> None:
    """Launch with an explicit tile config and segments (a count of uniform segments, or a
    layout); benchmarks sweep these. ``out`` [S, M, N] fp32 with ``split=True`` and no bias:
    the partials are left unsummed there."""
    m, k = x.shape
    n = w.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    layout = _uniform(k, segments) if isinstance(segments, int) else segments
    segs, keep = layout.count, out.dim() == 3  # keep: the caller wants the partials themselves
    if cfg.tma and segs == 1 and not keep and _tma_ok(x, w, out):
        return _run_tma(x, w, b, out, cfg)
    split = keep or (segs > 1 and (m <= SPLIT_MAX_M if split is None else split))
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    target = out if keep or not split else x.new_empty(segs, m, n, dtype=torch.float32)
    bias = b if b is not None else x
    even, pdl = layout.even(k, cfg.block_k), programmatic(x)
    rows_aligned = aligned(w) == 1 and (w.stride(0) * w.element_size()) % 16 == 0
    prefetch = cfg.prefetch if pdl and not split and rows_aligned else 0  # bulk prefetch: 16 B
    key = (x.dtype, w.dtype, target.dtype, b is not None, n, k, x.stride(0), w.stride(0),
           target.stride(-2), layout, split, cfg, even, pdl, prefetch, aligned(x, w, bias, target))
    _LINEAR(key, (tiles, segs if split else 1), x, w, bias, target, m, n, k, x.stride(0),
            w.stride(0), target.stride(-2), m * n, layout.base, layout.extra, segs, split,
            segs > 1, b is not None and not split, cfg.block_m, cfg.block_n, cfg.block_k,
            cfg.group_m, even, "ieee" if x.dtype == torch.float32 else "tf32", pdl,
            prefetch, cfg.num_warps * 32, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            launch_pdl=pdl)
    if split and not keep:
        block = 1024
        _SUM_PARTIALS((target.dtype, out.dtype, b is not None, segs, pdl,
                       aligned(target, bias, out)),
                      (triton.cdiv(m * n, block),), target, bias, out, m * n, n, segs,
                      b is not None, block, pdl, num_warps=4, launch_pdl=pdl)


@functools.lru_cache(maxsize=64)
def _uniform(k: int, segments: int) -> SegmentLayout:
    return SegmentLayout.uniform(k, segments)


_LINEAR = Launcher(K._linear_kernel)
_SUM_PARTIALS = Launcher(K._sum_partials_kernel)
_TMA = Launcher(K._linear_tma_kernel)


def _tma_ok(*ts: torch.Tensor) -> bool:
    return all(t.dtype in (torch.bfloat16, torch.float16) and t.is_contiguous()
               and t.data_ptr() % 16 == 0 and (t.shape[-1] * t.element_size()) % 16 == 0
               for t in ts)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _run_tma(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor,
             cfg: GemmConfig) -> None:
    m, k = x.shape
    n = w.shape[0]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    sms = _num_sms(x.device.index or 0) if x.is_cuda else 4
    programs = min(tiles, sms)
    bias, pdl = b if b is not None else x, programmatic(x)
    key = (x.dtype, w.dtype, out.dtype, b is not None, n, k, cfg, programs, pdl, aligned(bias))
    _TMA(key, (programs,), TensorDescriptor.from_tensor(x, [bm, bk]),
         TensorDescriptor.from_tensor(w, [bn, bk]), TensorDescriptor.from_tensor(out, [bm, bn]),
         bias, m, n, k, b is not None, bm, bn, bk, cfg.group_m, programs, pdl,
         num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl)
