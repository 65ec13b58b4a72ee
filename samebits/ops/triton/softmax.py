"""Batch-invariant softmax and log_softmax over the last dim on CUDA.

Rows of at most ``SINGLE_MAX`` elements: one program per row holds it whole (``BLOCK`` = next power
of two), one ``tl.max`` and one ``tl.sum``. Longer rows (vocabularies) are cut into chunks of
``CHUNK`` elements, a number fixed by the row length N: ``_chunk_stats_kernel`` walks each chunk in
``LOOP_BLOCK`` steps, every lane keeping its own running (max, sum of exp) rescaled as its max
grows, and stores the chunk's (max, sum); ``_chunk_apply_kernel`` combines a row's chunk stats in
one fixed tree and writes the chunk's outputs. Chunk count, block sizes and warps are functions of N
alone, so a row's bits depend on its own values only -- not on the row count or position.
Computed in fp32; the result is cast to the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SINGLE_MAX = 8192
CHUNK = 16384
LOOP_BLOCK = 4096


@triton.jit
def _finish(x, m, s, LOG: tl.constexpr):
    if LOG:
        return (x - m) - tl.log(s)
    return tl.exp(x - m) * (1.0 / s)


@triton.jit
def _single_kernel(x_ptr, out_ptr, N, stride_x, stride_o, LOG: tl.constexpr, BLOCK: tl.constexpr):
    """(log_)softmax of row ``program_id(0)``, held whole. Invariance: depends on the row alone."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < N, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    s = tl.sum(tl.exp(x - m), 0)
    y = _finish(x, m, s, LOG)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=offs < N)


@triton.jit
def _chunk_stats_kernel(x_ptr, stats_ptr, N, stride_x, CHUNKS: tl.constexpr,
                        CHUNK_: tl.constexpr, BLOCK: tl.constexpr):
    """(max, sum exp(x - max)) of chunk ``program_id(1)`` of row ``program_id(0)``, fixed order."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    m_vec = tl.full([BLOCK], float("-inf"), tl.float32)
    s_vec = tl.zeros([BLOCK], tl.float32)
    for start in range(chunk * CHUNK_, tl.minimum(chunk * CHUNK_ + CHUNK_, N), BLOCK):
        x = tl.load(x_ptr + row * stride_x + start + offs, mask=start + offs < N,
                    other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_vec, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_vec = s_vec * tl.exp(m_vec - m_safe) + tl.exp(x - m_safe)
        m_vec = m_new
    m = tl.max(m_vec, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(s_vec * tl.exp(m_vec - m_safe), 0)
    tl.store(stats_ptr + (row * CHUNKS + chunk) * 2, m)
    tl.store(stats_ptr + (row * CHUNKS + chunk) * 2 + 1, s)


@triton.jit
def _chunk_apply_kernel(x_ptr, stats_ptr, out_ptr, N, stride_x, stride_o, LOG: tl.constexpr,
                        CHUNKS: tl.constexpr, CP2: tl.constexpr, CHUNK_: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Combine the row's chunk stats (one fixed tree, the same in every program of the row) and
    write chunk ``program_id(1)`` of the output."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cs = tl.arange(0, CP2)
    m_c = tl.load(stats_ptr + (row * CHUNKS + cs) * 2, mask=cs < CHUNKS, other=float("-inf"))
    s_c = tl.load(stats_ptr + (row * CHUNKS + cs) * 2 + 1, mask=cs < CHUNKS, other=0.0)
    m = tl.max(m_c, 0)
    s = tl.sum(s_c * tl.exp(m_c - m), 0)
    offs = tl.arange(0, BLOCK)
    for start in range(chunk * CHUNK_, tl.minimum(chunk * CHUNK_ + CHUNK_, N), BLOCK):
        x = tl.load(x_ptr + row * stride_x + start + offs, mask=start + offs < N,
                    other=0.0).to(tl.float32)
        y = _finish(x, m, s, LOG)
        tl.store(out_ptr + row * stride_o + start + offs, y.to(out_ptr.dtype.element_ty),
                 mask=start + offs < N)


def _launch(x: torch.Tensor, log: bool) -> torch.Tensor:
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    m = x2.shape[0]
    if not (m and n):
        return out.reshape(x.shape)
    if n <= SINGLE_MAX:
        block = triton.next_power_of_2(n)
        _single_kernel[(m,)](x2, out, n, x2.stride(0), out.stride(0), LOG=log, BLOCK=block,
                             num_warps=min(16, max(4, block // 512)))
        return out.reshape(x.shape)
    chunks = triton.cdiv(n, CHUNK)
    stats = torch.empty(m, chunks, 2, dtype=torch.float32, device=x.device)
    _chunk_stats_kernel[(m, chunks)](x2, stats, n, x2.stride(0), CHUNKS=chunks, CHUNK_=CHUNK,
                                     BLOCK=LOOP_BLOCK, num_warps=8)
    _chunk_apply_kernel[(m, chunks)](x2, stats, out, n, x2.stride(0), out.stride(0), LOG=log,
                                     CHUNKS=chunks, CP2=max(2, triton.next_power_of_2(chunks)),
                                     CHUNK_=CHUNK, BLOCK=LOOP_BLOCK, num_warps=8)
    return out.reshape(x.shape)


def softmax(x: torch.Tensor) -> torch.Tensor:
    return _launch(x, log=False)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    return _launch(x, log=True)
