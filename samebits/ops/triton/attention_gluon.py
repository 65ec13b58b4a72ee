"""Hopper attention in Gluon: ``_prefill_kernel``'s and ``_split_kernel``'s bits with explicit
asynchrony (prefill: ``_prefill_gluon_kernel``; decode's split partials: ``_split_gluon_kernel``).

The arithmetic is attention_kernels.py's, step for step, for the default case of a split that
is one 128-key block (``SPLIT == BLOCK_N``): per block the split partial (row max m,
``p = exp2(fma(s, c, -m*c))``, ``l = dot(p, ones)``, ``acc = dot(p, V)``, both products from
zero) and ``_merge`` into the running (M, L, ACC), blocks in ascending order. What differs is
only the schedule, which never changes the bits:

- K and V arrive by TMA, one 16-key page at a time through the block table, into a two-deep
  ring of shared-memory buffers (K of block j+3 and V of block j+2 are in flight while block j
  is reduced); pages past the sequence are read out of bounds, i.e. as zeros.
- the MMAs are asynchronous: ``S_{j+1} = Q K_{j+1}^T`` runs on the tensor cores while block
  j's partial is merged in registers.

Invariance is the Triton kernel's: a query's output depends on q, its position p and K/V of
positions [0, p] only (each MMA row is its own query; rows past the tile's count are never
stored). tests/gpu/test_attention_bits.py checks it bit for bit against the decode kernel.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from samebits.ops.triton.launcher import gdc_launch_dependents, gdc_wait


def tma_descriptor(x: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """TMA descriptor over a 16-bit 2-D view x (rows of stride x.stride(0)), boxes ``block`` in
    the shared layout the Gluon kernels' MMAs read."""
    dt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    return TensorDescriptor(x, list(x.shape), [x.stride(0), 1], block,
                            gl.NVMMASharedLayout.get_default_for(block, dt))


@gluon.jit
def _load_block(desc, smem, bar, bt_row, jb, max_p, num_slots, col):
    """TMA of keys [jb*BLOCK_N, +BLOCK_N) of one head into ``smem`` ([BLOCK_N, D]), one page (the
    descriptor's box, BS keys) a copy; keys past ``max_p`` come from row ``num_slots`` (out of
    bounds: zeros). Completes on ``bar``."""
    BLOCK_N: gl.constexpr = smem.shape[0]
    BS: gl.constexpr = desc.block_type.shape[0]
    mbarrier.expect(bar, BLOCK_N // BS * desc.block_type.nbytes)
    for i in gl.static_range(BLOCK_N // BS):
        key0 = jb * BLOCK_N + i * BS
        valid = key0 <= max_p
        page = gl.load(bt_row + key0 // BS, mask=valid, other=0)
        slot = gl.where(valid, page * BS, num_slots)
        tma.async_copy_global_to_shared(desc, [slot, col], bar, smem.slice(i * BS, BS))


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full,
              v_empty, bt_row, t0, q_col, col, max_p, n_blocks, num_slots):
    """The load warp: Q once, then K and V of every block into the two-deep rings, each buffer
    refilled once both consumers have released it."""
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [t0, q_col], q_bar, q_smem)
    for jb in range(0, n_blocks):
        buf = jb % 2
        phase = (jb // 2 - 1) & 1
        mbarrier.wait(k_empty.index(buf), phase, pred=jb >= 2)
        _load_block(k_desc, k_smem.index(buf), k_full.index(buf), bt_row, jb, max_p, num_slots,
                    col)
        mbarrier.wait(v_empty.index(buf), phase, pred=jb >= 2)
        _load_block(v_desc, v_smem.index(buf), v_full.index(buf), bt_row, jb, max_p, num_slots,
                    col)


@gluon.jit
def _step(s, M, L, ACC, j, q, k_smem, v_smem, ones_smem, k_full, k_empty, v_full, v_empty,
          n_blocks, row_pos, c, MASKED: gl.constexpr, BLOCK_N: gl.constexpr,
          S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, L_LAYOUT: gl.constexpr):
    """Block j: its split partial from the scores s (ready), merged into (M, L, ACC), while the
    scores of block j+1 are computed (garbage past the last block, never used)."""
    buf = j % 2
    if MASKED:
        key_pos = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        s = gl.where(key_pos[None, :] <= row_pos[:, None], s, float("-inf"))
    m = gl.max(s, 1)
    m_safe = gl.where(m == float("-inf"), 0.0, m)
    p = gl.exp2(gl.fma(s, c, -(m_safe * c)[:, None])).to(v_smem.dtype)
    p_o = gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2))
    p_l = gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=L_LAYOUT, k_width=2))
    mbarrier.wait(v_full.index(buf), (j // 2) & 1)
    pv = warpgroup_mma(p_o, v_smem.index(buf), gl.zeros(ACC.shape, gl.float32, O_LAYOUT),
                       use_acc=False, is_async=True)
    l16 = warpgroup_mma(p_l, ones_smem, gl.zeros([ACC.shape[0], 16], gl.float32, L_LAYOUT),
                        use_acc=False, is_async=True)
    pv, l16, p_o, p_l = warpgroup_mma_wait(0, deps=(pv, l16, p_o, p_l))
    mbarrier.arrive(v_empty.index(buf))
    more = j + 1 < n_blocks
    mbarrier.wait(k_full.index(1 - buf), ((j + 1) // 2) & 1, pred=more)
    s_next = warpgroup_mma(q, k_smem.index(1 - buf).permute((1, 0)),
                           gl.zeros(s.shape, gl.float32, S_LAYOUT), use_acc=False, is_async=True)
    m_o = gl.convert_layout(m, gl.SliceLayout(1, O_LAYOUT))
    l_s = gl.convert_layout(gl.max(l16, 1), gl.SliceLayout(1, O_LAYOUT))
    m_new = gl.maximum(M, m_o)
    a1 = gl.exp2((M - m_new) * c)
    a2 = gl.exp2((m_o - m_new) * c)
    L = gl.fma(L, a1, l_s * a2)
    ACC = gl.fma(ACC, a1[:, None], pv * a2[:, None])
    s_next = warpgroup_mma_wait(0, deps=(s_next, ))
    mbarrier.arrive(k_empty.index(1 - buf), pred=more)
    return s_next, m_new, L, ACC


@gluon.jit
def _consumer(ROW0: gl.constexpr, q_smem, k_smem, v_smem, ones_smem, q_bar, k_full, k_empty,
              v_full, v_empty, out_ptr, stride_ot, stride_oh, t0, hq, n, p0, n_blocks, k_mid, c):
    """One warpgroup: queries ROW0..ROW0+HALF of the tile, every block in order."""
    HALF: gl.constexpr = q_smem.shape[0] // 2
    D: gl.constexpr = q_smem.shape[1]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, D, 16])
    L_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, 16, 16])
    q = q_smem.slice(ROW0, HALF)
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_full.index(0), 0)
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)),
                      gl.zeros([HALF, BLOCK_N], gl.float32, S_LAYOUT), use_acc=False,
                      is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0))
    r = gl.minimum(ROW0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, S_LAYOUT)), n - 1)
    row_pos = p0 + r  # pad rows repeat the last query's position
    M = gl.full([HALF], float("-inf"), gl.float32, gl.SliceLayout(1, O_LAYOUT))
    L = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, O_LAYOUT))
    ACC = gl.zeros([HALF, D], gl.float32, O_LAYOUT)
    for j in range(0, k_mid):
        s, M, L, ACC = _step(s, M, L, ACC, j, q, k_smem, v_smem, ones_smem, k_full, k_empty,
                             v_full, v_empty, n_blocks, row_pos, c, False, BLOCK_N, S_LAYOUT,
                             O_LAYOUT, L_LAYOUT)
    for j in range(k_mid, n_blocks):
        s, M, L, ACC = _step(s, M, L, ACC, j, q, k_smem, v_smem, ones_smem, k_full, k_empty,
                             v_full, v_empty, n_blocks, row_pos, c, True, BLOCK_N, S_LAYOUT,
                             O_LAYOUT, L_LAYOUT)
    out = ACC / L[:, None]
    rows = ROW0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, O_LAYOUT))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, O_LAYOUT))
    ptrs = out_ptr + (t0 + rows).to(gl.int64)[:, None] * stride_ot + hq * stride_oh + d[None, :]
    gl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=(rows < n)[:, None])


# warp_specialize passes its partitions' arguments as values, never as constexprs: the row
# offset of each consumer is fixed by a wrapper of its own
@gluon.jit
def _consumer_lo(q_smem, k_smem, v_smem, ones_smem, q_bar, k_full, k_empty, v_full, v_empty,
                 out_ptr, stride_ot, stride_oh, t0, hq, n, p0, n_blocks, k_mid, c):
    _consumer(0, q_smem, k_smem, v_smem, ones_smem, q_bar, k_full, k_empty, v_full, v_empty,
              out_ptr, stride_ot, stride_oh, t0, hq, n, p0, n_blocks, k_mid, c)


@gluon.jit
def _consumer_hi(q_smem, k_smem, v_smem, ones_smem, q_bar, k_full, k_empty, v_full, v_empty,
                 out_ptr, stride_ot, stride_oh, t0, hq, n, p0, n_blocks, k_mid, c):
    _consumer(q_smem.shape[0] // 2, q_smem, k_smem, v_smem, ones_smem, q_bar, k_full, k_empty,
              v_full, v_empty, out_ptr, stride_ot, stride_oh, t0, hq, n, p0, n_blocks, k_mid, c)


@gluon.jit
def _prefill_gluon_kernel(q_desc, k_desc, v_desc, bt_ptr, tiles_ptr, out_ptr, stride_bt,
                          stride_ot, stride_oh, num_slots, c, G: gl.constexpr, D: gl.constexpr,
                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Causal attention of up to BLOCK_M consecutive queries of one sequence for query head
    ``program_id(0)``; tile ``program_id(1)`` = (seq, first row, count, first position).
    Two consumer warpgroups (BLOCK_M/2 rows each) and one load warp."""
    dtype: gl.constexpr = q_desc.dtype
    hq = gl.program_id(0)
    tile = gl.program_id(1)
    b = gl.load(tiles_ptr + tile * 4).to(gl.int64)
    t0 = gl.load(tiles_ptr + tile * 4 + 1)
    n = gl.load(tiles_ptr + tile * 4 + 2)
    p0 = gl.load(tiles_ptr + tile * 4 + 3)
    max_p = p0 + n - 1
    n_blocks = max_p // BLOCK_N + 1
    k_mid = (p0 + 1) // BLOCK_N  # blocks before this one are wholly visible to every row

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D], v_desc.layout)
    ones_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 16], dtype)
    fill: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [gl.num_warps(), 1], [1, 0])
    ones_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, 16], ones_layout,
                                          gl.full([BLOCK_N, 16], 1.0, dtype, fill))
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()
    gl.thread_barrier()

    common = (q_smem, k_smem, v_smem, ones_smem, q_bar, k_full, k_empty, v_full, v_empty,
              out_ptr, stride_ot, stride_oh, t0, hq, n, p0, n_blocks, k_mid, c)
    gl.warp_specialize([
        (_consumer_lo, common),
        (_consumer_hi, common),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_full, k_empty,
                     v_full, v_empty, bt_ptr + b * stride_bt, t0, hq * D, (hq // G) * D, max_p,
                     n_blocks, num_slots)),
    ], [4, 1], [240, 32])


@gluon.jit
def _split_gluon_kernel(q_ptr, k_desc, v_desc, bt_ptr, seq_ptr, pos_ptr, row_ptr, part_acc,
                        part_ml, stride_qt, stride_qh, stride_bt, stride_pt, stride_ph,
                        num_slots, c, G: gl.constexpr, ROWS: gl.constexpr, D: gl.constexpr,
                        BLOCK_N: gl.constexpr, PDL: gl.constexpr):
    """``_split_kernel``'s partial (TRANS products, a split of one BLOCK_N-key block) for the G
    query heads of token ``program_id(0)``, kv head ``program_id(1)``, split ``program_id(2)``:
    K and V arrive by TMA page by page while q is staged, ``sT = K q^T``, ``accT = V^T p^T``
    and ``lsT = ones p^T`` on the tensor cores, the elementwise steps ``_split_partial_t``'s.
    PDL (launched with ``launch_pdl``): the step's positions and rows are read and shared
    memory set up before waiting for the previous kernel (the rope kernel, which writes q and
    the new K / V): the metadata is copied in before the step's first kernel, so it is final
    once this kernel starts. Split 0 of every token always waits, so this kernel ends after the
    previous one even where later splits return early."""
    j = gl.program_id(0)
    h = gl.program_id(1)
    split = gl.program_id(2)
    pos = gl.load(pos_ptr + j)
    k_lo = split * BLOCK_N
    if k_lo > pos:
        return
    dtype: gl.constexpr = k_desc.dtype
    b = gl.load(seq_ptr + j).to(gl.int64)
    t = gl.load(row_ptr + j).to(gl.int64)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], v_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    mbarrier.init(bar.index(1), count=1)
    fence_async_shared()
    gl.thread_barrier()
    bt_row = bt_ptr + b * stride_bt
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    _load_block(k_desc, k_smem, bar.index(0), bt_row, split, pos, num_slots, h * D)
    _load_block(v_desc, v_smem, bar.index(1), bt_row, split, pos, num_slots, h * D)

    fill: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    g = gl.minimum(gl.arange(0, ROWS, layout=gl.SliceLayout(1, fill)), G - 1)
    dq = gl.arange(0, D, layout=gl.SliceLayout(0, fill))
    q = gl.load(q_ptr + t * stride_qt + (h * G + g)[:, None] * stride_qh + dq[None, :])
    q_smem = gl.allocate_shared_memory(dtype, [ROWS, D],
                                       gl.NVMMASharedLayout.get_default_for([ROWS, D], dtype), q)
    ones_smem = gl.allocate_shared_memory(
        dtype, [64, BLOCK_N], gl.NVMMASharedLayout.get_default_for([64, BLOCK_N], dtype),
        gl.full([64, BLOCK_N], 1.0, dtype, fill))
    fence_async_shared()
    gl.thread_barrier()

    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                  instr_shape=[16, ROWS, 16])
    mbarrier.wait(bar.index(0), 0)
    sT = warpgroup_mma(k_smem, q_smem.permute((1, 0)), gl.zeros([BLOCK_N, ROWS], gl.float32, MMA),
                       use_acc=False)
    key_pos = k_lo + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    sT = gl.where(key_pos[:, None] <= pos, sT, float("-inf"))
    m = gl.max(sT, 0)
    m_safe = gl.where(m == float("-inf"), 0.0, m)
    pT = gl.exp2(gl.fma(sT, c, -(m_safe * c)[None, :])).to(dtype)
    # p is stored keys-contiguous ([ROWS, BLOCK_N], like q) and read through a transposed view:
    # a [BLOCK_N, ROWS] buffer with ROWS contiguous gave wrong products past key 64 (Triton 3.6)
    p_smem = gl.allocate_shared_memory(
        dtype, [ROWS, BLOCK_N], gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_N], dtype),
        gl.permute(pT, [1, 0]))
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.wait(bar.index(1), 0)
    accT = warpgroup_mma(v_smem.permute((1, 0)), p_smem.permute((1, 0)),
                         gl.zeros([D, ROWS], gl.float32, MMA), use_acc=False)
    lsT = warpgroup_mma(ones_smem, p_smem.permute((1, 0)), gl.zeros([64, ROWS], gl.float32, MMA),
                        use_acc=False)

    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(0, MMA))
    base = j.to(gl.int64) * stride_pt + (h * G + rows) * stride_ph + split
    d = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))
    gl.store(part_acc + base[None, :] * D + d[:, None], accT, mask=(rows < G)[None, :])
    gl.store(part_ml + base * 2 + 1, gl.max(lsT, 0), mask=rows < G)
    gl.store(part_ml + base * 2, m, mask=rows < G)
