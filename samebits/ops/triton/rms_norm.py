"""Batch-invariant RMSNorm (and residual add + RMSNorm) on CUDA.

Each program normalizes ``ROWS`` whole rows; the row's sum of squares is one ``tl.sum`` over a
``[ROWS, BLOCK]`` tile whose shape and warp count are functions of the hidden size H alone. Every
row of the tile is reduced by the same lanes in the same tree, so a row's bits depend on its own
values, the weight and eps -- never on the row count, its position, or its neighbours.

Arithmetic (HF order): ``h = x.float(); y = (h * rsqrt(mean(h*h) + eps)).to(x.dtype); out = w * y``
with the product taken in fp32 and rounded once to ``promote(w.dtype, x.dtype)``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from samebits.ops.pending_rank_sum import PendingRankSum
from samebits.ops.triton.launcher import (
    Launcher,
    aligned,
    alignment,
    programmatic,
    wait_for_inputs,
)
from samebits.ops.triton.tree import tree_push

MAX_BLOCK = 65536
# fma contraction on (the first butterfly step of the row sum fuses a lane's own square into the
# add): part of the arithmetic, pinned here for every kernel that reuses these helpers
FP_FUSION = True


@triton.jit
def inv_rms(x, H, eps):
    """``rsqrt(mean(x^2) + eps)`` of each row of the ``[ROWS, BLOCK]`` tile ``x`` (masked columns
    zero), in fp32: one ``tl.sum`` whose tree is fixed by the tile shape and warp count."""
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=1) / H
    return tl.rsqrt(var + eps)


@triton.jit
def normalize(x, inv):
    """``(x.float() * inv).to(x.dtype)`` row by row (HF's order: normalize, round, then weigh)."""
    return (x.to(tl.float32) * inv[:, None]).to(x.dtype)


@triton.jit
def weigh(y, w):
    """``w * y`` in fp32 (the caller rounds to ``promote(w.dtype, y.dtype)``)."""
    return w.to(tl.float32)[None, :] * y.to(tl.float32)


@triton.jit
def add_norm_store(x, r_ptr, w_ptr, out_ptr, sum_ptr, rows, cols, mask, H, stride_r, stride_o,
                   stride_s, eps, HAS_RES: tl.constexpr):
    """A row program's work once its ``[ROWS, BLOCK]`` tile ``x`` is in registers: with HAS_RES
    ``x + r`` (fp32, rounded to x's dtype) stored as the sum and normalized in its place; then
    ``w * rms_normalize(x)`` stored (rounded to out's dtype). ``rows`` int64 [ROWS], ``cols``
    [BLOCK], ``mask`` [ROWS, BLOCK]."""
    if HAS_RES:
        r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + rows[:, None] * stride_s + cols[None, :], x, mask=mask)
    y = normalize(x, inv_rms(x, H, eps))
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0)
    out = weigh(y, w)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])  # one compile serves every row count
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, M, H, stride_x, stride_r, stride_o,
                     stride_s, eps, HAS_RES: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out = w * rms_normalize(x (+ r)); with HAS_RES also sum_out = x + r (in x's dtype).

    Invariance: row i's outputs depend on x[i] (and r[i]), w and eps only; (ROWS, BLOCK, warps)
    are fixed by H.
    """
    wait_for_inputs(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < M)[:, None] & (cols < H)[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    add_norm_store(x, r_ptr, w_ptr, out_ptr, sum_ptr, rows, cols, mask, H, stride_r, stride_o,
                   stride_s, eps, HAS_RES)


@triton.jit
def rank_tree(p_ptr, offs, mask, stride_n, NUM: tl.constexpr):
    """``tree_sum`` of the NUM fp32 tiles ``p_ptr + n stride_n + offs`` (n < NUM), added as they
    load (``tree.tree_push``): the adds of the tree sum kernel (``_sum_partials_kernel``)."""
    s0 = tl.load(p_ptr + offs, mask=mask, other=0.0)
    s1 = s0
    s2 = s0
    s3 = s0
    for n in tl.static_range(1, NUM):
        v = tl.load(p_ptr + n * stride_n + offs, mask=mask, other=0.0)
        s0, s1, s2, s3 = tree_push(v, s0, s1, s2, s3, NUM, n)
    return s0


@triton.jit(do_not_specialize=["M"])
def _rank_sum_add_rms_norm_kernel(p_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, M, H, stride_r, eps,
                                  NUM: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                                  PDL: tl.constexpr):
    """``_rms_norm_kernel`` with HAS_RES whose x is a pending rank sum: x = ``rank_tree`` of the
    NUM contiguous fp32 [M, H] parts, cast once to the sum's dtype (``sum_ptr``'s).

    Invariance: row i's outputs depend on the parts' row i, r[i], w and eps only; (ROWS, BLOCK,
    warps) are the norm's, fixed by H.
    """
    wait_for_inputs(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < M)[:, None] & (cols < H)[None, :]
    rows = rows.to(tl.int64)
    offs = rows[:, None] * H + cols[None, :]
    x = rank_tree(p_ptr, offs, mask, M.to(tl.int64) * H, NUM).to(sum_ptr.dtype.element_ty)
    add_norm_store(x, r_ptr, w_ptr, out_ptr, sum_ptr, rows, cols, mask, H, stride_r, H, H, eps,
                   True)


@functools.cache
def _shape(h: int) -> tuple[int, int, int]:
    """(ROWS, BLOCK, num_warps): a function of the hidden size alone."""
    block = triton.next_power_of_2(h)
    if block > MAX_BLOCK:
        raise NotImplementedError(f"rms_norm: hidden size {h} > {MAX_BLOCK}")
    rows = max(1, min(16, 2048 // block))
    warps = min(16, max(4, rows * block // 512))
    return rows, block, warps


def _launch(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, eps: float
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """rms_norm(x (+ r)) and the sum; one launch, its pointers passed to the C launcher as ints
    (``Launcher.direct``). Written for the host time of a 2-D contiguous call: each tensor
    attribute is read once."""
    strides, m_h = x.stride(), x.shape
    if len(strides) != 2 or strides[1] != 1 or (r is not None and (r.dim() != 2
                                                                    or r.stride(-1) != 1)):
        return _launch_rows(x, r, w, eps)
    (m, h), stride_x = m_h, strides[0]
    dtype, w_dtype = x.dtype, w.dtype
    out_dtype = dtype if w_dtype == dtype else _out_dtype(w_dtype, dtype)
    contiguous = stride_x == h
    out = torch.empty_like(x) if contiguous and out_dtype == dtype else \
        x.new_empty(m_h, dtype=out_dtype)
    summed = None if r is None else torch.empty_like(x) if contiguous else x.new_empty(m_h)
    if not m:
        return out, summed
    device = x.get_device()
    if w.get_device() != device or (r is not None and r.get_device() != device):
        raise ValueError(f"rms_norm: x is on {x.device}, w on {w.device}"
                         + ("" if r is None else f", residual on {r.device}"))
    px, pw, po = x.data_ptr(), w.data_ptr(), out.data_ptr()
    if r is None:
        pr, r_dtype, stride_r, ps = px, dtype, stride_x, po
    else:
        pr, r_dtype, stride_r, ps = r.data_ptr(), r.dtype, r.stride(0), summed.data_ptr()
    key, grid, tail, options = _plan(m, h, dtype, r_dtype, w_dtype, stride_x, stride_r, eps,
                                     r is not None, programmatic(x), px & 15, pr & 15, pw & 15)
    direct = _RMS_NORM.direct(key, device)
    if direct is not None:
        direct(grid, (px, pr, pw, po, ps, *tail))
    else:
        _RMS_NORM(key, grid, x, x if r is None else r, w, out, out if summed is None else summed,
                  *tail, **options)
    return out, summed


def _launch_rows(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_launch`` of any shape: over x (and r) as [rows, H] with unit column stride."""
    h = x.shape[-1]
    out, summed = _launch(_rows(x), None if r is None else _rows(r), w, eps)
    lead = x.shape[:-1]
    return out.reshape(*lead, h), (summed.reshape(*lead, h) if summed is not None else None)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, H] with unit column stride."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@functools.lru_cache(maxsize=1024)
def _plan(m: int, h: int, x_dtype: torch.dtype, r_dtype: torch.dtype, w_dtype: torch.dtype,
          stride_x: int, stride_r: int, eps: float, has_res: bool, pdl: bool,
          *offsets: int) -> tuple[int, tuple[int, int, int], tuple, dict]:
    """(launch key, grid, the arguments after the tensors, launch options) of one call;
    ``offsets``: x's, r's and w's data pointers mod 16. The outputs are new [M, H] tensors
    (stride H, aligned)."""
    rows, block, warps = _shape(h)
    key = _RMS_NORM.intern((x_dtype, r_dtype, w_dtype, h, stride_x, stride_r, eps, has_res, pdl,
                            alignment(*offsets)))
    tail = (m, h, stride_x, stride_r, h, h, eps, has_res, rows, block, pdl)
    return key, (triton.cdiv(m, rows), 1, 1), tail, dict(num_warps=warps,
                                                           enable_fp_fusion=FP_FUSION,
                                                           launch_pdl=pdl)


@functools.cache
def _out_dtype(w: torch.dtype, x: torch.dtype) -> torch.dtype:
    return torch.promote_types(w, x)


_RMS_NORM = Launcher(_rms_norm_kernel)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, w, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to x's dtype first."""
    out, summed = _launch(x, residual, w, eps)
    assert summed is not None
    return out, summed


_RANK_SUM_NORM = Launcher(_rank_sum_add_rms_norm_kernel)
RANK_SUM_MAX = 8  # the most parts ``rank_tree`` adds (a power of two)


def takes_rank_sum(x: PendingRankSum) -> bool:
    """Whether ``rank_sum_add_rms_norm`` takes ``x``: a power-of-two count up to RANK_SUM_MAX,
    into an fp32 / fp16 / bf16 sum (``sum_tree``'s kernel's outputs)."""
    n = x.count
    return (0 < n <= RANK_SUM_MAX and n & (n - 1) == 0
            and x.dtype in (torch.float32, torch.float16, torch.bfloat16))


def rank_sum_add_rms_norm(x: PendingRankSum, residual: torch.Tensor, w: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm(sum_tree(x.parts, x.dtype), residual, w, eps)`` in one launch, bit for bit:
    the tree sum kernel's adds, one cast to x's dtype, then this module's add and norm over the
    same tile shape. ``x`` must pass ``takes_rank_sum``."""
    h = x.shape[-1]
    if residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} for a rank sum of "
                         f"{tuple(x.shape)}")
    parts = x.parts.reshape(x.count, -1, h)
    parts = parts if parts.is_contiguous() else parts.contiguous()
    r = _rows(residual)
    m = parts.shape[1]
    out = parts.new_empty((m, h), dtype=_out_dtype(w.dtype, x.dtype))
    summed = parts.new_empty((m, h), dtype=x.dtype)
    if m:
        _launch_rank_sum(parts, r, w, out, summed, eps)
    return out.reshape(x.shape), summed.reshape(x.shape)


def _launch_rank_sum(parts: torch.Tensor, r: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                     summed: torch.Tensor, eps: float) -> None:
    """One launch of ``_rank_sum_add_rms_norm_kernel``; ``parts`` contiguous [N, M, H], ``r``
    [M, H] with unit column stride, ``out`` and ``summed`` new [M, H]."""
    n, m, h = parts.shape
    device = parts.get_device()
    if w.get_device() != device or r.get_device() != device:
        raise ValueError(f"rms_norm: the rank sum is on {parts.device}, w on {w.device}, "
                         f"residual on {r.device}")
    rows, block, warps = _shape(h)
    pdl = programmatic(parts)
    key = _RANK_SUM_NORM.intern((summed.dtype, r.dtype, w.dtype, h, r.stride(0), eps, n, pdl,
                                 aligned(parts, r, w)))
    grid = (triton.cdiv(m, rows), 1, 1)
    direct = _RANK_SUM_NORM.direct(key, device)
    if direct is not None:
        direct(grid, (parts.data_ptr(), r.data_ptr(), w.data_ptr(), out.data_ptr(),
                      summed.data_ptr(), m, h, r.stride(0), eps, n, rows, block, pdl))
    else:
        _RANK_SUM_NORM(key, grid, parts, r, w, out, summed, m, h, r.stride(0), eps, n, rows,
                       block, pdl, num_warps=warps, enable_fp_fusion=FP_FUSION, launch_pdl=pdl)
