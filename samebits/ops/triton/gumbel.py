"""The Gumbel-max draw on CUDA in two launches instead of ~50 elementwise ones.

``gumbel_argmax(x, keep, keys)`` returns, per row, the lowest token id among the maxima of
``x + noise`` over the kept tokens, where ``noise`` is ``samebits.engine.sampler.gumbel_noise``'s
function of (key, token id): the same hash in uint32 arithmetic (equal to the int64-and-mask
arithmetic there), the same fp64 ``-log(-log(u))``, rounded once to fp32. Each program reduces one
fixed chunk of one row; chunk partials are combined in a fixed order, ties to the lower id. Nothing
depends on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 8192  # tokens per program


@triton.jit
def _mix32(x):
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def stream_key(lo, hi, idx):
    """The sampler's ``stream_key`` in uint32 arithmetic: the seed's low and high words and the
    draw index's low word -> the key words (k1, k2)."""
    k1 = _mix32(_mix32(_mix32(lo ^ 0x9E3779B9) ^ hi) ^ idx)
    k2 = _mix32(_mix32(_mix32(hi ^ 0x7F4A7C15) ^ lo) ^ _mix32(idx ^ 0x94D049BB))
    return k1, k2


@triton.jit
def noise(k1, k2, cols):
    """Gumbel noise fp32 of token ids ``cols`` under key words k1, k2 (uint32): the sampler's
    ``gumbel_noise`` element for element."""
    h = _mix32(_mix32(k1 ^ cols.to(tl.uint32)) ^ k2)
    h = _mix32(h ^ 0x85EBCA6B)
    u = ((h >> 8).to(tl.float64) + 0.5) / 16777216.0
    return (-tl.log(-tl.log(u))).to(tl.float32)


@triton.jit
def _chunk_argmax_kernel(x_ptr, keep_ptr, keys_ptr, best_ptr, idx_ptr, V, stride_x, stride_k,
                         num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    k1 = tl.load(keys_ptr + 2 * row).to(tl.uint32)
    k2 = tl.load(keys_ptr + 2 * row + 1).to(tl.uint32)
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.full([], 0, tl.int32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < V
        x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=float("-inf"))
        keep = tl.load(keep_ptr + row * stride_k + cols, mask=inside, other=0)
        s = tl.where((keep != 0) & inside, x + noise(k1, k2, cols), float("-inf"))
        block_best = tl.max(s, 0)
        block_id = start + tl.argmax(s, 0, tie_break_left=True)
        take = block_best > best  # strict: an earlier block (lower ids) keeps a tie
        best_id = tl.where(take, block_id, best_id)
        best = tl.where(take, block_best, best)
    tl.store(best_ptr + row * num_chunks + chunk, best)
    tl.store(idx_ptr + row * num_chunks + chunk, best_id)


def gumbel_argmax(x: torch.Tensor, keep: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """x [B, V] fp32, keep [B, V] bool, keys [B, 2] int64 -> token ids [B] int64."""
    b, v = x.shape
    chunks = triton.cdiv(v, CHUNK)
    best = torch.empty(b, chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(b, chunks, dtype=torch.int32, device=x.device)
    x, keep, keys = x.contiguous(), keep.contiguous().view(torch.uint8), keys.contiguous()
    _chunk_argmax_kernel[(b, chunks)](x, keep, keys, best, idx, v, x.stride(0), keep.stride(0),
                                      chunks, CHUNK=CHUNK, BLOCK=1024, num_warps=4)
    top = best.amax(-1, keepdim=True)
    return torch.where(best == top, idx, v).amin(-1).long()  # chunks hold ascending ids
