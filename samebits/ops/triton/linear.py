"""Batch-invariant ``linear`` on CUDA: a Triton GEMM whose K order is fixed by (K, N) alone.

Arithmetic contract (what fixes the bits of ``out[i, j]``):

- K is cut into ``num_segments(K, N)`` ordered segments of ``segment_len(K, N)`` elements (a
  multiple of ``SEGMENT_ALIGN``; the last one may be shorter): functions of the weight shape only.
- Each segment is accumulated from zero in fp32 by ``tl.dot`` over ascending K (the tensor cores
  take 16 K-elements per step; fp32 inputs use ``input_precision="ieee"``, plain FMAs).
- The segment partials are summed in order, ``((p0 + p1) + p2) + ...``, then the bias is added in
  fp32 and the sum is cast once to the output dtype.

Tile shapes (BLOCK_M/N/K, warps, stages) follow the row count M for speed; on Hopper they do not
change the bits (design.md section 2, re-checked by tests/gpu/test_linear_bits.py). Two schedules
give the same bits: *fused* (one program per output tile walks every segment, the partials kept in
registers) and *split* (one program per tile and segment writes an fp32 partial, and
``_sum_partials_kernel`` adds them in order) -- split-K parallelism for small M.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

SEGMENT_ALIGN = 256  # segment lengths are multiples of this (every BLOCK_K divides it)
SPLIT_MAX_M = 64  # at or below this many rows, segments run as separate programs (split-K)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


def num_segments(k: int, n: int) -> int:
    """Ordered K segments: a function of the weight shape alone (never of M)."""
    if n >= 16384 or k < 2048:
        return 1
    return 2 if n >= 6144 else 4


def segment_len(k: int, n: int) -> int:
    s = num_segments(k, n)
    return -(-k // (s * SEGMENT_ALIGN)) * SEGMENT_ALIGN


def pick_config(m: int, n: int, k: int, dtype: torch.dtype) -> GemmConfig:
    """Tile shape for an M-row product (free to vary: it does not change the bits)."""
    if dtype == torch.float32:  # FMA path: small tiles, BLOCK_K divides SEGMENT_ALIGN
        return GemmConfig(32 if m <= 32 else 64, 64, 32, 4, 3)
    if m <= 16:
        return GemmConfig(16, 32, 256, 4, 4)
    if m <= 32:
        return GemmConfig(32, 64, 128, 4, 4)
    if m <= 64:
        return GemmConfig(64, 64, 128, 4, 4)
    if m <= 128:
        return GemmConfig(64, 128, 64, 4, 4)
    if m <= 512:
        return GemmConfig(128, 128, 64, 8, 4)
    return GemmConfig(128, 256, 64, 8, 3)


@triton.jit
def _segment_dot(x_ptr, w_ptr, offs_m, offs_n, k_lo, k_hi, K, stride_xm, stride_wn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 sum over k in [k_lo, k_hi) of x[m, k] * w[n, k], from zero, ascending K."""
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + (k_lo + offs_k)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            a = tl.load(x_ptrs, mask=(k + offs_k)[None, :] < K, other=0.0)
            b = tl.load(w_ptrs, mask=(k + offs_k)[:, None] < K, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   stride_ps, SEG_K, NUM_SEGS, SPLIT: tl.constexpr, MULTI: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    """out = x @ w.T (+ b) with the segment order of the module docstring.

    Invariance: ``out[i, j]`` depends only on x[i, :], w[j, :], b[j] and (SEG_K, NUM_SEGS) --
    not on M, the row's position, the tile shape or the program count. SPLIT=True writes the fp32
    partial of segment ``program_id(1)`` to ``out_ptr + seg * stride_ps`` instead; MULTI is
    ``NUM_SEGS > 1`` (compile-time, so one segment keeps one accumulator).
    """
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = (rows % M).to(tl.int64)  # clamped rows/cols: loads need no masks, the store is masked
    offs_n = (cols % N).to(tl.int64)
    if SPLIT:
        seg = tl.program_id(1)
        k_lo = seg * SEG_K
        total = _segment_dot(x_ptr, w_ptr, offs_m, offs_n, k_lo, tl.minimum(k_lo + SEG_K, K), K,
                             stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
        out_ptr += seg * stride_ps
    else:
        total = _segment_dot(x_ptr, w_ptr, offs_m, offs_n, 0, tl.minimum(SEG_K, K), K,
                             stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
        if MULTI:  # NUM_SEGS > 1
            for seg in range(1, NUM_SEGS):
                k_lo = seg * SEG_K
                total += _segment_dot(x_ptr, w_ptr, offs_m, offs_n, k_lo,
                                      tl.minimum(k_lo + SEG_K, K), K, stride_xm, stride_wn,
                                      BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
        if HAS_BIAS:
            total += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_partials_kernel(part_ptr, b_ptr, out_ptr, MN, N, NUM_SEGS, HAS_BIAS: tl.constexpr,
                         BLOCK: tl.constexpr):
    """out = ((p0 + p1) + p2) ... (+ b): the fused kernel's sum, element by element."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    total = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for seg in range(1, NUM_SEGS):
        total += tl.load(part_ptr + seg * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K].T (+ b) -> [..., N]; see the module docstring for the contract."""
    *lead, k = x.shape
    n = w.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = x.new_empty(m, n)
    if m and n:
        run(x2, w, b, out, pick_config(m, n, k, x.dtype), num_segments(k, n))
    return out.reshape(*lead, n)


def run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor,
        cfg: GemmConfig, segments: int, split: bool | None = None) -> None:
    """Launch with an explicit tile config and segment count (benchmarks sweep these)."""
    m, k = x.shape
    n = w.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    seg_k = -(-k // (segments * SEGMENT_ALIGN)) * SEGMENT_ALIGN
    segs = -(-k // seg_k)
    split = segs > 1 and m <= SPLIT_MAX_M if split is None else split and segs > 1
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    even_k = k % SEGMENT_ALIGN == 0 and k % cfg.block_k == 0
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    target = x.new_empty(segs, m, n, dtype=torch.float32) if split else out
    _linear_kernel[(tiles, segs if split else 1)](
        x, w, b if b is not None else x, target, m, n, k, x.stride(0), w.stride(0),
        target.stride(-2), m * n, SEG_K=seg_k, NUM_SEGS=segs, SPLIT=split, MULTI=segs > 1,
        HAS_BIAS=b is not None and not split, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=even_k, PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split:
        block = 1024
        _sum_partials_kernel[(triton.cdiv(m * n, block),)](
            target, b if b is not None else x, out, m * n, n, NUM_SEGS=segs,
            HAS_BIAS=b is not None, BLOCK=block, num_warps=4)
