"""Batch-invariant mixture of experts on CUDA: route, align, two grouped GEMMs, combine.

Five launches per sparse layer after the router's linear, none of them reading a host value of
the batch (CUDA graphs capture them):

1. ``_route_kernel``, one program per token: softmax of its fp32 logits, the top k by repeated
   max with ties to the lowest expert id, the renormalization by their rank-order sum (IEEE
   division), the rounding to the logits' dtype. Its warps and block are functions of E.
2. align: the (token, rank) assignments ``a = t k + j`` sorted by expert (stable), each expert's
   run padded to whole ``BLOCK_M`` blocks, ``sorted_ids[slot] = a`` (sentinel A for padding):
   ``_align_kernel`` in one program up to ``ALIGN_ONE_PROGRAM`` assignments, torch ops beyond.
   Up to ``DIRECT_MAX`` assignments (decode of a few sequences, whose experts rarely repeat)
   no layout at all: block b is assignment b alone (the GEMMs' ``DIRECT`` mode).
3. ``_moe_gemm_kernel`` GATED: program (block, N-tile) reads its block's expert id from the
   block's first assignment and computes gate and up of ``BLOCK_N`` columns for the block's
   tokens over ascending K, then ``silu(gate) * up`` with ``activation.py``'s bits. At decode a
   block holds an expert's few tokens: each program reads its expert's weight tile once (a
   GEMV on the tensor cores); at prefill blocks tile the sorted tokens.
4. the same kernel, not gated: ``y[a] = act[a] @ w2[e].T``. On Hopper, up to ``DIRECT_MAX``
   assignments, its programs start while the gate/up GEMM runs and load their first two weight
   tiles then (``preload``).
5. ``_combine_kernel``, per token: ``acc = w_0 y_0``, ``acc += w_j y_j`` in rank order, ``+ scale
   * shared``, in fp32 without contraction (the bits of ``samebits.ops.moe.combine_ordered``
   over torch's CUDA ops), cast once.

Invariance: every element of y is ``tl.dot`` over ascending K from zero, so a token's bits depend
on its row and its expert's weights -- not on how many tokens share the expert, the block it
lands in, or the tile and its K steps (which follow the batch for speed: on Hopper the tile
shape does not change a dot's bits, as for ``linear.py``;
tests/gpu/test_moe_gpu.py checks it, and that an expert's output is the bits of the engine's
``linear`` / ``silu_mul`` / ``linear`` on that token).

Expert parallel (``expert_outputs``): a tensor-parallel rank holds E' = E / N whole experts;
the ids come shifted by its first expert, and another rank's expert (id E') takes no slot in the
layout and no program in the GEMMs. The model gathers every rank's y, then ``combined``.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from samebits.ops.triton.activation import ACCURATE_EXP, FP_FUSION
from samebits.ops.triton.launcher import programmatic, programmatic_device, wait_for_inputs

ALIGN_ONE_PROGRAM = 2048  # assignments the one-program align kernel sorts (decode batches)
DIRECT_MAX = 32  # assignments laid out one per block, no align launch (batch <= 4 at top-8)
COMBINE_BLOCK = 512  # columns a combine program adds (free: its sums are per column)
_NO_FTZ = {"enable_reflect_ftz": False}


@dataclasses.dataclass(frozen=True)
class MoeGemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    preload: int = 0  # the down GEMM's first K tiles loaded before its wait (0-2; moe_gemm)

    def __post_init__(self) -> None:
        if not 0 <= self.preload <= 2:
            raise ValueError(f"preload takes 0-2 K tiles, got {self}")


def pick_config(assignments: int, experts: int, dtype: torch.dtype, gated: bool,
                hopper: bool = True) -> MoeGemmConfig:
    """Tiles from the mean tokens per routed expert (free to vary: they do not change bits).
    ``gated`` (gate and up, two accumulators, N = I): narrower N tiles, so a decode step's few
    experts still spread over every SM. ``hopper``: the device launches with programmatic
    dependent launch (Hopper; ``launcher.programmatic_device``), which the one-block-an-assignment
    tiles' preload needs."""
    if dtype == torch.float32:  # FMA dots: small tiles
        return MoeGemmConfig(16, 32, 32, 4, 2)
    per_expert = assignments / max(1, min(assignments, experts))
    if assignments <= DIRECT_MAX and hopper:  # one block an assignment: the down GEMM's first
        # two K tiles load while the gate/up GEMM runs (the fastest at batch 1 on an H100,
        # benchmarks/RESULTS.md)
        return MoeGemmConfig(16, 32 if gated else 64, 256, 4, 3, preload=0 if gated else 2)
    if per_expert <= 16:  # decode: one block per expert, a GEMV over its weight tiles
        return MoeGemmConfig(16, 32 if gated else 64, 128, 4, 4)
    if per_expert <= 64:
        return MoeGemmConfig(32, 64, 128, 4, 4)
    return MoeGemmConfig(64, 64 if gated else 128, 64, 4 if gated else 8, 3)


def num_slots(assignments: int, experts: int, block_m: int) -> int:
    """Padded rows of the sorted layout: enough for any routing of ``assignments``."""
    return (triton.cdiv(assignments, block_m) + min(assignments, experts)) * block_m


# ---- 1. route -------------------------------------------------------------------------------
@triton.jit
def _route_kernel(logits_ptr, ids_ptr, w_ptr, E, stride_l, TOP_K: tl.constexpr,
                  K_POW2: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr,
                  ROUND: tl.constexpr, PDL: tl.constexpr):
    """Token ``program_id(0)``'s top-k experts and weights; depends on its logits alone. Each
    pick is one max over int64 keys (the probability's bits above ``0xFFFF - id``: unique, so
    the larger probability wins and equal ones go to the lower id, as ``topk_lowest_id``)."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    raw = tl.load(logits_ptr + row * stride_l + offs, mask=offs < E, other=float("-inf"))
    x = raw.to(tl.float32)
    m = tl.max(x, 0)
    p = tl.exp(x - m) * (1.0 / tl.sum(tl.exp(x - m), 0))
    key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 16) | (0xFFFF - offs)
    key = tl.where(offs < E, key, -1)
    js = tl.arange(0, K_POW2)
    vals = tl.zeros([K_POW2], tl.float32)
    idxs = tl.zeros([K_POW2], tl.int32)
    total = 0.0  # + p_0 is exact: the rank-order sum of samebits.ops.moe._normalized
    for j in tl.static_range(TOP_K):
        best = tl.max(key, 0)
        val = (best >> 16).to(tl.int32).to(tl.float32, bitcast=True)
        vals = tl.where(js == j, val, vals)
        idxs = tl.where(js == j, (0xFFFF - (best & 0xFFFF)).to(tl.int32), idxs)
        total = total + val
        key = tl.where(key == best, -1, key)
    if RENORM:
        vals = tl.div_rn(vals, tl.zeros([K_POW2], tl.float32) + total)
    if ROUND:
        vals = vals.to(raw.dtype).to(tl.float32)
    tl.store(ids_ptr + row * TOP_K + js, idxs, mask=js < TOP_K)
    tl.store(w_ptr + row * TOP_K + js, vals, mask=js < TOP_K)


def route(logits: torch.Tensor, top_k: int, renormalize: bool, round_weights: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], ids int32 [T, k]) for router logits [T, E]."""
    t, e = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    if t:
        block, pdl = max(16, triton.next_power_of_2(e)), programmatic(logits)
        _route_kernel[(t,)](logits, ids, weights, e, logits.stride(0), TOP_K=top_k,
                            K_POW2=max(2, triton.next_power_of_2(top_k)), BLOCK_E=block,
                            RENORM=renormalize, ROUND=round_weights, PDL=pdl,
                            num_warps=1 if block <= 512 else 4, launch_pdl=pdl)
    return weights, ids


# ---- 2. align -------------------------------------------------------------------------------
@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, A, E, SLOTS, BLOCK_A: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, FILL: tl.constexpr,
                  PDL: tl.constexpr):
    """One program: ``sorted_ptr[slot]`` = assignment, by expert then assignment index
    (assignments of expert E -- held by another rank -- get no slot)."""
    wait_for_inputs(PDL)
    for s in range(0, SLOTS, FILL):
        fill = s + tl.arange(0, FILL)
        tl.store(sorted_ptr + fill, tl.zeros([FILL], tl.int32) + A, mask=fill < SLOTS)
    tl.debug_barrier()  # the sentinels land before any assignment
    a = tl.arange(0, BLOCK_A)
    valid = a < A
    e = tl.load(ids_ptr + a, mask=valid, other=0)
    e = tl.where(valid, e, E)  # padding lanes count in bin E, sort last
    counts = tl.histogram(e, BLOCK_E)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.cumsum(counts, 0) - counts
    pad_start = tl.cumsum(padded, 0) - padded
    key = tl.sort(e * BLOCK_A + a)
    se = key // BLOCK_A
    slot = tl.gather(pad_start, se, 0) + (a - tl.gather(start, se, 0))
    tl.store(sorted_ptr + slot, key % BLOCK_A, mask=(a < A) & (se < E))


def align(ids: torch.Tensor, experts: int, block_m: int) -> torch.Tensor:
    """sorted_ids [num_slots] int32 for ids [T, k] (see the module docstring, step 2); an id
    ``experts`` (another rank's expert) gets no slot."""
    flat = ids.reshape(-1)
    a = flat.numel()
    slots = num_slots(a, experts, block_m)
    out = torch.empty(slots, dtype=torch.int32, device=ids.device)
    if a <= ALIGN_ONE_PROGRAM:
        pdl = programmatic(out)
        _align_kernel[(1,)](flat, out, a, experts, slots,
                            BLOCK_A=max(16, triton.next_power_of_2(a)),
                            BLOCK_E=max(16, triton.next_power_of_2(experts + 1)),
                            BLOCK_M=block_m, FILL=1024, PDL=pdl, num_warps=8, launch_pdl=pdl)
        return out
    return _align_torch(flat.long(), experts, block_m, out)


def _align_torch(flat: torch.Tensor, experts: int, block_m: int, out: torch.Tensor
                 ) -> torch.Tensor:
    """The same layout by torch ops (prefill-sized batches)."""
    se, sa = torch.sort(flat, stable=True)
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    start, pad_start = torch.cumsum(counts, 0) - counts, torch.cumsum(padded, 0) - padded
    slot = pad_start[se] + torch.arange(flat.numel(), device=flat.device) - start[se]
    slots = out.numel()
    spill = out.new_empty(slots + 1).fill_(flat.numel())  # the last slot takes expert E's
    spill[torch.where(se < experts, slot, slots)] = sa.to(torch.int32)
    out.copy_(spill[:slots])
    return out


# ---- 3, 4. grouped GEMM -----------------------------------------------------------------------
@triton.jit
def _preloaded_dots(x_ptrs, w_ptrs, row_ok, acc, PDL: tl.constexpr, PRELOAD: tl.constexpr,
                    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """The first PRELOAD (1 or 2) K steps: their weight tiles loaded into registers, then the wait
    for the inputs, then the dots in ascending K (the loop's order, so the loop's bits)."""
    b0 = tl.load(w_ptrs)
    b1 = b0
    if PRELOAD > 1:
        b1 = tl.load(w_ptrs + BLOCK_K)
    wait_for_inputs(PDL)
    acc = tl.dot(tl.load(x_ptrs, mask=row_ok, other=0.0), b0, acc, input_precision=PRECISION)
    if PRELOAD > 1:
        a = tl.load(x_ptrs + BLOCK_K, mask=row_ok, other=0.0)
        acc = tl.dot(a, b1, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _moe_gemm_kernel(x_ptr, w_ptr, out_ptr, sorted_ptr, ids_ptr, A, E, N, K, stride_xm, stride_we,
                     stride_wn, stride_om, TOP_K: tl.constexpr, GATED: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, PRECISION: tl.constexpr, ACCURATE: tl.constexpr,
                     DIRECT: tl.constexpr, PDL: tl.constexpr, PRELOAD: tl.constexpr):
    """GATED: out[a, n] = silu(x[a // k] . w[e, n]) * (x[a // k] . w[e, N + n]) (N = I);
    else out[a, n] = x[a] . w[e, n]. Invariance: an element depends on its input row and
    expert alone (one ascending-K dot from zero).

    DIRECT: no layout (``sorted_ptr`` unread): block b holds assignment b alone. An expert id
    E (held by another rank) computes nothing.

    PRELOAD > 0 (not GATED, EVEN_K, K >= PRELOAD BLOCK_K): the layout, the ids and the first
    PRELOAD weight tiles are read before the wait, into registers, while the previous kernel
    runs. The caller guarantees that the previous kernel does not write the layout or the ids
    (the down GEMM: they are the route's and the align's, written before the gate/up GEMM
    started, hence final once this kernel starts; read with ``.cg``, from L2). Weights are no
    kernel's output. The dots run in the same order: the same bits. A program with nothing to
    compute still waits before it returns, so this kernel ends after the previous one."""
    tl.static_assert(PRELOAD == 0 or (EVEN_K and not GATED))
    if PRELOAD == 0:
        wait_for_inputs(PDL)
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    block = pid // n_tiles
    if DIRECT:
        first = block
        rows = tl.where(tl.arange(0, BLOCK_M) == 0, block, A)
    else:  # a padding block (first >= A: this batch routed fewer) takes expert E
        first = tl.load(sorted_ptr + block * BLOCK_M, cache_modifier=".cg")
        rows = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M), cache_modifier=".cg")
    expert = tl.load(ids_ptr + first, mask=first < A, other=E, cache_modifier=".cg").to(tl.int64)
    if expert >= E:
        if PRELOAD > 0:
            wait_for_inputs(PDL)
        return
    valid = rows < A
    if GATED:  # gate / up read the token's hidden state
        src = rows // TOP_K
    else:  # down reads the assignment's activation
        src = rows
    src = tl.where(valid, src, 0).to(tl.int64)
    cols = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + src[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + (cols % N).to(tl.int64)[None, :] * stride_wn \
        + offs_k[:, None]
    row_ok = valid[:, None]  # padding rows load nothing (their outputs are never stored)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PRELOAD > 0:  # the wait is in here (the docstring)
        acc = _preloaded_dots(x_ptrs, w_ptrs, row_ok, acc, PDL, PRELOAD, BLOCK_K, PRECISION)
        x_ptrs += PRELOAD * BLOCK_K
        w_ptrs += PRELOAD * BLOCK_K
    for k in range(PRELOAD * BLOCK_K, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=row_ok, other=0.0)
            b = tl.load(w_ptrs)
        else:
            a = tl.load(x_ptrs, mask=((k + offs_k)[None, :] < K) & row_ok, other=0.0)
            b = tl.load(w_ptrs, mask=(k + offs_k)[:, None] < K, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if GATED:
            if EVEN_K:
                b_up = tl.load(w_ptrs + N * stride_wn)
            else:
                b_up = tl.load(w_ptrs + N * stride_wn, mask=(k + offs_k)[:, None] < K, other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    if GATED:  # activation.py's arithmetic on the rounded gate and up
        g = acc.to(dtype).to(tl.float32)
        if ACCURATE:
            e = libdevice.exp(-g)
        else:
            e = tl.exp(-g)
        silu = tl.div_rn(g, 1.0 + e).to(dtype)
        out = (silu.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
    else:
        out = acc.to(dtype)
    mask = valid[:, None] & (cols < N)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], out, mask=mask)


def moe_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
             sorted_ids: torch.Tensor | None, flat_ids: torch.Tensor, top_k: int, gated: bool,
             cfg: MoeGemmConfig) -> None:
    """Launch step 3 (``gated``: x [T, K], w [E, 2N, K]) or 4 (x [A, K], w [E, N, K]) into
    ``out`` [A, N]. ``sorted_ids`` None: one block per assignment (``DIRECT``)."""
    n, k = out.shape[1], x.shape[1]
    direct, pdl = sorted_ids is None, programmatic(out)
    cfg = _even_block_k(cfg, k)
    even_k = k % cfg.block_k == 0
    preload = cfg.preload if not gated and even_k and k >= cfg.preload * cfg.block_k else 0
    blocks = flat_ids.numel() if direct else sorted_ids.numel() // cfg.block_m
    _moe_gemm_kernel[(blocks * triton.cdiv(n, cfg.block_n),)](
        x, w, out, flat_ids if direct else sorted_ids, flat_ids, flat_ids.numel(), w.shape[0], n, k,
        x.stride(0), w.stride(0), w.stride(1), out.stride(0), TOP_K=top_k, GATED=gated, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=even_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", ACCURATE=ACCURATE_EXP,
        DIRECT=direct, PDL=pdl, PRELOAD=preload, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, enable_fp_fusion=FP_FUSION, launch_pdl=pdl, **_NO_FTZ)


def _even_block_k(cfg: MoeGemmConfig, k: int) -> MoeGemmConfig:
    """``cfg`` with the largest BLOCK_K down to 32 that divides K (unmasked, vectorized loads);
    ``cfg`` if none does. BLOCK_K does not change a bit (the module docstring)."""
    block_k = cfg.block_k
    while k % block_k and block_k > 32:
        block_k //= 2
    return dataclasses.replace(cfg, block_k=block_k) if k % block_k == 0 else cfg


# ---- 5. combine -----------------------------------------------------------------------------
@triton.jit
def _combine_kernel(y_ptr, w_ptr, shared_ptr, scale_ptr, out_ptr, H, TOP_K: tl.constexpr,
                    HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[t] = (sum_j w[t, j] y[t k + j] in rank order + scale[t] shared[t]) in fp32."""
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.load(w_ptr + t * TOP_K) * \
        tl.load(y_ptr + t * TOP_K * H + cols, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, TOP_K):
        acc += tl.load(w_ptr + t * TOP_K + j) * \
            tl.load(y_ptr + (t * TOP_K + j) * H + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SHARED:
        acc += tl.load(scale_ptr + t) * \
            tl.load(shared_ptr + t * H + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None,
            scale: torch.Tensor | None, out: torch.Tensor) -> None:
    t, h = out.shape
    top_k = weights.shape[1]
    has_shared, pdl = shared is not None, programmatic(out)
    _combine_kernel[(t, triton.cdiv(h, COMBINE_BLOCK))](
        y, weights, shared.contiguous() if has_shared else y,
        scale.float().contiguous() if has_shared else weights, out, h, TOP_K=top_k,
        HAS_SHARED=has_shared, BLOCK=COMBINE_BLOCK, PDL=pdl, num_warps=4,
        enable_fp_fusion=False, launch_pdl=pdl)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  shared: torch.Tensor | None, scale: torch.Tensor | None, *,
                  ids: torch.Tensor) -> torch.Tensor:
    """The experts and their combine (steps 2-5) -> [T, H] in x's dtype."""
    flat = ids.reshape(-1).to(torch.int32).contiguous()
    return combined(expert_outputs(x, w13, w2, flat, ids.shape[1]), weights, shared, scale)


def expert_outputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, flat: torch.Tensor,
                   top_k: int, total: int | None = None) -> torch.Tensor:
    """Steps 2-4 for the flat int32 expert ids [T k] of the experts ``w13`` [E', 2I, H] holds
    (id E': another rank's expert, skipped: ``samebits.ops.moe.local_ids``) -> y [T k, H] in x's
    dtype, the skipped rows unspecified. Tiles by the assignments spread over ``total`` experts
    (the model's; default E'), so a rank picks one device's tiles for the same batch."""
    (t, h), experts, a = x.shape, w13.shape[0], flat.numel()
    y = torch.empty(a, h, dtype=x.dtype, device=x.device)
    if not t:
        return y
    x = _unit_stride(x)
    w13, w2 = _unit_stride(w13), _unit_stride(w2)
    spread = total or experts
    hopper = programmatic_device(x)
    up_cfg = pick_config(a, spread, x.dtype, True, hopper)
    down_cfg = pick_config(a, spread, x.dtype, False, hopper)
    assert up_cfg.block_m == down_cfg.block_m  # one layout serves both GEMMs
    sorted_ids = None if a <= DIRECT_MAX else align(flat, experts, up_cfg.block_m)
    act = torch.empty(a, w2.shape[2], dtype=x.dtype, device=x.device)
    moe_gemm(x, w13, act, sorted_ids, flat, top_k, True, up_cfg)
    moe_gemm(act, w2, y, sorted_ids, flat, top_k, False, down_cfg)
    return y


def combined(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None,
             scale: torch.Tensor | None) -> torch.Tensor:
    """Step 5: y [T k, H] -> [T, H] in y's dtype."""
    t = weights.shape[0]
    out = torch.empty(t, y.shape[1], dtype=y.dtype, device=y.device)
    if t:
        combine(y, weights.float().contiguous(), shared, scale, out)
    return out


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
