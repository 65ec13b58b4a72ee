"""Batch-invariant softmax and log_softmax over the last dim on CUDA.

One program per row. Rows of at most ``SINGLE_MAX`` elements are held whole (``BLOCK`` =
next power of two); longer rows are walked in ``LOOP_BLOCK`` chunks in ascending order, each lane
keeping its own running (max, sum) that is rescaled as the max grows; the lanes are combined by one
``tl.max`` / ``tl.sum`` at the end. Block size, chunk count and warps are functions of the row
length N alone, so a row's bits depend on its own values only -- not on the row count or position.
Computed in fp32; the result is cast to the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SINGLE_MAX = 8192
LOOP_BLOCK = 4096


@triton.jit
def _row_stats(x_ptr, N, BLOCK: tl.constexpr, SINGLE: tl.constexpr):
    """(max, sum(exp(x - max))) of one row, in a fixed order."""
    offs = tl.arange(0, BLOCK)
    if SINGLE:
        x = tl.load(x_ptr + offs, mask=offs < N, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        s = tl.sum(tl.exp(x - m), 0)
    else:
        m_vec = tl.full([BLOCK], float("-inf"), tl.float32)
        s_vec = tl.zeros([BLOCK], tl.float32)
        for start in range(0, N, BLOCK):
            x = tl.load(x_ptr + start + offs, mask=start + offs < N,
                        other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m_vec, x)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s_vec = s_vec * tl.exp(m_vec - m_safe) + tl.exp(x - m_safe)
            m_vec = m_new
        m = tl.max(m_vec, 0)
        s = tl.sum(s_vec * tl.exp(m_vec - m), 0)
    return m, s


@triton.jit
def _softmax_kernel(x_ptr, out_ptr, N, stride_x, stride_o, LOG: tl.constexpr,
                    BLOCK: tl.constexpr, SINGLE: tl.constexpr):
    """softmax (LOG=False) or log_softmax (LOG=True) of row ``program_id(0)``.

    Invariance: the row's output depends on that row alone; BLOCK / SINGLE / warps depend on N.
    """
    row = tl.program_id(0).to(tl.int64)
    x_ptr += row * stride_x
    out_ptr += row * stride_o
    m, s = _row_stats(x_ptr, N, BLOCK, SINGLE)
    log_s = tl.log(s)
    inv_s = 1.0 / s
    for start in range(0, N, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
        if LOG:
            y = (x - m) - log_s
        else:
            y = tl.exp(x - m) * inv_s
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=offs < N)


def _launch(x: torch.Tensor, log: bool) -> torch.Tensor:
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    m = x2.shape[0]
    if m and n:
        single = n <= SINGLE_MAX
        block = triton.next_power_of_2(n) if single else LOOP_BLOCK
        warps = min(16, max(4, block // 512))
        _softmax_kernel[(m,)](x2, out, n, x2.stride(0), out.stride(0), LOG=log, BLOCK=block,
                              SINGLE=single, num_warps=warps)
    return out.reshape(x.shape)


def softmax(x: torch.Tensor) -> torch.Tensor:
    return _launch(x, log=False)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    return _launch(x, log=True)
