"""Triton kernels of the batch-invariant linear (host side, contract and tile policy: linear.py).

Every kernel here accumulates each output element from zero in fp32 with ``tl.dot`` over ascending
K, in steps the tensor cores take 16 K-elements at a time; the tile shape and the load path
(pointers + cp.async, or TMA descriptors) do not change that order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from samebits.ops.triton.launcher import wait_for_inputs
from samebits.ops.triton.tree import tree_push, tree_step


@triton.jit
def _segment_range(seg, SEG_BASE, SEG_EXTRA, K, EVEN_K: tl.constexpr):
    """[k_lo, k_hi) of K segment ``seg``: ``SEG_BASE`` columns, one more for the first
    ``SEG_EXTRA`` segments, clipped to K (linear.py's ``SegmentLayout``). EVEN_K implies
    SEG_EXTRA == 0: then k_lo is a plain multiple of SEG_BASE, which keeps the compiler's proof
    that the loads are aligned (16-byte vector loads; a ``minimum`` term would lose it)."""
    if EVEN_K:
        k_lo = seg * SEG_BASE
        k_hi = tl.minimum(k_lo + SEG_BASE, K)
    else:
        k_lo = seg * SEG_BASE + tl.minimum(seg, SEG_EXTRA)
        k_hi = tl.minimum(k_lo + SEG_BASE + tl.where(seg < SEG_EXTRA, 1, 0), K)
    return k_lo, k_hi


@triton.jit
def _segment_dot(x_ptr, w_ptr, offs_m, offs_n, k_lo, k_hi, stride_xm, stride_wn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 sum over k in [k_lo, k_hi) of x[m, k] * w[n, k], from zero, ascending K, in steps of
    BLOCK_K from k_lo (columns at or past k_hi load as zeros; EVEN_K: none are)."""
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + (k_lo + offs_k)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            a = tl.load(x_ptrs, mask=(k + offs_k)[None, :] < k_hi, other=0.0)
            b = tl.load(w_ptrs, mask=(k + offs_k)[:, None] < k_hi, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _segment_tree(x_ptr, w_ptr, offs_m, offs_n, SEG_BASE, K, stride_xm, stride_wn,
                  NUM_SEGS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """``tree_sum`` of the fp32 partials of NUM_SEGS even segments of SEG_BASE columns, added
    in registers as each is computed (``tree.tree_push``): the split schedule's adds."""
    s0 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    s1 = s0
    s2 = s0
    s3 = s0
    for s in tl.static_range(NUM_SEGS):
        k_lo, k_hi = _segment_range(s, SEG_BASE, 0, K, True)
        v = _segment_dot(x_ptr, w_ptr, offs_m, offs_n, k_lo, k_hi, stride_xm, stride_wn,
                         BLOCK_M, BLOCK_N, BLOCK_K, True, PRECISION)
        s0, s1, s2, s3 = tree_push(v, s0, s1, s2, s3, NUM_SEGS, s)
    return s0


@triton.jit
def _prefetch_rows(w_ptr, first, N, K, stride_wn, BLOCK_N: tl.constexpr, BYTES: tl.constexpr,
                   THREADS: tl.constexpr):
    """Ask L2 for the first ``BYTES`` of weight rows [first, first + BLOCK_N) (rows past N
    clamped, at most each row's K elements), split over THREADS threads, one bulk prefetch each.
    A hint: it reads nothing into registers and changes no result."""
    CHUNK: tl.constexpr = BYTES // THREADS // 16 * 16
    e = tl.arange(0, THREADS)
    row = (first + e % BLOCK_N) % N
    lo = (e // BLOCK_N) * CHUNK
    row_bytes = K * w_ptr.dtype.element_ty.primitive_bitwidth // 8
    size = tl.minimum(tl.maximum(row_bytes - lo, 0), CHUNK) // 16 * 16
    addr = (w_ptr + row.to(tl.int64) * stride_wn).to(tl.int64, bitcast=True) + lo
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
        "mov.u32 $0, 0; }", "=r,l,r", [addr, size.to(tl.uint32)], dtype=tl.int32,
        is_pure=False, pack=1)


@triton.jit(do_not_specialize=["M", "stride_ps"])  # one compile serves every row count
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, peer_ptr, M, N, K, stride_xm, stride_wn,
                   stride_om, stride_ps, SEG_BASE, SEG_EXTRA, SPLIT: tl.constexpr,
                   NUM_SEGS: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                   PDL: tl.constexpr, PREFETCH: tl.constexpr, THREADS: tl.constexpr,
                   HAS_PEER: tl.constexpr):
    """out = x @ w.T (+ b) over all of K (one segment); with SPLIT=True the fp32 partial of K
    segment ``program_id(1)`` (SEG_BASE, SEG_EXTRA: linear.py's ``SegmentLayout``) written to
    ``out_ptr + seg * stride_ps``, left for ``_sum_partials_kernel`` (no bias then); with
    NUM_SEGS > 1 and not SPLIT, every one of NUM_SEGS even segments, tree-summed in registers
    (``_segment_tree``: the split schedule's bits without its partials buffer or second launch),
    then the bias in fp32 and one cast. HAS_PEER: the very values stored into ``out`` are
    stored again at the same offsets from ``peer_ptr`` (a second output of out's shape and
    strides: a tensor-parallel peer's slot); without it ``peer_ptr`` is None and unused.

    Invariance: ``out[i, j]`` depends only on x[i, :], w[j, :], b[j] and the segment -- not on M,
    the row's position, the tile shape or the program count. A segment's partial is the
    one-segment product of its columns alone. PREFETCH > 0 (bytes, with PDL): before waiting for
    x, the program asks L2 for the start of its weight rows -- weights are no kernel's output, so
    this overlaps the previous kernel's tail.
    """
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size
    if PREFETCH > 0:
        _prefetch_rows(w_ptr, pid_n * BLOCK_N, N, K, stride_wn, BLOCK_N, PREFETCH, THREADS)
    wait_for_inputs(PDL)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = (rows % M).to(tl.int64)  # clamped rows/cols: loads need no masks, the store is masked
    offs_n = (cols % N).to(tl.int64)
    if SPLIT:  # this program's segment only
        seg = tl.program_id(1)
        k_lo, k_hi = _segment_range(seg, SEG_BASE, SEG_EXTRA, K, EVEN_K)
        total = _segment_dot(x_ptr, w_ptr, offs_m, offs_n, k_lo, k_hi, stride_xm, stride_wn,
                             BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
        out_ptr += seg * stride_ps
        if HAS_PEER:
            peer_ptr += seg * stride_ps
    else:
        if NUM_SEGS > 1:  # every segment of this tile
            total = _segment_tree(x_ptr, w_ptr, offs_m, offs_n, SEG_BASE, K, stride_xm,
                                  stride_wn, NUM_SEGS, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        else:  # the one segment, from a compile-time 0: the loads start aligned
            total = _segment_dot(x_ptr, w_ptr, offs_m, offs_n, 0, K, stride_xm, stride_wn,
                                 BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
        if HAS_BIAS:
            total += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    value = total.to(out_ptr.dtype.element_ty)
    tl.store(out_ptrs, value, mask=mask)
    if HAS_PEER:  # the same registers, the same offsets
        tl.store(peer_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], value,
                 mask=mask)


@triton.constexpr_function
def _tree_levels(n):
    """log2(n): the levels of pairwise adds that reduce n (a power of two) rows to one."""
    assert n > 0 and n & (n - 1) == 0, f"{n} partials: not a power of two"
    return n.bit_length() - 1


@triton.jit
def _pair_level(x, PAIRS: tl.constexpr, BLOCK: tl.constexpr):
    """[2 PAIRS, BLOCK] -> [PAIRS, BLOCK]: row i is x[2i] + x[2i + 1] (one add of two values,
    whose result does not depend on which operand comes first)."""
    return tl.sum(tl.reshape(x, [PAIRS, 2, BLOCK]), axis=1)


@triton.jit(do_not_specialize=["MN"])
def _sum_partials_kernel(part_ptr, b_ptr, out_ptr, peer_ptr, MN, N, NUM_SEGS: tl.constexpr,
                         HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                         HAS_PEER: tl.constexpr):
    """out = tree_sum(p[0 .. NUM_SEGS)) (+ b), element by element (``samebits.ops.backend``'s
    tree; NUM_SEGS a power of two up to 64): level by level, pairs (0, 1), (2, 3) ..., then pairs
    of pairs; the bias added in fp32, then one cast. HAS_PEER: the same values also stored at
    ``peer_ptr`` (a second contiguous [MN] output; None and unused without it)."""
    wait_for_inputs(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    segs = tl.arange(0, NUM_SEGS)
    x = tl.load(part_ptr + segs.to(tl.int64)[:, None] * MN + offs[None, :], mask=mask[None, :],
                other=0.0)
    # level l adds pairs of level l - 1's rows: NUM_SEGS >> l rows remain
    LEVELS: tl.constexpr = _tree_levels(NUM_SEGS)
    for level in tl.static_range(1, LEVELS + 1):
        x = _pair_level(x, NUM_SEGS >> level, BLOCK)
    total = tl.reshape(x, [BLOCK])
    if HAS_BIAS:
        total += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + offs
    value = total.to(out_ptr.dtype.element_ty)
    tl.store(out_ptrs, value, mask=mask)
    if HAS_PEER:
        tl.store(peer_ptr + offs, value, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _linear_tma_kernel(x_desc, w_desc, out_desc, b_ptr, M, N, K, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, PDL: tl.constexpr):
    """Persistent TMA GEMM, one segment: out = x @ w.T (+ b); programs stride over output tiles.

    Invariance: as ``_linear_kernel`` with one segment -- ``out[i, j]`` depends on x[i, :], w[j, :]
    and b[j] only (K tails are zero-filled by the TMA unit, like the masked loads there).
    """
    wait_for_inputs(PDL)
    start = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    width = GROUP_M * grid_n
    for tile in tl.range(start, grid_m * grid_n, NUM_PROGRAMS, flatten=True):
        first_m = (tile // width) * GROUP_M
        group_size = tl.minimum(grid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % width) % group_size
        pid_n = (tile % width) // group_size
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kk in range(k_tiles):
            a = x_desc.load([pid_m * BLOCK_M, kk * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, kk * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        if HAS_BIAS:
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(out_desc.dtype))


@triton.jit(do_not_specialize=["M"])
def _segmented_tma_kernel(x_desc, w_desc, out_desc, peer_ptr, M, N, K, SEG_TILES,
                          NUM_SEGS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                          NUM_PROGRAMS: tl.constexpr, PDL: tl.constexpr, HAS_PEER: tl.constexpr,
                          SUBTILE: tl.constexpr):
    """Persistent TMA GEMM over NUM_SEGS (1 .. 16) K segments of SEG_TILES whole BLOCK_K steps
    each: every segment's partial accumulated from zero in fp32 over ascending K, the partials
    added in ``tree_sum``'s order in registers, the sum cast to out's dtype and stored (SUBTILE:
    as two [BLOCK_M, BLOCK_N / 2] halves, ``out_desc``'s block, halving the output staging).
    HAS_PEER: the same tile values also stored, by plain masked stores, into a contiguous [M, N]
    tensor at ``peer_ptr`` (a tensor-parallel peer's slot; None and unused without it).

    Invariance: ``out[i, j]`` is ``_linear_kernel``'s split schedule summed by
    ``_sum_partials_kernel`` (or ``tree_sum``), bit for bit: each partial is the one-segment
    product of its columns (one K loop; the accumulator restarts at a segment's first step), and
    the adds are the tree's, whatever the tile, M or the row's position.
    """
    wait_for_inputs(PDL)
    start = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    # the accumulator (zero again after each segment's last step) and the stack (a tile writes
    # an entry before it reads it): zeroing before a step would stall the MMA pipeline
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    s0 = acc
    s1 = acc
    s2 = acc
    s3 = acc
    for tile in tl.range(start, grid_m * grid_n, NUM_PROGRAMS, flatten=True):
        first_m = (tile // width) * GROUP_M
        group_size = tl.minimum(grid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % width) % group_size
        pid_n = (tile % width) // group_size
        if NUM_SEGS == 1:  # one chain: no stack beside the accumulator (a 128x256 tile fits)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for kk in range(SEG_TILES):
                a = x_desc.load([pid_m * BLOCK_M, kk * BLOCK_K])
                b = w_desc.load([pid_n * BLOCK_N, kk * BLOCK_K])
                acc = tl.dot(a, b.T, acc)
            value = acc.to(out_desc.dtype)
        else:
            for kk in range(NUM_SEGS * SEG_TILES):
                a = x_desc.load([pid_m * BLOCK_M, kk * BLOCK_K])
                b = w_desc.load([pid_n * BLOCK_N, kk * BLOCK_K])
                acc = tl.dot(a, b.T, acc)
                if kk % SEG_TILES == SEG_TILES - 1:  # a segment's last step: its partial joins
                    seg = kk // SEG_TILES  # the tree and the accumulator restarts from zero
                    for s in tl.static_range(NUM_SEGS):
                        s0, s1, s2, s3 = tree_step(acc, s0, s1, s2, s3, seg == s, NUM_SEGS, s)
                    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            value = s0.to(out_desc.dtype)
        _store_tile(out_desc, peer_ptr, value, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, BLOCK_M,
                    BLOCK_N, HAS_PEER, SUBTILE)


@triton.jit
def _store_tile(out_desc, peer_ptr, value, row0, col0, M, N, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, HAS_PEER: tl.constexpr, SUBTILE: tl.constexpr):
    """``value`` [BLOCK_M, BLOCK_N] at (row0, col0) of out (by TMA; SUBTILE: two halves) and,
    HAS_PEER, of the contiguous [M, N] peer output (masked stores)."""
    if SUBTILE:
        halves = tl.permute(tl.reshape(value, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        lo, hi = tl.split(halves)
        out_desc.store([row0, col0], lo)
        out_desc.store([row0, col0 + BLOCK_N // 2], hi)
        if HAS_PEER:
            _store_masked(peer_ptr, lo, row0, col0, M, N, BLOCK_M, BLOCK_N // 2)
            _store_masked(peer_ptr, hi, row0, col0 + BLOCK_N // 2, M, N, BLOCK_M, BLOCK_N // 2)
    else:
        out_desc.store([row0, col0], value)
        if HAS_PEER:
            _store_masked(peer_ptr, value, row0, col0, M, N, BLOCK_M, BLOCK_N)


@triton.jit
def _store_masked(ptr, value, row0, col0, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], value, mask=mask)
