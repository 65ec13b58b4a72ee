"""The CPU batch-invariant backend: every reduction runs through one fixed shape.

MKL picks its kernel (and so its summation order) from the problem's shape: a one-row product takes
a gemv path, and row counts between 63 and 128 take yet another blocking (measured, design.md
section 2). So no op here ever hands MKL a shape that depends on the batch:

- ``linear`` pads the rows to whole tiles of ``TILE_M`` and runs one ``[TILE_M, K] @ [K, N]``
  product per tile (every call the same problem, so the same kernel and summation order).
- row reductions (RMSNorm, softmax, log_softmax) run tile by tile on ``[TILE_M, H]`` blocks.
- attention reduces each query's context in splits of ``split_size`` keys, each split one fixed
  ``[TILE_Q * G, D] @ [D, split_size]`` product, splits merged in ascending order; a query tile
  holds up to ``TILE_Q`` consecutive queries of one sequence, padding rows are dropped.

Guarantee: a row's bits depend on its own inputs, the weights and these constants alone.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from samebits.ops.backend import AttentionMetadata, register
from samebits.ops.tiles import TILE_M, by_tiles, pad_rows

TILE_Q = 16  # queries per attention tile


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    *lead, k = x.shape
    n = w.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    xp = pad_rows(x2.contiguous())
    out = xp.new_empty(xp.shape[0], n)
    wt = w.t()
    # One identical [TILE_M, K] @ [K, N] call per tile. Not a single bmm over the tiles: MKL
    # takes another path for a batch of one than for two or more (seen at N=1, and K >= 4096).
    for i in range(0, xp.shape[0], TILE_M):
        torch.mm(xp[i:i + TILE_M], wt, out=out[i:i + TILE_M])
    out = out[:m]
    if b is not None:
        out = out + b
    return out.reshape(*lead, n)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    def tile(t: torch.Tensor) -> torch.Tensor:
        h = t.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(t.dtype)
    return by_tiles(tile, x)


def softmax(x: torch.Tensor) -> torch.Tensor:
    return by_tiles(lambda t: torch.softmax(t, dim=-1), x)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    return by_tiles(lambda t: torch.log_softmax(t, dim=-1), x)


@dataclasses.dataclass(frozen=True)
class _AttentionPlan:
    """Index tensors shared by every layer of one forward. Tiles are sorted by how many splits
    they reduce (most first), so the tiles active in split s are the first ``active[s]``."""

    q_rows: torch.Tensor  # [n_tiles, TILE_Q] flat query row of each tile row (pad rows repeat)
    q_pos: torch.Tensor  # [n_tiles, TILE_Q] position of each tile row
    valid: torch.Tensor  # [n_tiles * TILE_Q] bool: tile rows that are real queries
    kv_slots: torch.Tensor  # [n_tiles, n_splits * split] cache slot of each key (pad -> slot 0)
    kv_valid: torch.Tensor  # [n_tiles, n_splits * split, 1, 1] key inside its sequence's context
    active: tuple[int, ...]  # per split s: number of tiles that reduce it


def _tiles(meta: AttentionMetadata) -> list[tuple[int, list[int], list[int], int]]:
    """(sequence, rows, positions, real rows) of each query tile."""
    qsl, out = meta.query_start_loc_list, []
    for b, seq_len in enumerate(meta.seq_lens_list):
        q_start, q_end = qsl[b], qsl[b + 1]
        first_pos = seq_len - (q_end - q_start)
        for t0 in range(q_start, q_end, TILE_Q):
            n = min(TILE_Q, q_end - t0)
            rows = [t0 + min(i, n - 1) for i in range(TILE_Q)]
            out.append((b, rows, [first_pos + r - q_start for r in rows], n))
    return out


def _plan(meta: AttentionMetadata) -> _AttentionPlan:
    split = meta.split_size
    tiles = sorted(_tiles(meta), key=lambda t: -t[2][-1])  # stable: most splits first
    splits = [t[2][-1] // split + 1 for t in tiles]
    n_keys = splits[0] * split
    key_pos = torch.arange(n_keys)
    tables = meta.block_tables.cpu().long()
    block_idx = (key_pos // meta.block_size).clamp(max=tables.shape[1] - 1)
    slots = tables[:, block_idx] * meta.block_size + key_pos % meta.block_size  # [B, n_keys]
    valid = key_pos[None, :] < torch.tensor(meta.seq_lens_list)[:, None]
    slots = torch.where(valid, slots, 0)
    seq_of_tile = torch.tensor([t[0] for t in tiles], dtype=torch.long)
    dev = meta.slot_mapping.device
    return _AttentionPlan(
        q_rows=torch.tensor([t[1] for t in tiles], dtype=torch.long, device=dev),
        q_pos=torch.tensor([t[2] for t in tiles], dtype=torch.long, device=dev),
        valid=torch.tensor([i < t[3] for t in tiles for i in range(TILE_Q)], device=dev),
        kv_slots=slots[seq_of_tile].to(dev),
        kv_valid=valid[seq_of_tile][:, :, None, None].to(dev),
        active=tuple(sum(1 for n in splits if n > s) for s in range(splits[0])),
    )


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Split attention; see the module docstring for the arithmetic it fixes."""
    plan: _AttentionPlan = meta.plan if meta.plan is not None else _plan(meta)
    n_tokens, hq, d = q.shape
    hkv, split = k_cache.shape[2], meta.split_size
    g = hq // hkv
    n_tiles = plan.q_rows.shape[0]
    # [n_tiles, Hkv, TILE_Q * G, D]: rows of one GEMM are (query, head-in-group) pairs
    qt = (q * scale)[plan.q_rows].view(n_tiles, TILE_Q, hkv, g, d).permute(0, 2, 1, 3, 4)
    qt = qt.reshape(n_tiles, hkv, TILE_Q * g, d)
    k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    m = q.new_full((n_tiles, hkv, TILE_Q * g, 1), -math.inf, dtype=torch.float32)
    acc = q.new_zeros((n_tiles, hkv, TILE_Q * g, d + 1), dtype=torch.float32)
    for s, n in enumerate(plan.active):
        m_s, acc_s = _split(qt[:n], k_flat, v_flat, plan, n, s, split, g)
        m_new = torch.maximum(m[:n], m_s)
        acc[:n] = acc[:n] * torch.exp(m[:n] - m_new) + acc_s * torch.exp(m_s - m_new)
        m[:n] = m_new
    out = (acc[..., :d] / acc[..., d:]).to(q.dtype)  # [n_tiles, Hkv, TILE_Q * G, D]
    out = out.view(n_tiles, hkv, TILE_Q, g, d).permute(0, 2, 1, 3, 4).reshape(-1, hq, d)
    result = q.new_empty(n_tokens, hq, d)
    result[plan.q_rows.view(-1)[plan.valid]] = out[plan.valid]
    return result


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bmm that never runs a batch of one (MKL takes another path for it)."""
    if a.shape[0] > 1:
        return torch.bmm(a, b)
    return torch.bmm(a.expand(2, -1, -1), b.expand(2, -1, -1))[:1]


def _split(qt: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, plan: _AttentionPlan,
           n: int, s: int, split: int, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [s*split, (s+1)*split) for the first ``n`` tiles: (row max, [P @ V | P @ 1])."""
    _, hkv, rows, d = qt.shape
    slots = plan.kv_slots[:n, s * split:(s + 1) * split]  # [n, split]
    k = k_flat[slots].permute(0, 2, 3, 1).reshape(n * hkv, d, split)
    v1 = v_flat.new_ones(n, hkv, split, d + 1)
    valid = plan.kv_valid[:n, s * split:(s + 1) * split]
    # Padding keys read slot 0, which may belong to anyone: zero them so 0 * inf never happens.
    v1[..., :d] = torch.where(valid, v_flat[slots], 0).permute(0, 2, 1, 3)
    scores = _bmm(qt.reshape(n * hkv, rows, d), k).float().view(n, hkv, -1, g, split)
    key_pos = torch.arange(s * split, (s + 1) * split, device=qt.device)
    causal = key_pos[None, None, :] <= plan.q_pos[:n, :, None]  # [n, TILE_Q, split]
    scores = scores.masked_fill(~causal[:, None, :, None, :], -math.inf).view(n, hkv, rows, split)
    m_s = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - torch.where(m_s == -math.inf, 0.0, m_s))
    acc_s = _bmm(p.to(v1.dtype).view(n * hkv, rows, split), v1.view(n * hkv, split, d + 1))
    return m_s, acc_s.float().view(n, hkv, rows, d + 1)


@register("cpu", True)
class ReferenceBackend:
    name = "reference-cpu"
    batch_invariant = True

    linear = staticmethod(linear)
    rms_norm = staticmethod(rms_norm)
    softmax = staticmethod(softmax)
    log_softmax = staticmethod(log_softmax)
    attention = staticmethod(attention)

    @staticmethod
    def plan_attention(meta: AttentionMetadata) -> AttentionMetadata:
        return dataclasses.replace(meta, plan=_plan(meta))
