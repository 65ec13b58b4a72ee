"""The mixture of experts at decode sizes on CUDA: two launches per sparse layer, the bits of
``samebits.ops.triton.moe``'s five (route, the direct layout, gate/up GEMM, down GEMM, combine).

For T k <= ``moe.DIRECT_MAX`` assignments (each its own block, the direct layout):

1. ``routed_gate_up``: ``moe._moe_gemm_kernel`` with ROUTE, program (assignment, N-tile) -- the
   token's softmax / top-k / renormalization by ``moe._route_row`` (the route kernel's code,
   warps and compile options), its rank's expert's gate/up and ``silu(gate) * up``; the ids and
   weights written as ``moe.route`` writes them.
2. ``_down_combine_kernel``, program (token, N-tile): for each rank j in order, the expert's down
   tile exactly as the down GEMM computes it (one ascending-K ``tl.dot`` from zero, the down
   GEMM's BLOCK_K and input precision, rounded to the dtype), summed as ``moe._combine_kernel``
   sums: fp32 ``w_0 y_0``, ``+ w_j y_j``, ``+ scale shared``, each product and sum rounded on its
   own, cast once. One loop over (rank, K tile), so the k experts' weights stream through one
   software pipeline; BLOCK_N follows T so that about ``DECODE_PROGRAMS`` programs run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from samebits.ops.triton import moe
from samebits.ops.triton.activation import ACCURATE_EXP, FP_FUSION
from samebits.ops.triton.launcher import programmatic, wait_for_inputs

DECODE_PROGRAMS = 128  # programs the down+combine kernel aims for (an H100 has 132 SMs)
DOWN_COMBINE_STAGES = 6  # num_stages of its one (rank, K tile) loop, where Triton pipelines it
# libdevice's mul_rn / add_rn, which no compiler contracts into an fma; the interpreter has no
# libdevice (and numpy never contracts)
EXPLICIT_RN = ACCURATE_EXP


def routed_gate_up(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, act: torch.Tensor,
                   weights: torch.Tensor, ids: torch.Tensor, renormalize: bool,
                   round_weights: bool, cfg: moe.MoeGemmConfig) -> None:
    """Route and gate/up in one launch, in the direct layout (``act`` [T k, I], T k <=
    ``moe.DIRECT_MAX``): each program routes its token (``moe._route_row``) and computes its
    rank's expert's gate/up; ``weights`` [T, k] fp32 and ``ids`` [T, k] int32 are written as
    ``moe.route`` writes them."""
    (a, n), (e, k), top_k = act.shape, (logits.shape[1], x.shape[1]), ids.shape[1]
    sorted_ids, pdl = moe.direct_layout(a, cfg.block_m, x.device), programmatic(act)
    moe._moe_gemm_kernel[(a * triton.cdiv(n, cfg.block_n),)](
        x, w13, act, sorted_ids, ids, a, n, k, x.stride(0), w13.stride(0), w13.stride(1),
        act.stride(0), logits, weights, e, logits.stride(0), GATED=True, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0,
        PRECISION=moe.dot_precision(x), ACCURATE=ACCURATE_EXP, ROUTE=True,
        **moe.route_meta(e, top_k), RENORM=renormalize, ROUND=round_weights, PDL=pdl,
        num_warps=moe.ROUTE_WARPS, num_stages=cfg.num_stages, enable_fp_fusion=FP_FUSION,
        launch_pdl=pdl, **moe._NO_FTZ)


@triton.jit
def _down_combine_kernel(act_ptr, w_ptr, ids_ptr, wt_ptr, shared_ptr, scale_ptr, out_ptr, N, K,
                         stride_am, stride_we, stride_wn, stride_om, TOP_K: tl.constexpr,
                         HAS_SHARED: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                         PRECISION: tl.constexpr, RN: tl.constexpr, PDL: tl.constexpr):
    """out[t, n] for program (t, N-tile): for j = 0 .. k-1 in rank order, y_j = act[t k + j] .
    w[ids[t, j], n] as ``_moe_gemm_kernel`` (not gated) computes it (one ascending-K dot from
    zero, BLOCK_K the down GEMM's, rounded to the output dtype), accumulated as
    ``_combine_kernel`` does: fp32 ``w_0 y_0``, then ``+ w_j y_j``, then ``+ scale shared``,
    every product and sum rounded on its own (RN: explicit round-to-nearest ops, which no
    compiler contracts into an fma; the dot keeps the GEMM's compile options), cast once.
    One loop over (expert, K tile): the k experts' weight tiles stream through one pipeline."""
    wait_for_inputs(PDL)
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    t = (pid // n_tiles).to(tl.int64)
    cols = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m, offs_k = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_K)
    k_tiles = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    comb = tl.full([BLOCK_M, BLOCK_N], -0.0, tl.float32)  # -0 + p == p: w_0 y_0's bits
    for i in range(0, TOP_K * k_tiles):
        j = i // k_tiles
        k0 = (i - j * k_tiles) * BLOCK_K
        kk = k0 + offs_k
        a = t * TOP_K + j
        expert = tl.load(ids_ptr + a).to(tl.int64)
        x_ptrs = act_ptr + a * stride_am + offs_m[:, None] * 0 + kk[None, :]
        w_ptrs = w_ptr + expert * stride_we + (cols % N).to(tl.int64)[None, :] * stride_wn \
            + kk[:, None]
        if EVEN_K:
            x = tl.load(x_ptrs, mask=(offs_m == 0)[:, None], other=0.0)
            b = tl.load(w_ptrs)
        else:
            x = tl.load(x_ptrs, mask=(offs_m == 0)[:, None] & (kk < K)[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=(kk < K)[:, None], other=0.0)
        acc = tl.where(k0 == 0, 0.0, acc)  # each expert's dot starts from zero
        acc = tl.dot(x, b, acc, input_precision=PRECISION)
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        comb = tl.where(k0 + BLOCK_K >= K, _add(comb, _mul(tl.load(wt_ptr + a), y, RN), RN),
                        comb)
    if HAS_SHARED:
        shared = tl.load(shared_ptr + t * N + cols, mask=cols < N, other=0.0).to(tl.float32)
        comb = _add(comb, _mul(tl.load(scale_ptr + t), shared[None, :], RN), RN)
    mask = (offs_m == 0)[:, None] & (cols < N)[None, :]
    tl.store(out_ptr + t * stride_om + offs_m[:, None] * 0 + cols[None, :],
             comb.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mul(a, b, RN: tl.constexpr):
    if RN:
        return libdevice.mul_rn(a, b)
    return a * b


@triton.jit
def _add(a, b, RN: tl.constexpr):
    if RN:
        return libdevice.add_rn(a, b)
    return a + b


def down_combine(act: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 shared: torch.Tensor | None, scale: torch.Tensor | None, out: torch.Tensor
                 ) -> None:
    """Steps 4 and 5 in one launch for the direct layout: ``out`` [T, H] from ``act`` [T k, I]
    (rows in (token, rank) order), the bits of ``moe_gemm`` (not gated) then ``combine``."""
    (t, h), (a, inter), top_k = out.shape, act.shape, ids.shape[1]
    cfg = moe.pick_config(a, w2.shape[0], act.dtype, False)
    block_n = decode_block_n(t, h, act.dtype)
    has_shared, pdl = shared is not None, programmatic(out)
    _down_combine_kernel[(t * triton.cdiv(h, block_n),)](
        act, w2, ids, weights, shared.contiguous() if has_shared else act,
        scale.float().contiguous() if has_shared else weights, out, h, inter, act.stride(0),
        w2.stride(0), w2.stride(1), out.stride(0), TOP_K=top_k, HAS_SHARED=has_shared,
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k,
        EVEN_K=inter % cfg.block_k == 0, PRECISION=moe.dot_precision(act), RN=EXPLICIT_RN, PDL=pdl,
        num_warps=4, num_stages=DOWN_COMBINE_STAGES, enable_fp_fusion=FP_FUSION,
        launch_pdl=pdl, **moe._NO_FTZ)


def decode_block_n(tokens: int, hidden: int, dtype: torch.dtype) -> int:
    """The down+combine kernel's N tile: the widest (<= 128, fp32 <= 32) that still gives
    ``DECODE_PROGRAMS`` programs (free to vary: a tile does not change a dot's bits)."""
    widest = 32 if dtype == torch.float32 else 128
    block = 16
    while block < widest and tokens * hidden // (2 * block) >= DECODE_PROGRAMS:
        block *= 2
    return block


def decode_experts(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   top_k: int, renormalize: bool, round_weights: bool,
                   shared: torch.Tensor | None, scale: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``route`` then ``fused_experts`` in two launches, for T k <= ``DIRECT_MAX`` (decode):
    (out [T, H] in x's dtype, weights fp32 [T, k], ids int32 [T, k]), the same bits."""
    (t, h), experts = x.shape, w13.shape[0]
    a = t * top_k
    if a > moe.DIRECT_MAX:
        raise ValueError(f"decode_experts: {t} tokens x top-{top_k} = {a} assignments > "
                         f"DIRECT_MAX = {moe.DIRECT_MAX}")
    x, logits = moe.unit_stride(x), moe.unit_stride(logits)
    w13, w2 = moe.unit_stride(w13), moe.unit_stride(w2)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=x.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    if t:
        act = torch.empty(a, w2.shape[2], dtype=x.dtype, device=x.device)
        routed_gate_up(x, logits, w13, act, weights, ids, renormalize, round_weights,
                       moe.pick_config(a, experts, x.dtype, True))
        down_combine(act, w2, ids, weights, shared, scale, out)
    return out, weights, ids
