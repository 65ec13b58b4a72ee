"""Batch-1 GEMVs whose weights are staged in shared memory before their input exists (Hopper, Gluon).

Inside a decode step's CUDA graph every kernel is launched with programmatic dependent launch:
its programs start once the previous kernel's programs have passed their own wait, and wait for
that kernel's end at ``griddepcontrol.wait``. A program here issues the TMA loads of its weight
tiles before that wait -- weights are no kernel's output -- so HBM streams them while the
previous kernel (a norm, the attention merge) runs. Two orientations:

- wide (N >= MIN_N: qkv, o_proj's chains): a program owns 64 weight rows and one K segment,
  stages up to MAX_STAGES tiles before the wait, then the input rows (padded to ROWS, all of
  its segment) in shared memory, and runs ``warpgroup_mma`` with the weight tile as the 64-row A
  operand and the input's transpose as B (``out^T = W x^T``), refilling each stage as its
  product completes.
- narrow (N < MIN_N: a router): a program owns NARROW_N weight rows and stages all of their K
  before the wait; the input arrives by TMA as the 64-row A operand (rows past M read as zeros),
  the weight tiles are B (``out = x W^T``).

Bits: ``out[m, n]`` is the fp32 sum over ascending K in the tensor cores' 16-element steps from
zero, as in linear_kernels.py's kernels (the tile, the operand order and the row padding do not
change a Hopper dot's bits; tests/gpu/test_gemv_staged_gpu.py checks both kernels against
``linear``), then the bias in fp32 and one cast; with ``partials`` the fp32 sum of each K
segment, as ``linear_partials``.
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
)

from samebits.ops.backend import KBounds
from samebits.ops.pending_merge import PendingMerge
from samebits.ops.triton.attention_gluon import tma_descriptor
from samebits.ops.triton.launcher import gdc_launch_dependents, gdc_wait, programmatic
from samebits.ops.triton.linear_tiles import SMEM_BYTES

# Gluon's names differ between Triton 3.6 and 3.9
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

# The engine's routing (``takes``): products of up to ROWS rows inside a captured graph
# (programmatic launch: the early loads pay only there; eager calls keep linear.py's kernels,
# the same bits), N below MAX_N (an LM head or a wide gate_up keeps linear.py's persistent
# tiles), a wide program walking at most MAX_SEGMENT of K (most of it staged before the wait)
ROWS, MIN_N, MAX_N, MAX_SEGMENT = 8, 512, 24576, 2048
BLOCK_N, BLOCK_K, MAX_STAGES = 64, 256, 6  # wide: 64 weight rows a program, 256-column tiles
NARROW_N, X_ROWS, MAX_X_STAGES = 16, 64, 4  # narrow (N < MIN_N): 16 weight rows a program
MAX_MERGED_SPLITS = 4  # decode contexts up to 4 splits (512 keys at 128-key splits) merge inside
_MERGE_STAGES_LESS = 1  # one weight stage gives its shared memory to the merged row's scratch


@gluon.jit
def _stage(desc, smem, ready, row, k, s):
    """TMA of ``desc``'s tile at (row, k) into buffer s of ``smem``, completing on barrier s."""
    mbarrier.expect(ready.index(s), desc.block_type.nbytes)
    _tma_load(desc, [row, k], ready.index(s), smem.index(s))


@gluon.jit
def _store(acc, out_ptr, b_ptr, m, n, M, N, stride_om, HAS_BIAS: gl.constexpr):
    """out[m, n] = acc (+ b[n] in fp32), cast once; ``m`` / ``n`` index acc's rows or columns
    (broadcast to its shape, either orientation), rows >= M and columns >= N not stored."""
    if HAS_BIAS:
        acc += gl.load(b_ptr + n, mask=n < N, other=0.0).to(gl.float32)
    gl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty),
             mask=(m < M) & (n < N))


@gluon.jit
def _stage_rows(x_ptr, stride_xm, M, k0, x_smem, fill: gl.constexpr):
    """The input rows [0, M) of the segment from k0 into the padded tiles (rows >= M zero)."""
    K_STEPS: gl.constexpr = x_smem.shape[0]
    ROWS: gl.constexpr = x_smem.shape[1]
    BLOCK_K: gl.constexpr = x_smem.shape[2]
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, fill))
    cc = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, fill))
    for i in gl.static_range(K_STEPS):
        cols = k0 + i * BLOCK_K + cc
        xt = gl.load(x_ptr + r[:, None] * stride_xm + cols[None, :], mask=(r < M)[:, None],
                     other=0.0)
        x_smem.index(i).store(xt)


@gluon.jit
def _stage_merged(part_acc, part_ml, pos, max_splits, c, seg, x_smem, fill: gl.constexpr,
                  D: gl.constexpr, SPLIT: gl.constexpr, MAX_MERGED: gl.constexpr):
    """Row 0 of the padded input tiles (rows 1.. zero) = the merge of token 0's splits 0..pos //
    SPLIT (at most MAX_MERGED) for the segment's heads: ``attention_kernels._merge_splits``'
    elementwise arithmetic in the same order (a split past the count is skipped by a select),
    so the bits of the merge kernel's output; every split's partial is loaded at once."""
    K_STEPS: gl.constexpr = x_smem.shape[0]
    BLOCK_K: gl.constexpr = x_smem.shape[2]
    HS: gl.constexpr = K_STEPS * BLOCK_K // D
    hl: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [gl.num_warps(), 1], [1, 0])
    heads = seg * HS + gl.arange(0, HS, layout=gl.SliceLayout(1, hl))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, hl))
    n_splits = pos // SPLIT + 1
    big_m = gl.full([HS], float("-inf"), gl.float32, gl.SliceLayout(1, hl))
    big_l = gl.zeros([HS], gl.float32, gl.SliceLayout(1, hl))
    acc = gl.zeros([HS, D], gl.float32, hl)
    for s in gl.static_range(MAX_MERGED):
        valid = (heads * 0 + s) < n_splits  # [HS]: split s is one of the token's
        base = heads.to(gl.int64) * max_splits + s
        m_s = gl.load(part_ml + base * 2, mask=valid, other=0.0, cache_modifier=".cg")
        l_s = gl.load(part_ml + base * 2 + 1, mask=valid, other=1.0, cache_modifier=".cg")
        acc_s = gl.load(part_acc + base[:, None] * D + d[None, :], mask=valid[:, None],
                        other=0.0, cache_modifier=".cg")
        m_new = gl.maximum(big_m, m_s)
        a1 = gl.exp2((big_m - m_new) * c)
        a2 = gl.exp2((m_s - m_new) * c)
        l_new = gl.fma(big_l, a1, l_s * a2)
        acc_new = gl.fma(acc, a1[:, None], acc_s * a2[:, None])
        big_m = gl.where(valid, m_new, big_m)
        big_l = gl.where(valid, l_new, big_l)
        acc = gl.where(valid[:, None], acc_new, acc)
    x = (acc / big_l[:, None]).to(x_smem.dtype)
    scratch = gl.allocate_shared_memory(x_smem.dtype, [HS, D],
                                        gl.SwizzledSharedLayout(1, 1, 1, [1, 0]), x)
    _cta_barrier()
    steps = scratch.reshape([K_STEPS, BLOCK_K])  # K step i: BLOCK_K // D heads' columns
    ROWS: gl.constexpr = x_smem.shape[1]
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, fill))
    for i in gl.static_range(K_STEPS):
        row = steps.slice(i, 1).load(fill)  # [1, BLOCK_K]
        x_smem.index(i).store(gl.where((r == 0)[:, None], row, 0.0).to(x_smem.dtype))


@gluon.jit
def _gemv_staged_kernel(x_ptr, w_desc, b_ptr, out_ptr, M, N, K_SEG, stride_xm, stride_om,
                        stride_ps, part_acc, part_ml, pos_ptr, max_splits, c,
                        HAS_BIAS: gl.constexpr, K_STEPS: gl.constexpr, STAGES: gl.constexpr,
                        ROWS: gl.constexpr, PDL: gl.constexpr, MERGE: gl.constexpr = False,
                        D: gl.constexpr = 128, SPLIT: gl.constexpr = 128,
                        MAX_MERGED: gl.constexpr = MAX_MERGED_SPLITS):
    """Program (n-tile ``program_id(0)``, K segment ``program_id(1)``): rows [n0, n0 + BLOCK_N)
    of out^T over columns [seg K_SEG, (seg + 1) K_SEG) of x's first M rows (M <= ROWS).
    MERGE (M = 1): x is the attention's output, merged here from the decode split partials
    (``_stage_merged``; D, SPLIT, MAX_MERGED its shapes) instead of read."""
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    dtype: gl.constexpr = w_desc.dtype
    n0 = gl.program_id(0) * BLOCK_N
    seg = gl.program_id(1)
    k0 = seg * K_SEG
    w_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    fence_async_shared()
    for s in gl.static_range(STAGES):  # weights only: before the wait
        if s < K_STEPS:
            _stage(w_desc, w_smem, ready, n0, k0 + s * BLOCK_K, s)
    pos = 0
    if MERGE:  # the step's metadata: final before its first kernel
        pos = gl.load(pos_ptr)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    fill: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_K], dtype)
    x_smem = gl.allocate_shared_memory(dtype, [K_STEPS, ROWS, BLOCK_K], x_layout)
    if MERGE:
        _stage_merged(part_acc, part_ml, pos, max_splits, c, seg, x_smem, fill, D, SPLIT,
                      MAX_MERGED)
    else:
        _stage_rows(x_ptr, stride_xm, M, k0, x_smem, fill)
    fence_async_shared()
    _cta_barrier()
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                  warps_per_cta=[gl.num_warps(), 1],
                                                  instr_shape=[16, ROWS, 16])
    acc = gl.zeros([BLOCK_N, ROWS], gl.float32, MMA)
    for i in gl.static_range(K_STEPS):
        mbarrier.wait(ready.index(i % STAGES), (i // STAGES) & 1)
        acc = warpgroup_mma(w_smem.index(i % STAGES), x_smem.index(i).permute((1, 0)), acc)
        if i + STAGES < K_STEPS:  # the product has read the stage: refill it
            _stage(w_desc, w_smem, ready, n0, k0 + (i + STAGES) * BLOCK_K, i % STAGES)
    nn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    mm = gl.arange(0, ROWS, layout=gl.SliceLayout(0, MMA))
    _store(acc, out_ptr + seg * stride_ps, b_ptr, mm[None, :], nn[:, None], M, N, stride_om,
           HAS_BIAS)


@gluon.jit
def _gemv_narrow_kernel(x_desc, w_desc, b_ptr, out_ptr, M, N, stride_om,
                        HAS_BIAS: gl.constexpr, K_STEPS: gl.constexpr, X_STAGES: gl.constexpr,
                        PDL: gl.constexpr):
    """Program n-tile ``program_id(0)``: out[:M, n0:n0 + BLOCK_N] over all of K, the input as
    the 64-row A operand (TMA fills rows >= M with zeros) and every K tile of the program's
    weight rows staged before the wait as the B operand (``out = x W^T``)."""
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    dtype: gl.constexpr = w_desc.dtype
    n0 = gl.program_id(0) * BLOCK_N
    w_smem = gl.allocate_shared_memory(dtype, [K_STEPS, BLOCK_N, BLOCK_K], w_desc.layout)
    x_smem = gl.allocate_shared_memory(dtype, [X_STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    w_ready = gl.allocate_shared_memory(gl.int64, [K_STEPS, 1], mbarrier.MBarrierLayout())
    x_ready = gl.allocate_shared_memory(gl.int64, [X_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(K_STEPS):
        mbarrier.init(w_ready.index(s), count=1)
    for s in gl.static_range(X_STAGES):
        mbarrier.init(x_ready.index(s), count=1)
    fence_async_shared()
    for s in gl.static_range(K_STEPS):  # weights only: before the wait
        _stage(w_desc, w_smem, w_ready, n0, s * BLOCK_K, s)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    for s in gl.static_range(X_STAGES):
        _stage(x_desc, x_smem, x_ready, 0, s * BLOCK_K, s)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                  warps_per_cta=[gl.num_warps(), 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
    for i in gl.static_range(K_STEPS):
        mbarrier.wait(x_ready.index(i % X_STAGES), (i // X_STAGES) & 1)
        mbarrier.wait(w_ready.index(i), 0)
        acc = warpgroup_mma(x_smem.index(i % X_STAGES), w_smem.index(i).permute((1, 0)), acc)
        if i + X_STAGES < K_STEPS:  # the product has read the stage: refill it
            _stage(x_desc, x_smem, x_ready, 0, (i + X_STAGES) * BLOCK_K, i % X_STAGES)
    mm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))
    nn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
    _store(acc, out_ptr, b_ptr, mm[:, None], nn[None, :], M, N, stride_om, HAS_BIAS)


def takes(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, segments: int = 1,
          partials: bool = False) -> bool:
    """Whether the engine routes ``x @ w.T`` (+ b; over ``segments`` chains, kept apart with
    ``partials``) here: a decode product inside a captured graph on Hopper (module constants)."""
    return (x.dim() == 2 and programmatic(x) and w.dim() == 2
            and _routed(w.shape[0], x.shape[1] // segments) and supports(x, w, b, segments, partials))


def _routed(n: int, seg: int) -> bool:
    """The engine's limits: N below MAX_N, a wide program's K segment at most MAX_SEGMENT."""
    return n < MAX_N and (n < MIN_N or seg <= MAX_SEGMENT)


def even_bounds(k_bounds: KBounds, k: int) -> bool:
    """Whether ``k_bounds`` are ``len(k_bounds)`` equal contiguous segments of [0, k)."""
    s = len(k_bounds)
    return k % s == 0 and list(k_bounds) == [(i * k // s, (i + 1) * k // s) for i in range(s)]


def supports(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, segments: int = 1,
             partials: bool = False) -> bool:
    """Whether a kernel here takes the product: the narrow one below MIN_N columns (one
    segment, no partials), the wide one from there; operands TMA and the stores can read."""
    m, k = x.shape
    n = w.shape[0]
    common = (x.is_cuda and x.stride(1) == 1 and 1 <= m <= ROWS
              and _weight(w, k, segments, x.dtype, x.device)
              and (b is None or (not partials and b.is_contiguous() and b.numel() == n
                                 and b.device == x.device)))
    if n < MIN_N:
        return (common and segments == 1 and not partials and n % NARROW_N == 0
                and (x.stride(0) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0
                and _x_stages(k // BLOCK_K) >= 1)
    return common and (partials or segments == 1) and _wide(w, k // segments, 1)


def _weight(w: torch.Tensor, k: int, segments: int, dtype: torch.dtype,
            device: torch.device) -> bool:
    """w [N, k] in 16-bit ``dtype`` on ``device``, contiguous and 16-byte aligned (TMA), over
    ``segments`` equal K segments of whole BLOCK_K tiles."""
    return (dtype in (torch.bfloat16, torch.float16) and w.dtype == dtype and w.dim() == 2
            and w.shape[1] == k and w.is_contiguous() and w.data_ptr() % 16 == 0
            and w.device == device and k % segments == 0 and (k // segments) % BLOCK_K == 0)


def _wide(w: torch.Tensor, seg: int, spare_stages: int) -> bool:
    """The wide kernel's N tiling of w, and at least ``spare_stages`` weight stages beside a
    segment of ``seg`` columns' staged input."""
    return w.shape[0] % BLOCK_N == 0 and _stages(seg // BLOCK_K) >= spare_stages


def _stages(k_steps: int) -> int:
    """Wide: weight tiles in flight (and loaded before the wait) beside the staged input rows."""
    return _ring(k_steps, k_steps * ROWS, BLOCK_N, MAX_STAGES)


def _x_stages(k_steps: int) -> int:
    """Narrow: input tiles in flight beside all of the program's weight tiles."""
    return _ring(k_steps, k_steps * NARROW_N, X_ROWS, MAX_X_STAGES)


def _ring(k_steps: int, fixed_rows: int, stage_rows: int, cap: int) -> int:
    """Buffers of ``stage_rows`` x BLOCK_K 16-bit values that shared memory holds beside
    ``fixed_rows`` such rows and the barriers, at most ``cap`` and ``k_steps``; the count does
    not change the bits."""
    free = SMEM_BYTES - 1024 - 2 * fixed_rows * BLOCK_K
    return min(cap, k_steps, max(free, 0) // (2 * stage_rows * BLOCK_K))


def gemv_staged(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                segments: int = 1, partials: bool = False) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ b) -> [M, N] in x's dtype; ``partials``: [S, M, N] fp32, one
    K segment's sum each (no bias). A ValueError where ``supports`` does not hold."""
    if not supports(x, w, b, segments, partials):
        raise ValueError(f"gemv_staged: x {tuple(x.shape)} {x.dtype} @ w {tuple(w.shape)} over "
                         f"{segments} segment(s), partials={partials}: not a product it takes")
    m, k = x.shape
    n, seg = w.shape[0], k // segments
    if n < MIN_N:
        return _narrow(x, w, b)
    shape = (segments, m, n) if partials else (m, n)
    out = torch.empty(shape, dtype=torch.float32 if partials else x.dtype, device=x.device)
    pdl = programmatic(x)
    _gemv_staged_kernel[(n // BLOCK_N, segments)](
        x, tma_descriptor(w, [BLOCK_N, BLOCK_K]), b if b is not None else x, out, m, n, seg,
        x.stride(0), n, m * n, part_acc=out, part_ml=out, pos_ptr=x, max_splits=1, c=1.0,
        HAS_BIAS=b is not None, K_STEPS=seg // BLOCK_K, STAGES=_stages(seg // BLOCK_K),
        ROWS=ROWS, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


def _narrow(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    pdl = programmatic(x)
    _gemv_narrow_kernel[(n // NARROW_N,)](
        tma_descriptor(x, [X_ROWS, BLOCK_K]), tma_descriptor(w, [NARROW_N, BLOCK_K]),
        b if b is not None else x, out, m, n, n, HAS_BIAS=b is not None, K_STEPS=k // BLOCK_K,
        X_STAGES=_x_stages(k // BLOCK_K), PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


def merged_partials(pm: PendingMerge, w: torch.Tensor, segments: int) -> torch.Tensor:
    """``linear.partials(pm.resolve(), w, segments equal K chains)`` -> [S, 1, N] fp32 for one
    decode token: its attention output merged inside the GEMV from the split kernel's partials
    (``pm.part_acc`` [1, Hq, max_splits, D], ``pm.part_ml`` [1, Hq, max_splits, 2]: splits 0..
    positions[0] // split_size). ``merges`` must hold."""
    _, hq, max_splits, d = pm.part_acc.shape
    n, k = w.shape[0], hq * d
    seg = k // segments
    out = torch.empty(segments, 1, n, dtype=torch.float32, device=w.device)
    pdl = programmatic(w)
    _gemv_staged_kernel[(n // BLOCK_N, segments)](
        w, tma_descriptor(w, [BLOCK_N, BLOCK_K]), w, out, 1, n, seg, k, n, n,
        part_acc=pm.part_acc, part_ml=pm.part_ml, pos_ptr=pm.positions, max_splits=max_splits,
        c=pm.c, HAS_BIAS=False, K_STEPS=seg // BLOCK_K,
        STAGES=_stages(seg // BLOCK_K) - _MERGE_STAGES_LESS, ROWS=ROWS, PDL=pdl, MERGE=True, D=d,
        SPLIT=pm.split_size, num_warps=4, launch_pdl=pdl,
        enable_fp_fusion=False)  # the merge kernel's flags
    return out


def merges(w: torch.Tensor, pm: PendingMerge, segments: int) -> bool:
    """Whether ``merged_partials`` takes o_proj ``w`` over ``pm``: at most MAX_MERGED_SPLITS
    splits, w a wide product in the attention's dtype on its device, each chain a power-of-two
    number of whole heads in whole K tiles."""
    _, hq, max_splits, d = pm.part_acc.shape
    k = hq * d
    seg = k // segments
    heads = seg // d
    return (max_splits <= MAX_MERGED_SPLITS and pm.part_acc.is_cuda
            and _weight(w, k, segments, pm.dtype, pm.part_acc.device)
            and w.shape[0] >= MIN_N and _routed(w.shape[0], seg)
            and _wide(w, seg, _MERGE_STAGES_LESS + 1)
            and seg % d == 0 and heads & (heads - 1) == 0 and d & (d - 1) == 0)
