"""Batch-invariant paged causal attention on CUDA (prefill, chunked prefill and decode, GQA).

Contract (docs/DESIGN.md section 1.1, the arithmetic of reference.py): the query at position p
reduces over KV positions [0, p] in splits of ``split_size`` keys; each split is walked in blocks of
``key_block(split_size)`` keys in ascending order (online softmax from an empty state), and the
split partials are merged in ascending order. At the default split of 128 keys a split *is* one
128-key block: its partial is (row max, dot(p, 1), dot(p, V)) from zero, with no rescaling inside
the split, which is what lets the prefill kernel merge each block's partial at once with one
accumulator less. The bits of a query's output depend only on q, p and the K/V of positions
[0, p] of its own sequence -- never on how many queries of the sequence run this step, on the
batch, or on which physical blocks hold its KV.

Two schedules produce those bits (attention_kernels.py holds the shared arithmetic):

- *split* (flash-decoding): one program per (token, kv head, split) writes the split's fp32
  partial; ``_merge_kernel`` folds them in order. Used for sequences with few queries this step.
- *prefill*: one program per (tile of up to ``block_m`` queries, query head) walks the splits in
  order and merges them in registers. Used for sequences with ``PREFILL_MIN_QUERIES`` or more.

On Hopper (sm_90, 16-bit, head dim 64/128, split 128) both schedules run as Gluon kernels
(attention_gluon.py: TMA page loads, asynchronous wgmma, a warp-specialized prefill) that
reproduce these bits; ``AttentionLaunch.prefill_gluon`` / ``.decode_gluon`` switch them off.

``plan_attention`` builds the index tensors of both once per forward. The kernels are compiled
with ``enable_fp_fusion=False``: no multiply-add is contracted behind our back, so the only fmas
are the explicit ``tl.fma`` of the shared arithmetic, whichever kernel runs it.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton

from samebits.ops.backend import AttentionMetadata
from samebits.ops.pending_merge import PendingMerge
from samebits.ops.triton.attention_kernels import (
    _merge_kernel,
    _merge_scan_kernel,
    _prefill_kernel,
    _split_kernel,
)
from samebits.ops.triton.launcher import programmatic

try:  # Gluon's Hopper API (Triton >= 3.5): the warp-specialized prefill kernel
    from samebits.ops.triton.attention_gluon import (
        _prefill_gluon_kernel,
        _split_gluon_kernel,
        tma_descriptor,
    )
except ImportError:  # pragma: no cover - older Triton: the Triton kernels everywhere
    _prefill_gluon_kernel = _split_gluon_kernel = None

PREFILL_MIN_QUERIES = 16  # sequences with at least this many queries take the prefill kernel
LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class AttentionLaunch:
    """How the kernels are launched: free to tune, never changes the bits (the schedules are
    tested equal; benchmarks/kernels.py sweeps these). A plan carries the one it was built with."""

    split_warps: int = 4
    split_stages: int = 2
    prefill_stages: int | None = None  # None: 3 for 64-query tiles, 2 for 128
    merge_warps: int = 1
    merge_heads: int = 1
    merge_stages: int = 12
    merge_scan: bool | None = None  # None: the prefix-max scan from merge_scan_min_splits on
    merge_scan_min_splits: int = 64
    prefill_gluon: bool = True  # Hopper: the warp-specialized Gluon prefill where it fits
    decode_gluon: bool = True  # Hopper: the Gluon split kernel where it fits

    def __post_init__(self) -> None:
        for name in ("split_warps", "split_stages", "merge_warps", "merge_heads", "merge_stages",
                     "merge_scan_min_splits"):
            if getattr(self, name) <= 0:
                raise ValueError(f"AttentionLaunch.{name} must be positive")


DEFAULT_LAUNCH = AttentionLaunch()


def key_block(split_size: int) -> int:
    """Keys per online-softmax block: part of the arithmetic, a function of split_size alone
    (128 when it divides the split: then a 128-key split is a single block)."""
    for n in (128, 64, 32, 16):
        if split_size % n == 0:
            return n
    raise ValueError(f"attention split_size {split_size} must be a multiple of 16")


@dataclasses.dataclass(frozen=True)
class TritonAttentionPlan:
    dec_seq: torch.Tensor  # [n_dec] int32: sequence of each split-path token
    dec_pos: torch.Tensor  # [n_dec] int32: its position
    dec_row: torch.Tensor  # [n_dec] int32: its row in q / out
    dec_max_splits: int
    tiles: torch.Tensor  # [n_tiles, 4] int32: (seq, first row, count, first position)
    block_m: int
    split_size: int  # KV tokens per split (the invariant backend: always meta.split_size)
    launch: AttentionLaunch = DEFAULT_LAUNCH


def plan(meta: AttentionMetadata, block_m: int | None = None,
         min_prefill: int = PREFILL_MIN_QUERIES, split_size: int | None = None,
         launch: AttentionLaunch = DEFAULT_LAUNCH) -> TritonAttentionPlan:
    """Index tensors for one forward: sequences with ``min_prefill`` or more queries go to the
    prefill kernel, the others (decode, short chunks) to the split kernel."""
    qsl, split = meta.query_start_loc_list, split_size or meta.split_size
    dec_seq, dec_pos, dec_row, spans = [], [], [], []
    for b, seq_len in enumerate(meta.seq_lens_list):
        n = qsl[b + 1] - qsl[b]
        first = seq_len - n
        if n >= min_prefill:
            spans.append((b, qsl[b], n, first))
        else:
            dec_seq += [b] * n
            dec_pos += range(first, seq_len)
            dec_row += range(qsl[b], qsl[b + 1])
    big = (sum(sp[2] for sp in spans) >= 2048
           or launch.prefill_gluon and _gluon_device(meta.seq_lens.device))
    block_m = block_m or (128 if big else 64)
    tiles = [(b, t0 + i, min(block_m, n - i), first + i)
             for b, t0, n, first in spans for i in range(0, n, block_m)]
    tiles.sort(key=lambda tl: -(tl[3] + tl[2]))  # longest first: better load balance
    dev = meta.seq_lens.device

    def ints(v: list) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.int32).to(dev, non_blocking=True)

    return TritonAttentionPlan(
        dec_seq=ints(dec_seq), dec_pos=ints(dec_pos), dec_row=ints(dec_row),
        dec_max_splits=max(dec_pos, default=0) // split + 1,
        tiles=ints(tiles).view(-1, 4), block_m=block_m, split_size=split, launch=launch)


def plan_decode(meta: AttentionMetadata, positions: torch.Tensor, max_splits: int,
                split_size: int | None = None, launch: AttentionLaunch = DEFAULT_LAUNCH
                ) -> TritonAttentionPlan:
    """A pure-decode plan over device tensors the caller owns (CUDA-graph inputs): row i is
    sequence i's one query at ``positions[i]``; the split grid is ``max_splits`` wide (programs
    past a token's last split return at once), so it may be captured once and replayed."""
    n = positions.shape[0]
    rows = torch.arange(n, dtype=torch.int32, device=positions.device)
    return TritonAttentionPlan(
        dec_seq=rows, dec_pos=positions, dec_row=rows, dec_max_splits=max_splits,
        tiles=torch.empty(0, 4, dtype=torch.int32, device=positions.device), block_m=64,
        split_size=split_size or meta.split_size, launch=launch)


def plan_attention(meta: AttentionMetadata) -> AttentionMetadata:
    return dataclasses.replace(meta, plan=plan(meta))


def _planned(meta: AttentionMetadata) -> TritonAttentionPlan:
    """The plan the caller made (``plan_attention``), or one made now."""
    return meta.plan if isinstance(meta.plan, TritonAttentionPlan) else plan(meta)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None
              ) -> torch.Tensor:
    """q [T, Hq, D] over the paged cache [num_blocks, block_size, Hkv, D] -> [T, Hq, D] (``out``,
    contiguous, when given)."""
    p = _planned(meta)
    out = torch.empty_like(q) if out is None else out
    decode(q, k_cache, v_cache, meta, p, scale, out)
    prefill(q, k_cache, v_cache, meta, p, scale, out)
    return out


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    d = q.shape[-1]
    if d < 16 or d & (d - 1):
        raise NotImplementedError(f"triton attention: head dim {d} is not a power of two >= 16")
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(-1) == 1


def _common(q: torch.Tensor, meta: AttentionMetadata, p: TritonAttentionPlan) -> dict:
    return dict(D=q.shape[-1], BS=meta.block_size, SPLIT=p.split_size,
                BLOCK_N=key_block(p.split_size),
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32")


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
           p: TritonAttentionPlan, scale: float, out: torch.Tensor) -> None:
    """Rows ``p.dec_row`` of ``out``: the split kernel, then the merge kernel (flash-decoding)."""
    if not p.dec_row.shape[0]:
        return
    c = scale * LOG2E
    _merge(*_split(q, k_cache, v_cache, meta, p, c), p, c, out)


def attention_deferred(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float, max_splits: int
                       ) -> torch.Tensor | PendingMerge:
    """``attention`` of one decode token of at most ``max_splits`` splits, its merge left to
    the consumer (``PendingMerge``); anything else: ``attention``."""
    p = _planned(meta)
    if p.tiles.shape[0] or p.dec_row.shape[0] != 1 or p.dec_max_splits > max_splits:
        return attention(q, k_cache, v_cache, meta, scale)
    c = scale * LOG2E
    part_acc, part_ml = _split(q, k_cache, v_cache, meta, p, c)

    def merge() -> torch.Tensor:
        out = torch.empty_like(q)
        _merge(part_acc, part_ml, p, c, out)
        return out.view(1, -1)

    return PendingMerge(part_acc, part_ml, p.dec_pos, p.split_size, c, q.dtype, merge)


def _split(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           meta: AttentionMetadata, p: TritonAttentionPlan, c: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernel's partials (part_acc [n, Hq, S, D], part_ml [n, Hq, S, 2], fp32) of the
    rows ``p.dec_row``; ``c``: the softmax scale * log2(e)."""
    _check(q, k_cache, v_cache)
    n_dec = p.dec_row.shape[0]
    hq, d, hkv = q.shape[1], q.shape[2], k_cache.shape[2]
    bt, la = meta.block_tables, p.launch
    part_acc = q.new_empty(n_dec, hq, p.dec_max_splits, d, dtype=torch.float32)
    part_ml = q.new_empty(n_dec, hq, p.dec_max_splits, 2, dtype=torch.float32)
    rows = max(16, triton.next_power_of_2(hq // hkv))
    pdl = dict(PDL=programmatic(q), launch_pdl=programmatic(q))
    if _gluon_decode_fits(q, meta, p, hq // hkv):
        k_desc, v_desc = _kv_descs(k_cache, v_cache, meta.block_size)
        _split_gluon_kernel[(n_dec, hkv, p.dec_max_splits)](
            q, k_desc, v_desc, bt, p.dec_seq, p.dec_pos, p.dec_row, part_acc, part_ml,
            q.stride(0), q.stride(1), bt.stride(0), hq * p.dec_max_splits, p.dec_max_splits,
            k_cache.shape[0] * meta.block_size, c, G=hq // hkv, ROWS=rows, D=d, BLOCK_N=128,
            num_warps=4, enable_fp_fusion=False, **pdl)
    else:
        _split_kernel[(n_dec, hkv, p.dec_max_splits)](
            q, k_cache, v_cache, bt, p.dec_seq, p.dec_pos, p.dec_row, part_acc, part_ml,
            q.stride(0), q.stride(1), bt.stride(0), k_cache.stride(1), hq * p.dec_max_splits,
            p.dec_max_splits, c, G=hq // hkv, ROWS=rows, **_common(q, meta, p),
            num_warps=la.split_warps, num_stages=la.split_stages, enable_fp_fusion=False, **pdl)
    return part_acc, part_ml


def _merge(part_acc: torch.Tensor, part_ml: torch.Tensor, p: TritonAttentionPlan, c: float,
           out: torch.Tensor) -> None:
    """Rows ``p.dec_row`` of ``out`` from the split partials: the merge kernel (or, with many
    splits, the scan kernel: the same bits)."""
    n_dec, hq, max_splits, d = part_acc.shape
    la = p.launch
    stages = max(2, min(la.merge_stages, max_splits))
    pdl = dict(PDL=programmatic(part_acc), launch_pdl=programmatic(part_acc))
    scan = la.merge_scan
    if scan is None:  # measured (H100): the scan wins from ~64 splits, loses a little below
        scan = max_splits >= la.merge_scan_min_splits
    if scan:
        part_a = torch.empty_like(part_ml)
        _merge_scan_kernel[(n_dec, hq)](
            part_acc, part_ml, part_a, p.dec_pos, p.dec_row, out, hq * max_splits,
            max_splits, out.stride(0), out.stride(1), c, D=d, SPLIT=p.split_size,
            NS=triton.next_power_of_2(max_splits), STAGES=stages,
            num_warps=la.merge_warps, enable_fp_fusion=False, **pdl)
    else:
        hb = la.merge_heads
        _merge_kernel[(n_dec, triton.cdiv(hq, hb))](
            part_acc, part_ml, p.dec_pos, p.dec_row, out, hq * max_splits,
            max_splits, out.stride(0), out.stride(1), c, hq, HB=hb, D=d,
            SPLIT=p.split_size, STAGES=stages,
            num_warps=la.merge_warps, enable_fp_fusion=False, **pdl)


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: AttentionMetadata, p: TritonAttentionPlan, scale: float, out: torch.Tensor
            ) -> None:
    """The query tiles ``p.tiles`` of ``out``: the prefill kernel."""
    n_tiles = p.tiles.shape[0]
    if not n_tiles:
        return
    _check(q, k_cache, v_cache)
    if _gluon_fits(q, meta, p):
        _prefill_gluon(q, k_cache, v_cache, meta, p, scale, out)
        return
    hq, hkv, bt = q.shape[1], k_cache.shape[2], meta.block_tables
    _prefill_kernel[(hq, n_tiles)](
        q, k_cache, v_cache, bt, p.tiles, out, q.stride(0), q.stride(1), bt.stride(0),
        k_cache.stride(1), out.stride(0), out.stride(1), scale * LOG2E, G=hq // hkv,
        BLOCK_M=p.block_m, **_common(q, meta, p),
        num_warps=4 if p.block_m <= 64 else 8,
        num_stages=p.launch.prefill_stages or (3 if p.block_m <= 64 else 2),
        enable_fp_fusion=False)


def _gluon_device(dev: torch.device) -> bool:
    """Gluon's Hopper kernels can run on ``dev`` (the choice of kernel never changes the bits)."""
    return _prefill_gluon_kernel is not None and dev.type == "cuda" and _is_sm90(dev.index)


@functools.cache
def _is_sm90(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def _gluon_fits(q: torch.Tensor, meta: AttentionMetadata, p: TritonAttentionPlan) -> bool:
    """The Gluon prefill kernel covers the engine's case on Hopper: 16-bit dtypes, head dim 64
    or 128, one 128-key block per split, 128-query tiles, pages of at most 128 keys."""
    return (p.launch.prefill_gluon and _gluon_common(q, meta, p) and p.block_m == 128
            and q.stride(1) == q.shape[-1])


def _gluon_decode_fits(q: torch.Tensor, meta: AttentionMetadata, p: TritonAttentionPlan,
                       g: int) -> bool:
    """The Gluon split kernel: the same case (up to 64 query heads per kv head)."""
    return p.launch.decode_gluon and _gluon_common(q, meta, p) and g <= 64


def _gluon_common(q: torch.Tensor, meta: AttentionMetadata, p: TritonAttentionPlan) -> bool:
    return (_gluon_device(q.device) and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[-1] in (64, 128) and p.split_size == key_block(p.split_size) == 128
            and 128 % meta.block_size == 0)


def _kv_descs(k_cache: torch.Tensor, v_cache: torch.Tensor, bs: int):
    """TMA descriptors over the caches viewed as [slots, Hkv*D], one page of one head a box."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k2, v2 = k_cache.view(-1, hkv * d), v_cache.view(-1, hkv * d)
    return tma_descriptor(k2, [bs, d]), tma_descriptor(v2, [bs, d])


def _prefill_gluon(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata, p: TritonAttentionPlan, scale: float,
                   out: torch.Tensor) -> None:
    """``_prefill_kernel``'s bits through attention_gluon.py: a TMA descriptor over q viewed as
    [T, Hq*D] (tiles of 128 rows) and ``_kv_descs``."""
    t, hq, d = q.shape
    q_desc = tma_descriptor(q.as_strided((t, hq * d), (q.stride(0), 1)), [p.block_m, d])
    k_desc, v_desc = _kv_descs(k_cache, v_cache, meta.block_size)
    bt, hkv = meta.block_tables, k_cache.shape[2]
    _prefill_gluon_kernel[(hq, p.tiles.shape[0])](
        q_desc, k_desc, v_desc, bt, p.tiles, out, bt.stride(0), out.stride(0), out.stride(1),
        k_cache.shape[0] * meta.block_size, scale * LOG2E, G=hq // hkv, D=d,
        BLOCK_M=p.block_m, BLOCK_N=128, num_warps=4, enable_fp_fusion=False)
