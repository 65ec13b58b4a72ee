"""Triton kernels of the split attention (see attention.py for the contract and the host side).

Shared arithmetic, used verbatim by every kernel so decode and prefill produce the same bits:

- ``_block_update``: one key block of ``BLOCK_N`` keys (the blocks of a split start at the split's
  first key): scores by ``tl.dot`` from zero, invisible keys set to -inf, running max ``m``,
  ``p = exp2(fma(s, c, -m*c))`` cast to V's dtype, ``acc = dot(p, V, acc*alpha)`` and the row
  sum ``ls = dot(p, ones, ls*alpha)`` -- the sum goes through the tensor cores too, so it has no
  layout-dependent reduction tree. ``c = scale * log2(e)``.
- ``_split_partial`` (``_t``: transposed): the same when a split is one key block (the default,
  128 keys): the split's row max, ``p`` as above, ``l = dot(p, ones)`` and ``acc = dot(p, V)``,
  both products from zero. Decode computes it per (token, kv head, split) program, prefill per
  tile of queries, block after block.
- ``_merge``: folds a split partial (m_s, l_s, acc_s) into the running total, splits in ascending
  order, with explicit ``fma``s (no contraction left to the compiler).

A key block that is wholly invisible to a row leaves that row's state bit-for-bit unchanged
(alpha = 1, p = 0), and so does a split that is wholly invisible to it (a2 = 0); that is why a
kernel may walk more keys for a tile of rows than one row needs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from samebits.ops.triton.launcher import wait_for_inputs


@triton.jit
def _kv_block(k_cache, v_cache, bt_row, head_off, key_pos, k_hi, stride_slot,
              BS: tl.constexpr, D: tl.constexpr):
    """K, V [BLOCK_N, D] at positions ``key_pos`` (zeros from ``k_hi`` on), via the block table."""
    valid = key_pos < k_hi
    blk = tl.load(bt_row + key_pos // BS, mask=valid, other=0)
    slot = blk.to(tl.int64) * BS + key_pos % BS
    off = slot[:, None] * stride_slot + head_off + tl.arange(0, D)[None, :]
    k = tl.load(k_cache + off, mask=valid[:, None], other=0.0)
    v = tl.load(v_cache + off, mask=valid[:, None], other=0.0)
    return k, v


@triton.jit
def _block_update(m, ls, acc, q, k, v, visible, c, PRECISION: tl.constexpr):
    """Online-softmax step of one key block for rows of q; see the module docstring."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2((m - m_safe) * c)
    p = tl.exp2(tl.fma(s, c, -(m_safe * c)[:, None])).to(v.dtype)
    ones = tl.full([v.shape[0], 16], 1.0, v.dtype)
    acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
    ls = tl.dot(p, ones, ls * alpha[:, None], input_precision=PRECISION)
    return m_new, ls, acc


@triton.jit
def _block_update_t(m, lsT, accT, qT, k, v, visible, c, PRECISION: tl.constexpr):
    """``_block_update`` with every product transposed (keys and D on the MMA's M side, so one
    query's few rows need no padding to 64): the same products, the same K order, elementwise
    the same arithmetic. lsT is [16, R], accT [D, R]."""
    sT = tl.dot(k, qT, input_precision=PRECISION)
    sT = tl.where(visible, sT, float("-inf"))
    m_new = tl.maximum(m, tl.max(sT, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2((m - m_safe) * c)
    pT = tl.exp2(tl.fma(sT, c, -(m_safe * c)[None, :])).to(v.dtype)
    ones = tl.full([16, v.shape[0]], 1.0, v.dtype)
    accT = tl.dot(tl.trans(v), pT, accT * alpha[None, :], input_precision=PRECISION)
    lsT = tl.dot(ones, pT, lsT * alpha[None, :], input_precision=PRECISION)
    return m_new, lsT, accT


@triton.jit
def _split_partial(q, k, v, visible, c, PRECISION: tl.constexpr):
    """(m, l, acc) of a split that is one key block (``BLOCK_N == SPLIT``), from an empty state:
    ``m`` the row max, ``p = exp2(fma(s, c, -m*c))``, ``l = dot(p, ones)``, ``acc = dot(p, V)``
    -- both products start from zero, so nothing of a previous split enters them."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    s = tl.where(visible, s, float("-inf"))
    m = tl.max(s, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp2(tl.fma(s, c, -(m_safe * c)[:, None])).to(v.dtype)
    ones = tl.full([v.shape[0], 16], 1.0, v.dtype)
    acc = tl.dot(p, v, input_precision=PRECISION)
    ls = tl.dot(p, ones, input_precision=PRECISION)
    return m, tl.max(ls, 1), acc


@triton.jit
def _split_partial_t(qT, k, v, visible, c, PRECISION: tl.constexpr):
    """``_split_partial`` with every product transposed (same products, same K order); returns
    (m [R], l [R], accT [D, R])."""
    sT = tl.dot(k, qT, input_precision=PRECISION)
    sT = tl.where(visible, sT, float("-inf"))
    m = tl.max(sT, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    pT = tl.exp2(tl.fma(sT, c, -(m_safe * c)[None, :])).to(v.dtype)
    ones = tl.full([16, v.shape[0]], 1.0, v.dtype)
    accT = tl.dot(tl.trans(v), pT, input_precision=PRECISION)
    lsT = tl.dot(ones, pT, input_precision=PRECISION)
    return m, tl.max(lsT, 0), accT


@triton.jit
def _merge(M, L, ACC, m_s, l_s, acc_s, c):
    """Fold one split's partial into the running (max, sum, acc) of the splits before it."""
    m_new = tl.maximum(M, m_s)
    a1 = tl.exp2((M - m_new) * c)
    a2 = tl.exp2((m_s - m_new) * c)
    return m_new, tl.fma(L, a1, l_s * a2), tl.fma(ACC, a1[:, None], acc_s * a2[:, None])


@triton.jit
def _split_kernel(q_ptr, k_cache, v_cache, bt_ptr, seq_ptr, pos_ptr, row_ptr, part_acc, part_ml,
                  stride_qt, stride_qh, stride_bt, stride_slot, stride_pt, stride_ph, c,
                  G: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                  SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Partial (m, ls, acc) of split ``program_id(2)`` for the G query heads of one token and kv
    head ``program_id(1)`` (flash-decoding). Rows: the G heads, padded to ROWS with copies. The
    products are transposed (MMAs with 64-row tiles of keys or D instead of 16 padded query
    rows; the same products and K order as the prefill's, elementwise the same arithmetic).

    Invariance: a partial depends on q of that token/head, its position p and K/V of the split's
    keys <= p; not on the batch, the other tokens or the physical blocks.
    """
    wait_for_inputs(PDL)
    j = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    pos = tl.load(pos_ptr + j)
    k_lo = split * SPLIT
    if k_lo > pos:
        return
    b = tl.load(seq_ptr + j).to(tl.int64)
    t = tl.load(row_ptr + j).to(tl.int64)
    g = tl.minimum(tl.arange(0, ROWS), G - 1)
    hq = h * G + g
    d = tl.arange(0, D)
    q = tl.load(q_ptr + t * stride_qt + hq[:, None] * stride_qh + d[None, :])
    k_hi = tl.minimum(k_lo + SPLIT, pos + 1)
    rows = tl.arange(0, ROWS)
    base = j.to(tl.int64) * stride_pt + hq * stride_ph + split
    m, ls, accT = _split_t(tl.trans(q), k_cache, v_cache, bt_ptr + b * stride_bt, h * D, k_lo,
                           k_hi, pos, stride_slot, c, ROWS, D, BS, SPLIT, BLOCK_N, PRECISION)
    tl.store(part_acc + base[None, :] * D + d[:, None], accT, mask=(rows < G)[None, :])
    tl.store(part_ml + base * 2 + 1, ls, mask=rows < G)
    tl.store(part_ml + base * 2, m, mask=rows < G)


@triton.jit
def _split_t(qT, k_cache, v_cache, bt_row, head_off, k_lo, k_hi, pos, stride_slot, c,
             ROWS: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, SPLIT: tl.constexpr,
             BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """(m [R], l [R], accT [D, R]) of keys [k_lo, k_hi) for one query, transposed products."""
    if SPLIT == BLOCK_N:
        key_pos = k_lo + tl.arange(0, BLOCK_N)
        k, v = _kv_block(k_cache, v_cache, bt_row, head_off, key_pos, k_hi, stride_slot, BS, D)
        m, ls, accT = _split_partial_t(qT, k, v, key_pos[:, None] <= pos, c, PRECISION)
    else:
        m = tl.full([ROWS], float("-inf"), tl.float32)
        lsT = tl.zeros([16, ROWS], tl.float32)
        accT = tl.zeros([D, ROWS], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_N):
            key_pos = k0 + tl.arange(0, BLOCK_N)
            k, v = _kv_block(k_cache, v_cache, bt_row, head_off, key_pos, k_hi, stride_slot, BS,
                             D)
            m, lsT, accT = _block_update_t(m, lsT, accT, qT, k, v, key_pos[:, None] <= pos, c,
                                           PRECISION)
        ls = tl.max(lsT, 0)
    return m, ls, accT


@triton.jit
def _merge_splits(part_acc, part_ml, j, hs, hmask, n_splits, stride_pt, stride_ph, c,
                  D: tl.constexpr, STAGES: tl.constexpr):
    """ACC / L after folding splits 0..n_splits-1 of token j, heads hs, in ascending order (the
    loads bypass L1: other programs wrote them)."""
    d = tl.arange(0, D)
    M = tl.full(hs.shape, float("-inf"), tl.float32)
    L = tl.zeros(hs.shape, tl.float32)
    ACC = tl.zeros([hs.shape[0], D], tl.float32)
    for split in tl.range(0, n_splits, num_stages=STAGES):
        base = j.to(tl.int64) * stride_pt + hs * stride_ph + split
        m_s = tl.load(part_ml + base * 2, mask=hmask, other=0.0, cache_modifier=".cg")
        l_s = tl.load(part_ml + base * 2 + 1, mask=hmask, other=1.0, cache_modifier=".cg")
        acc_s = tl.load(part_acc + base[:, None] * D + d[None, :], mask=hmask[:, None], other=0.0,
                        cache_modifier=".cg")
        M, L, ACC = _merge(M, L, ACC, m_s, l_s, acc_s, c)
    return ACC / L[:, None]


@triton.jit
def _merge_kernel(part_acc, part_ml, pos_ptr, row_ptr, out_ptr, stride_pt, stride_ph, stride_ot,
                  stride_oh, c, HQ, HB: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
                  STAGES: tl.constexpr, PDL: tl.constexpr):
    """out = merge of splits 0..p//SPLIT, ascending, for HB heads of one token (program_id 0, 1).

    The loop's loads are software-pipelined STAGES deep (they do not depend on the fold).
    """
    wait_for_inputs(PDL)
    j = tl.program_id(0)
    hs = tl.program_id(1) * HB + tl.arange(0, HB)
    hmask = hs < HQ
    pos = tl.load(pos_ptr + j)
    t = tl.load(row_ptr + j).to(tl.int64)
    out = _merge_splits(part_acc, part_ml, j, hs, hmask, pos // SPLIT + 1, stride_pt, stride_ph, c,
                        D, STAGES)
    d = tl.arange(0, D)
    tl.store(out_ptr + t * stride_ot + hs[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _prefill_kernel(q_ptr, k_cache, v_cache, bt_ptr, tiles_ptr, out_ptr, stride_qt, stride_qh,
                    stride_bt, stride_slot, stride_ot, stride_oh, c, G: tl.constexpr,
                    D: tl.constexpr, BS: tl.constexpr, SPLIT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Causal attention of up to BLOCK_M consecutive queries of one sequence for query head
    ``program_id(0)``; tile ``program_id(1)`` = (seq, first row, count, first position).

    Splits are reduced one after the other and merged in registers with ``_merge`` -- the same
    partials and the same merge as ``_split_kernel`` + ``_merge_kernel``, hence the same bits.
    Invariance: a query's output depends on q, its position p and K/V of positions [0, p] only.
    """
    hq = tl.program_id(0)
    tile = tl.program_id(1)
    b = tl.load(tiles_ptr + tile * 4).to(tl.int64)
    t0 = tl.load(tiles_ptr + tile * 4 + 1).to(tl.int64)
    n = tl.load(tiles_ptr + tile * 4 + 2)
    p0 = tl.load(tiles_ptr + tile * 4 + 3)
    h = hq // G
    r = tl.minimum(tl.arange(0, BLOCK_M), n - 1)  # pad rows copy the last query
    row_pos = p0 + r
    max_p = p0 + n - 1
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (t0 + r)[:, None] * stride_qt + hq * stride_qh + d[None, :])
    bt_row = bt_ptr + b * stride_bt
    M = tl.full([BLOCK_M], float("-inf"), tl.float32)
    L = tl.zeros([BLOCK_M], tl.float32)
    ACC = tl.zeros([BLOCK_M, D], tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    ls = tl.zeros([BLOCK_M, 16], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if SPLIT == BLOCK_N:  # one block per split: each block's partial is merged at once
        k_mid = (p0 + 1) // BLOCK_N * BLOCK_N  # blocks wholly at or below p0 need no mask
        for k0 in range(0, k_mid, BLOCK_N):
            key_pos = k0 + tl.arange(0, BLOCK_N)
            k, v = _kv_block(k_cache, v_cache, bt_row, h * D, key_pos, max_p + 1, stride_slot,
                             BS, D)
            m, l_s, acc = _split_partial(q, k, v, True, c, PRECISION)
            M, L, ACC = _merge(M, L, ACC, m, l_s, acc, c)
        for k0 in range(k_mid, max_p + 1, BLOCK_N):
            key_pos = k0 + tl.arange(0, BLOCK_N)
            k, v = _kv_block(k_cache, v_cache, bt_row, h * D, key_pos, max_p + 1, stride_slot,
                             BS, D)
            m, l_s, acc = _split_partial(q, k, v, key_pos[None, :] <= row_pos[:, None], c,
                                         PRECISION)
            M, L, ACC = _merge(M, L, ACC, m, l_s, acc, c)
    else:
        for k_lo in range(0, max_p + 1, SPLIT):
            k_hi = tl.minimum(k_lo + SPLIT, max_p + 1)
            # blocks wholly at or below the tile's first position need no mask (same bits)
            k_mid = tl.maximum(k_lo, tl.minimum(k_hi, k_lo + (p0 + 1 - k_lo) // BLOCK_N * BLOCK_N))
            for k0 in range(k_lo, k_mid, BLOCK_N):
                key_pos = k0 + tl.arange(0, BLOCK_N)
                k, v = _kv_block(k_cache, v_cache, bt_row, h * D, key_pos, k_hi, stride_slot,
                                 BS, D)
                m, ls, acc = _block_update(m, ls, acc, q, k, v, True, c, PRECISION)
            for k0 in range(k_mid, k_hi, BLOCK_N):
                key_pos = k0 + tl.arange(0, BLOCK_N)
                k, v = _kv_block(k_cache, v_cache, bt_row, h * D, key_pos, k_hi, stride_slot,
                                 BS, D)
                m, ls, acc = _block_update(m, ls, acc, q, k, v,
                                          key_pos[None, :] <= row_pos[:, None], c, PRECISION)
            M, L, ACC = _merge(M, L, ACC, m, tl.max(ls, 1), acc, c)
            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            ls = tl.zeros([BLOCK_M, 16], tl.float32)
            acc = tl.zeros([BLOCK_M, D], tl.float32)
    out = ACC / L[:, None]
    rows = tl.arange(0, BLOCK_M)
    tl.store(out_ptr + (t0 + rows)[:, None] * stride_ot + hq * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(rows < n)[:, None])



@triton.jit
def _max_fn(a, b):
    return tl.maximum(a, b)


@triton.jit
def _merge_scan_kernel(part_acc, part_ml, part_a, pos_ptr, row_ptr, out_ptr, stride_pt,
                       stride_ph, stride_ot, stride_oh, c, D: tl.constexpr, SPLIT: tl.constexpr,
                       NS: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """``_merge_kernel``'s bits for one (token ``program_id(0)``, head ``program_id(1)``), faster
    when there are many splits: the running max after split k is a prefix max, which is exact, so
    a scan gives the sequential fold's M_k bit for bit, and with it a1_k = exp2((M_{k-1} - M_k) c)
    and a2_k = exp2((m_k - M_k) c) for every split at once (staged in ``part_a``). The loop is
    then only ``_merge``'s two fma chains, in ascending split order, its loads pipelined."""
    wait_for_inputs(PDL)
    j = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + j)
    t = tl.load(row_ptr + j).to(tl.int64)
    n_splits = pos // SPLIT + 1
    base = j.to(tl.int64) * stride_pt + h * stride_ph
    k = tl.arange(0, NS)
    live = k < n_splits
    m_s = tl.load(part_ml + (base + k) * 2, mask=live, other=float("-inf"), cache_modifier=".cg")
    m_before = tl.load(part_ml + (base + k - 1) * 2, mask=live & (k > 0), other=float("-inf"),
                       cache_modifier=".cg")
    m_run = tl.associative_scan(m_s, 0, _max_fn)  # M_k
    m_prev = tl.associative_scan(m_before, 0, _max_fn)  # M_{k-1}, -inf before split 0
    tl.store(part_a + (base + k) * 2, tl.exp2((m_prev - m_run) * c), mask=live)
    tl.store(part_a + (base + k) * 2 + 1, tl.exp2((m_s - m_run) * c), mask=live)
    tl.debug_barrier()  # every thread's a1/a2 stored before any thread reads them
    d = tl.arange(0, D)
    L = tl.zeros([1], tl.float32)
    ACC = tl.zeros([D], tl.float32)
    for s in tl.range(0, n_splits, num_stages=STAGES):
        a1 = tl.load(part_a + (base + s) * 2)
        a2 = tl.load(part_a + (base + s) * 2 + 1)
        l_s = tl.load(part_ml + (base + s) * 2 + 1, cache_modifier=".cg")
        acc_s = tl.load(part_acc + (base + s) * D + d, cache_modifier=".cg")
        L = tl.fma(L, a1, l_s * a2)
        ACC = tl.fma(ACC, a1, acc_s * a2)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, (ACC / L).to(out_ptr.dtype.element_ty))
