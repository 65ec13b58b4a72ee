"""The CPU batch-invariant backend: every output element has one fixed reduction order.

- ``linear``: each output element is one fma chain over K in ascending order (the C++ kernel of
  ``cpu_kernels``), whatever the number of rows, their position or the thread count. With
  ``k_bounds`` (segmented K, ``samebits.ops.backend``): the chain restarts from zero at every
  segment boundary and the fp32 partials are added in ``tree_sum``'s balanced tree order, in the
  kernel.
  ``linear_partials`` (a tensor-parallel rank's partials) runs one call per segment on its
  contiguous slice (the weight's K slices packed once and kept): the same partials.
- ``silu_mul`` with ``k_bounds``: one SiLU call per down_proj K segment (a rank's shapes).
- row reductions (RMSNorm, softmax, log_softmax) run tile by tile on ``[TILE_M, H]`` blocks, so the
  library underneath always sees one problem shape.
- ``split_attention`` (decoder and encoder alike): each (query, head) reduces its keys in splits of
  ``split_size`` keys, read straight from the paged cache in ascending order, splits merged in
  ascending order (the C++ file states the exact operations). Prefill, chunked prefill and decode
  run this one function, so they give the same bits.

Guarantee: a row's bits depend on its own inputs, the weights and these constants alone.
The kernels compute in float32 (float64 inputs in float64); other dtypes are cast in and out.
"""

from __future__ import annotations

import dataclasses

import torch

from samebits.ops import cpu_kernels, rope
from samebits.ops.backend import (
    AttentionMetadata,
    KBounds,
    NothingDeferred,
    check_k_bounds,
    check_sum_outs,
    every_segment,
    into_sum_outs,
    norm_with_residual,
    register,
    sum_tree,
)
from samebits.ops.encoder import ENCODER_SPLIT_SIZE, InvariantEncoderOps, SeqLayout
from samebits.ops.tiles import TILE_M, by_tiles, silu_mul_rows


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           k_bounds: KBounds | None = None) -> torch.Tensor:
    *lead, k = x.shape
    n, cdt = w.shape[0], _compute_dtype(x.dtype)
    x2 = x.reshape(-1, k).to(cdt).contiguous()
    edges = None
    if k_bounds is not None:
        check_k_bounds(k_bounds, k)
        edges = [lo for lo, _ in k_bounds] + [k]
    out = cpu_kernels.linear(x2, cpu_kernels.packed(w, cdt), n, edges)
    out = out.to(x.dtype)
    if b is not None:
        out = out + b
    return out.reshape(*lead, n)


def linear_partials(x: torch.Tensor, w: torch.Tensor, k_bounds: KBounds) -> torch.Tensor:
    """[S, ..., N]: segment s's product, one ascending fma chain over its columns, from zero."""
    *lead, k = x.shape
    x2 = x.reshape(-1, k).to(_compute_dtype(x.dtype)).contiguous()
    return _partials(x2, w, k_bounds).reshape(len(k_bounds), *lead, w.shape[0])


def linear_sum(x: torch.Tensor, w: torch.Tensor, k_bounds: KBounds,
               out: torch.Tensor | None = None, peer_out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """[..., N] in the compute dtype, uncast: the segments' chains tree-summed in the kernel
    (``linear``'s segmented sum; the bits of ``tree_sum(linear_partials(...))``); copied into
    ``out`` and ``peer_out`` when given (``check_sum_outs``)."""
    *lead, k = x.shape
    n, cdt = w.shape[0], _compute_dtype(x.dtype)
    check_k_bounds(k_bounds, k)
    check_sum_outs(x, n, cdt, out, peer_out)
    x2 = x.reshape(-1, k).to(cdt).contiguous()
    total = cpu_kernels.linear(x2, cpu_kernels.packed(w, cdt), n,
                               [lo for lo, _ in k_bounds] + [k]).reshape(*lead, n)
    return into_sum_outs(total, out, peer_out)


def _partials(x2: torch.Tensor, w: torch.Tensor, k_bounds: KBounds) -> torch.Tensor:
    """x2 [M, K] contiguous in the compute dtype -> [S, M, N]."""
    packs, n = _packed_segments(w, x2.dtype, k_bounds), w.shape[0]
    return torch.stack([cpu_kernels.linear(x2[:, lo:hi].contiguous(), wp, n)
                        for (lo, hi), wp in zip(k_bounds, packs, strict=True)])


_SEGMENT_PACKS = "_samebits_packed_segments"  # the attribute ``_packed_segments`` keeps on w


def _packed_segments(w: torch.Tensor, dtype: torch.dtype, k_bounds: KBounds
                     ) -> tuple[torch.Tensor, ...]:
    """Each K segment's columns of ``w``, packed; kept on ``w`` as ``cpu_kernels.packed`` keeps
    its pack (same storage, same version, same dtype and bounds)."""
    try:
        key = (w.data_ptr(), w._version, dtype, k_bounds)
    except RuntimeError:  # an inference tensor has no version counter: pack afresh
        key = None
    cached = getattr(w, _SEGMENT_PACKS, None)
    if key is not None and cached is not None and cached[0] == key:
        return cached[1]
    check_k_bounds(k_bounds, w.shape[1])
    packs = tuple(cpu_kernels.pack_weight(w[:, lo:hi].to(dtype)) for lo, hi in k_bounds)
    if key is not None:
        setattr(w, _SEGMENT_PACKS, (key, packs))
    return packs


def silu_mul(gate: torch.Tensor, up: torch.Tensor, k_bounds: KBounds | None = None
             ) -> torch.Tensor:
    """SiLU(gate) * up, one call per K segment of down_proj on that segment's columns: the
    shapes a tensor-parallel rank sees (torch's CPU SiLU rounds the scalar tail of a row
    differently from its vector body, so the row length must match), each in single-threaded
    row blocks (``silu_mul_rows``: no thread's share starts inside a row, whatever T is)."""
    if k_bounds is None:
        return silu_mul_rows(gate, up)
    return torch.cat([silu_mul_rows(gate[..., lo:hi], up[..., lo:hi]) for lo, hi in k_bounds],
                     dim=-1)


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    def tile(t: torch.Tensor) -> torch.Tensor:
        h = t.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(t.dtype)
    return by_tiles(tile, x)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Tile by tile; with ``residual``: the add, then the norm of the sum (and the sum)."""
    return norm_with_residual(_rms_norm, x, w, eps, residual)


def qkv_rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   hq: int, hkv: int, d: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The composition (``samebits.ops.rope``) over the tiled RMSNorm."""
    return rope.qkv_rope_store(_rms_norm, qkv, cos, sin, q_norm, k_norm, eps, k_cache, v_cache,
                               slot_mapping, hq, hkv, d, out)


def softmax(x: torch.Tensor) -> torch.Tensor:
    return by_tiles(lambda t: torch.softmax(t, dim=-1), x)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    return by_tiles(lambda t: torch.log_softmax(t, dim=-1), x)


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """Which keys each query row reads: keys [0, q_nkeys[t]) of sequence q_seq[t], key j of
    sequence b in slot ``block_tables[b, j // block_size] * block_size + j % block_size``."""

    block_tables: torch.Tensor  # [B, max_blocks] int32, contiguous
    q_seq: torch.Tensor  # [T] int32
    q_nkeys: torch.Tensor  # [T] int32 (0: a padding row, output zeros)


def split_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: SplitPlan,
                    scale: float, split: int) -> torch.Tensor:
    """q [T, Hq, D] over caches [blocks, block_size, Hkv, D] -> [T, Hq, D] (the one CPU split
    attention)."""
    cdt = _compute_dtype(q.dtype)
    out = cpu_kernels.attention(q.to(cdt).contiguous(), k_cache.to(cdt).contiguous(),
                                v_cache.to(cdt).contiguous(), plan.block_tables, plan.q_seq,
                                plan.q_nkeys, scale, split)
    return out.to(q.dtype)


def _plan(meta: AttentionMetadata) -> SplitPlan:
    """Causal: the i-th of a sequence's n queries sits at position seq_len - n + i."""
    qsl, seq, nkeys = meta.query_start_loc_list, [], []
    for b, seq_len in enumerate(meta.seq_lens_list):
        n = qsl[b + 1] - qsl[b]
        seq.extend([b] * n)
        nkeys.extend(range(seq_len - n + 1, seq_len + 1))
    return SplitPlan(meta.block_tables.to(torch.int32).contiguous(),
                     torch.tensor(seq, dtype=torch.int32), torch.tensor(nkeys, dtype=torch.int32))


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None
              ) -> torch.Tensor:
    """Causal paged split attention (into ``out`` when given); see the module docstring."""
    plan = meta.plan if isinstance(meta.plan, SplitPlan) else _plan(meta)
    o = split_attention(q, k_cache, v_cache, plan, scale, meta.split_size)
    return o if out is None else out.copy_(o)


def _encoder_plan(layout: SeqLayout) -> SplitPlan:
    """Row r of sequence b reads all of b's keys (none for padding rows); the flat rows serve as a
    cache of one-token blocks, sequence b's key j in row ``starts[b] + j``."""
    width = max(layout.lens)
    j = torch.arange(width)
    starts, lens = torch.tensor(layout.starts), torch.tensor(layout.lens)
    tables = torch.where(j[None, :] < lens[:, None], starts[:, None] + j[None, :], 0)
    q_seq = torch.zeros(layout.num_rows, dtype=torch.int32)
    q_nkeys = torch.zeros(layout.num_rows, dtype=torch.int32)
    for b, (start, n) in enumerate(zip(layout.starts, layout.lens, strict=True)):
        q_seq[start:start + n], q_nkeys[start:start + n] = b, n
    return SplitPlan(tables.to(torch.int32).contiguous(), q_seq, q_nkeys)


def plan_encoder(lens: list[int], device: torch.device) -> SeqLayout:
    """Packed back to back, with the split plan of ``encoder_attention``."""
    layout = SeqLayout.packed(lens)
    return dataclasses.replace(layout, plan=_encoder_plan(layout))


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SeqLayout,
                      scale: float) -> torch.Tensor:
    """The split attention without the causal mask: every query of a sequence reads all of its
    sequence's keys, in splits of ``ENCODER_SPLIT_SIZE`` keys merged in ascending order."""
    plan = layout.plan if isinstance(layout.plan, SplitPlan) else _encoder_plan(layout)
    t, heads, d = k.shape
    return split_attention(q, k.reshape(t, 1, heads, d), v.reshape(t, 1, heads, d), plan, scale,
                           ENCODER_SPLIT_SIZE)


@register("cpu", True)
class ReferenceBackend(InvariantEncoderOps, NothingDeferred):
    # the constants that decide the bits enter the CPU fingerprint through this name
    name = f"reference-cpu|tile_m={TILE_M}|{cpu_kernels.ARITHMETIC}"
    batch_invariant = True
    row_parallel_chains = staticmethod(every_segment)  # the C++ chain restarts for free
    sums_in_norm = False
    partials_into_norm_rows = 0

    linear = staticmethod(linear)
    linear_partials = staticmethod(linear_partials)
    linear_sum = staticmethod(linear_sum)
    sum_tree = staticmethod(sum_tree)
    silu_mul = staticmethod(silu_mul)
    rms_norm = staticmethod(rms_norm)
    qkv_rope_store = staticmethod(qkv_rope_store)
    softmax = staticmethod(softmax)
    log_softmax = staticmethod(log_softmax)
    attention = staticmethod(attention)
    plan_encoder = staticmethod(plan_encoder)
    encoder_attention = staticmethod(encoder_attention)

    @staticmethod
    def plan_attention(meta: AttentionMetadata) -> AttentionMetadata:
        return dataclasses.replace(meta, plan=_plan(meta))

    @staticmethod
    def weights_updated(model: torch.nn.Module) -> None:
        """After an in-place weight update: no packed copy of an old weight is used again."""
        cpu_kernels.forget_packed(model)
        for p in model.parameters():
            if hasattr(p, _SEGMENT_PACKS):
                delattr(p, _SEGMENT_PACKS)
