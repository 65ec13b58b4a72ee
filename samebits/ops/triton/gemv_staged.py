"""Batch-1 GEMVs whose weights are staged in shared memory before their input exists (Hopper, Gluon).

Inside a decode step's CUDA graph every kernel is launched with programmatic dependent launch:
its programs start once the previous kernel's programs have passed their own wait, and wait for
that kernel's end at ``griddepcontrol.wait``. A program here issues the TMA loads of its weight
tiles before that wait -- weights are no kernel's output -- so HBM streams them while the
previous kernel (a norm, the attention merge) runs. Two orientations:

- wide (N >= MIN_N: qkv, o_proj's chains): a program owns 64 weight rows and one K segment,
  stages up to MAX_STAGES tiles before the wait, then the input rows (padded to 8 or 16, all of
  its segment) in shared memory, and runs ``warpgroup_mma`` with the weight tile as the 64-row A
  operand and the input's transpose as B (``out^T = W x^T``), refilling each stage as its
  product completes. Programs walk at most MAX_SEGMENT of K (most of it staged early: longer
  segments measured slower on the 8B model).
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

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from samebits.ops.triton.launcher import gdc_launch_dependents, gdc_wait, programmatic

# Gluon's names moved between Triton 3.6 (the GPU machine's) and 3.9
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

BLOCK_N, BLOCK_K, MAX_STAGES, MAX_ROWS_PADDED = 64, 256, 6, 16
SMEM_BYTES = 226 * 1024


@gluon.jit
def _stage(w_desc, w_smem, ready, n0, k, s):
    mbarrier.expect(ready.index(s), w_desc.block_type.nbytes)
    _tma_load(w_desc, [n0, k], ready.index(s), w_smem.index(s))


@gluon.jit
def _gemv_staged_kernel(x_ptr, w_desc, b_ptr, out_ptr, M, N, K_SEG, stride_xm, stride_om,
                        stride_ps, HAS_BIAS: gl.constexpr, K_STEPS: gl.constexpr,
                        STAGES: gl.constexpr, ROWS: gl.constexpr, PDL: gl.constexpr):
    """Program (n-tile ``program_id(0)``, K segment ``program_id(1)``): rows [n0, n0 + BLOCK_N)
    of out^T over columns [seg K_SEG, (seg + 1) K_SEG) of x's first M rows (M <= ROWS)."""
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
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    fill: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, fill))
    c = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, fill))
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_K], dtype)
    x_smem = gl.allocate_shared_memory(dtype, [K_STEPS, ROWS, BLOCK_K], x_layout)
    for i in gl.static_range(K_STEPS):  # the input rows of the whole segment, rows >= M zero
        cols = k0 + i * BLOCK_K + c
        xt = gl.load(x_ptr + r[:, None] * stride_xm + cols[None, :], mask=(r < M)[:, None],
                     other=0.0)
        x_smem.index(i).store(xt)
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
    if HAS_BIAS:
        acc += gl.load(b_ptr + nn, mask=nn < N, other=0.0).to(gl.float32)[:, None]
    out = out_ptr + seg * stride_ps + mm[None, :] * stride_om + nn[:, None]
    gl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(mm < M)[None, :] & (nn < N)[:, None])


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
    if HAS_BIAS:
        acc += gl.load(b_ptr + nn, mask=nn < N, other=0.0).to(gl.float32)[None, :]
    out = out_ptr + mm[:, None] * stride_om + nn[None, :]
    gl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(mm < M)[:, None] & (nn < N)[None, :])


MAX_ROWS, MIN_N, MAX_N = 8, 512, 24576  # decode GEMVs; narrower (a router): the narrow kernel
MAX_SEGMENT = 2048  # K a wide program walks: most of it staged before the wait
NARROW_N, X_ROWS, MAX_X_STAGES = 16, 64, 4


def takes(x: torch.Tensor, w: torch.Tensor, segments: int) -> bool:
    """Whether the engine routes ``x @ w.T`` here: a decode-sized product on Hopper."""
    return (x.dim() == 2 and x.is_cuda and x.shape[0] <= MAX_ROWS and w.shape[0] < MAX_N
            and (w.shape[0] < MIN_N or x.shape[1] // segments <= MAX_SEGMENT)
            and _hopper(x.get_device()) and supports(x, w, segments))


def even_bounds(k_bounds, k: int) -> bool:
    """Whether ``k_bounds`` are ``len(k_bounds)`` equal contiguous segments of [0, k)."""
    s = len(k_bounds)
    return k % s == 0 and list(k_bounds) == [(i * k // s, (i + 1) * k // s) for i in range(s)]


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def supports(x: torch.Tensor, w: torch.Tensor, segments: int) -> bool:
    """Whether a kernel here takes ``x @ w.T`` over ``segments`` equal K segments: the narrow
    one below MIN_N columns (one segment), the wide one from there."""
    m, k = x.shape
    n = w.shape[0]
    seg = k // segments
    common = (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
              and w.is_contiguous() and x.stride(1) == 1 and k % segments == 0
              and seg % BLOCK_K == 0 and m >= 1)
    if n < MIN_N:
        return (common and segments == 1 and m <= X_ROWS and n % NARROW_N == 0
                and (x.stride(0) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0
                and _x_stages(k // BLOCK_K) >= 1)
    return (common and m <= MAX_ROWS_PADDED and n % BLOCK_N == 0
            and _stages(seg // BLOCK_K, _rows(m)) >= 1)


def _rows(m: int) -> int:
    """The input rows padded to the MMA's N (8 or 16): the padding does not change a row's bits."""
    return 8 if m <= 8 else 16


def _stages(k_steps: int, rows: int) -> int:
    """Weight tiles in flight (and loaded before the wait): as many as shared memory holds
    beside the staged input, at most MAX_STAGES; the count does not change the bits."""
    free = SMEM_BYTES - 1024 - 2 * k_steps * rows * BLOCK_K
    return min(MAX_STAGES, k_steps, max(free, 0) // (2 * BLOCK_N * BLOCK_K))


def _x_stages(k_steps: int) -> int:
    """Input tiles in flight in the narrow kernel, beside all of its weight tiles."""
    free = SMEM_BYTES - 1024 - 2 * k_steps * NARROW_N * BLOCK_K
    return min(MAX_X_STAGES, k_steps, max(free, 0) // (2 * X_ROWS * BLOCK_K))


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    dt = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    block = [rows, BLOCK_K]
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], block,
                            gl.NVMMASharedLayout.get_default_for(block, dt))


def gemv_staged(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                segments: int = 1, partials: bool = False) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ b) -> [M, N] in x's dtype; ``partials``: [S, M, N] fp32, one
    K segment's sum each (no bias). ``supports`` must hold."""
    m, k = x.shape
    n, seg, rows = w.shape[0], k // segments, _rows(m)
    if n < MIN_N:
        assert segments == 1 and not partials, "the narrow kernel walks all of K"
        return _narrow(x, w, b)
    if partials:
        out = torch.empty(segments, m, n, dtype=torch.float32, device=x.device)
    else:
        assert segments == 1, "segments are summed by the caller (linear_partials' contract)"
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    desc = _descriptor(w, BLOCK_N)
    pdl = programmatic(x)
    _gemv_staged_kernel[(n // BLOCK_N, segments)](
        x, desc, b if b is not None else x, out, m, n, seg, x.stride(0), n, m * n,
        HAS_BIAS=b is not None, K_STEPS=seg // BLOCK_K, STAGES=_stages(seg // BLOCK_K, rows),
        ROWS=rows, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


def _narrow(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    pdl = programmatic(x)
    _gemv_narrow_kernel[(n // NARROW_N,)](
        _descriptor(x, X_ROWS), _descriptor(w, NARROW_N), b if b is not None else x, out, m, n,
        n, HAS_BIAS=b is not None, K_STEPS=k // BLOCK_K, X_STAGES=_x_stages(k // BLOCK_K),
        PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out
