"""Settings for ``decode_variants.py`` that bound or probe batch-1 decode (not engine code).

Bounds remove kernels and so give WRONG outputs on purpose: the step time without them is the
most any fusion of them could save. Probes change only speed (the tokens stay the same):

    A="__import__('decode_ablations')"
    python benchmarks/decode_variants.py \
        --variant "no router+route" "samebits.models.moe:SparseMoeBlock.forward=$A.forward_no_route" \
        --variant "no combine" "samebits.ops.triton.moe:combine=$A.noop" \
        --variant "no merge" "samebits.ops.triton.attention:_merge_kernel=$A.noop_kernel;\
samebits.ops.triton.attention:_merge_scan_kernel=$A.noop_kernel" \
        --variant "o_proj BN32" "samebits.ops.triton.linear_tiles:pick_config=$A.gemv_tile(32)" \
        --variant "gate/up BN16" "samebits.ops.triton.moe:pick_config=$A.expert_tiles(16, 64)" \
        --variant "no down preload" "samebits.ops.triton.moe:pick_config=$A.expert_tiles(32, 64, preload=0)" \
        --variant "o_proj weights into L2 during attention" \
            "samebits.models.llama:Attention.forward=$A.attention_prefetching;\
decode_ablations:PREFETCH=$A.modes(False, None)"

(``benchmarks`` is on ``sys.path`` when ``decode_variants.py`` runs.) ``PREFETCH``: per weight,
None (off), True (the prefetch kernel waits for the previous kernel first) or False (it asks
L2 at once, then waits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from samebits.models.llama import DecoderLayer
from samebits.ops.moe import fused_experts
from samebits.ops.triton import linear_tiles
from samebits.ops.triton import moe as triton_moe
from samebits.ops.triton.launcher import programmatic
from samebits.ops.triton.linear_kernels import _prefetch_rows

_FIXED: dict = {}


def forward_no_route(self, ops, h: torch.Tensor) -> torch.Tensor:
    """``SparseMoeBlock.forward`` without the router's GEMV and the route (fixed experts)."""
    e = self.local_experts
    key = (h.shape[0], self.moe.top_k, e, h.device)
    if key not in _FIXED:  # made at the warm-up, before any capture
        t, k = key[:2]
        ids = (torch.arange(t * k, device=h.device) * 7 % e).view(t, k).to(torch.int32)
        _FIXED[key] = (torch.full((t, k), 1.0 / k, device=h.device), ids)
    w13 = self.experts_gate_up.view(e, -1, h.shape[-1])
    w2 = self.experts_down.view(e, h.shape[-1], -1)
    return fused_experts(ops, h, w13, w2, *_FIXED[key], None, None)


def noop(*args, **kwargs) -> None:
    return None


class _NoLaunch:
    def __getitem__(self, grid):
        return noop


noop_kernel = _NoLaunch()  # stands in for a ``kernel[grid](...)`` launch


def gemv_tile(block_n: int, block_k: int = 256, stages: int = 4):
    """``pick_config`` with BLOCK_N-column pointer / split tiles for 16-bit products of up to 8
    rows that the one-segment TMA kernel does not take. Set it on ``linear_tiles`` for segmented
    products (``segmented_config`` calls it there: o_proj's and down_proj's two chains), on
    ``linear`` (which imported the name) for one-segment ones."""
    base = linear_tiles.pick_config

    def pick(m, n, k, dtype, plain_tma=False):
        if dtype != torch.float32 and m <= 8 and 256 < n < 24576 and not plain_tma:
            return linear_tiles.GemmConfig(16, block_n, block_k, 4, stages,
                                           prefetch=linear_tiles.PREFETCH)
        return base(m, n, k, dtype, plain_tma)
    return pick


def expert_tiles(gated_n: int, down_n: int, block_k: int = 256, stages: int = 3,
                 preload: int = 2, warps: int = 4):
    """moe's ``pick_config`` with other decode tiles (gate/up, down: ``preload`` of the down
    GEMM's K tiles loaded before its wait, 0-2); the defaults are the batch-1 tiles'."""
    base = triton_moe.pick_config

    def pick(a, e, dtype, gated, hopper=True):
        if dtype != torch.float32 and a / max(1, min(a, e)) <= 16:
            return triton_moe.MoeGemmConfig(16, gated_n if gated else down_n, block_k, warps,
                                            stages, 0 if gated else preload)
        return base(a, e, dtype, gated, hopper)
    return pick


# ---- dense weights asked of L2 while a layer's small kernels run ----------------------------
THREADS, CHUNK = 128, 1024  # a program asks for THREADS x CHUNK bytes: whole weight rows
PREFETCH = {"o_proj": None, "qkv": None}
_LAYER_FORWARD = DecoderLayer.forward


@triton.jit
def _l2_prefetch_kernel(w_ptr, N, K, ROWS: tl.constexpr, BYTES: tl.constexpr,
                        THREADS: tl.constexpr, WAIT_FIRST: tl.constexpr):
    """Program p asks L2 for rows [p ROWS, (p + 1) ROWS) of the [N, K] weight (linear_kernels'
    ``_prefetch_rows``), before or after waiting for the previous kernel (it reads nothing)."""
    if WAIT_FIRST:
        gdc_wait()
        gdc_launch_dependents()
    _prefetch_rows(w_ptr, tl.program_id(0) * ROWS, N, K, K, ROWS, BYTES, THREADS)
    if not WAIT_FIRST:
        gdc_launch_dependents()
        gdc_wait()


def modes(o_proj: bool | None, qkv: bool | None) -> dict:
    return {"o_proj": o_proj, "qkv": qkv}


def _prefetch(w: torch.Tensor, wait_first: bool | None) -> None:
    """Ask L2 for the contiguous 2-D weight ``w`` (rows a whole divisor of THREADS x CHUNK)."""
    if wait_first is None or not programmatic(w):
        return
    n, k = w.shape
    rows = THREADS * CHUNK // (k * w.element_size())
    _l2_prefetch_kernel[(triton.cdiv(n, rows),)](w, n, k, ROWS=rows, BYTES=THREADS * CHUNK,
                                                 THREADS=THREADS, WAIT_FIRST=wait_first,
                                                 num_warps=4, launch_pdl=True)


def attention_prefetching(self, ops, h, cos, sin, kv_cache, meta):
    """``Attention.forward`` with o_proj's weights asked of L2 after the rope kernel (the one
    place a wrapper cannot reach: between two of its ops)."""
    t = h.shape[0]
    q = ops.qkv_rope_store(self.qkv_proj(ops, h), cos, sin, self.q_norm, self.k_norm, self.eps,
                           kv_cache[0], kv_cache[1], meta.slot_mapping, self.hq, self.hkv,
                           self.d)
    if t <= 16:  # decode steps
        _prefetch(self.o_proj.weight, PREFETCH["o_proj"])
    o = ops.attention(q, kv_cache[0], kv_cache[1], meta, self.d ** -0.5)
    return self.o_proj(ops, o.reshape(t, self.hq * self.d))


def layer_prefetching(self, ops, h, *args):
    """``DecoderLayer.forward`` after asking L2 for qkv's weights (before the input norm)."""
    if h.shape[0] <= 16:  # decode steps
        _prefetch(self.self_attn.qkv_proj.weight, PREFETCH["qkv"])
    return _LAYER_FORWARD(self, ops, h, *args)
