"""The CPU batch-invariant backend: every reduction runs through one fixed shape.

MKL picks its kernel (and so its summation order) from the problem's shape: a one-row product takes
a gemv path, and row counts between 63 and 128 take yet another blocking (measured, design.md
section 2). So no op here ever hands MKL a shape that depends on the batch:

- ``linear`` pads the rows to whole tiles of ``TILE_M`` and runs one ``[TILE_M, K] @ [K, N]``
  product per tile (a batched product over tiles; every tile is the same problem).
- row reductions (RMSNorm, softmax, log_softmax) run tile by tile on ``[TILE_M, H]`` blocks.
- attention reduces each query's context in splits of ``split_size`` keys, each split one fixed
  ``[TILE_Q * G, D] @ [D, split_size]`` product, splits merged in ascending order; a query tile
  holds up to ``TILE_Q`` consecutive queries of one sequence, padding rows are dropped.

Guarantee: a row's bits depend on its own inputs, the weights and these constants alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from samebits.ops.backend import AttentionMetadata, register

TILE_M = 16  # rows per GEMM / reduction tile
TILE_Q = 16  # queries per attention tile


def _pad_rows(x: torch.Tensor, tile: int) -> torch.Tensor:
    m = x.shape[0]
    padded = -(-m // tile) * tile
    if padded == m:
        return x
    return torch.cat([x, x.new_zeros(padded - m, *x.shape[1:])])


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    *lead, k = x.shape
    n = w.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*lead, n)
    xp = _pad_rows(x2, TILE_M)
    tiles = xp.shape[0] // TILE_M
    out = torch.bmm(xp.view(tiles, TILE_M, k), w.t().expand(tiles, k, n)).view(-1, n)[:m]
    if b is not None:
        out = out + b
    return out.reshape(*lead, n)


def _by_tiles(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Apply a row-wise ``fn`` to fixed [TILE_M, H] blocks of ``x`` [..., H]."""
    lead, h = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, h)
    m = x2.shape[0]
    if m == 0:
        return fn(x2).reshape(*lead, -1)
    xp = _pad_rows(x2, TILE_M)
    out = torch.cat([fn(xp[i:i + TILE_M]) for i in range(0, xp.shape[0], TILE_M)])
    return out[:m].reshape(*lead, out.shape[-1])


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    def tile(t: torch.Tensor) -> torch.Tensor:
        h = t.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(t.dtype)
    return _by_tiles(tile, x)


def softmax(x: torch.Tensor) -> torch.Tensor:
    return _by_tiles(lambda t: torch.softmax(t, dim=-1), x)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    return _by_tiles(lambda t: torch.log_softmax(t, dim=-1), x)


@dataclasses.dataclass(frozen=True)
class _AttentionPlan:
    """Index tensors shared by every layer of one forward."""

    q_rows: torch.Tensor  # [n_tiles, TILE_Q] flat query row of each tile row (pad rows repeat)
    q_pos: torch.Tensor  # [n_tiles, TILE_Q] position of each tile row
    valid: torch.Tensor  # [n_tiles * TILE_Q] bool: tile rows that are real queries
    kv_slots: torch.Tensor  # [n_tiles, n_splits * split] cache slot of each key (pad -> slot 0)
    tile_splits: tuple[int, ...]  # splits each tile must reduce (ascending order)


def _plan(meta: AttentionMetadata) -> _AttentionPlan:
    qsl, bs, split = meta.query_start_loc_list, meta.block_size, meta.split_size
    rows, pos, valid, seq_of_tile, splits = [], [], [], [], []
    for b, seq_len in enumerate(meta.seq_lens_list):
        q_start, q_end = qsl[b], qsl[b + 1]
        first_pos = seq_len - (q_end - q_start)
        for t0 in range(q_start, q_end, TILE_Q):
            n = min(TILE_Q, q_end - t0)
            rows.append([t0 + min(i, n - 1) for i in range(TILE_Q)])
            pos.append([first_pos + t0 - q_start + min(i, n - 1) for i in range(TILE_Q)])
            valid.extend([True] * n + [False] * (TILE_Q - n))
            seq_of_tile.append(b)
            splits.append(pos[-1][-1] // split + 1)
    n_keys = max(splits, default=1) * split
    key_pos = torch.arange(n_keys)
    tables = meta.block_tables.cpu().long()
    block_idx = (key_pos // bs).clamp(max=tables.shape[1] - 1)
    slots = tables[:, block_idx] * bs + key_pos % bs  # [B, n_keys]
    lens = torch.tensor(meta.seq_lens_list)
    slots = torch.where(key_pos[None, :] < lens[:, None], slots, 0)
    device = meta.slot_mapping.device
    return _AttentionPlan(
        q_rows=torch.tensor(rows, dtype=torch.long, device=device).view(-1, TILE_Q),
        q_pos=torch.tensor(pos, dtype=torch.long, device=device).view(-1, TILE_Q),
        valid=torch.tensor(valid, dtype=torch.bool, device=device),
        kv_slots=slots[torch.tensor(seq_of_tile, dtype=torch.long)].to(device),
        tile_splits=tuple(splits),
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
    for s in range(max(plan.tile_splits)):
        active = [i for i, n in enumerate(plan.tile_splits) if n > s]
        idx = torch.tensor(active, dtype=torch.long, device=q.device)
        m_s, acc_s = _split(qt[idx], k_flat, v_flat, plan, idx, s, split, g)
        m_new = torch.maximum(m[idx], m_s)
        alpha = torch.exp(m[idx] - m_new)
        beta = torch.exp(m_s - m_new)
        acc[idx] = acc[idx] * alpha + acc_s * beta
        m[idx] = m_new
    out = (acc[..., :d] / acc[..., d:]).to(q.dtype)  # [n_tiles, Hkv, TILE_Q * G, D]
    out = out.view(n_tiles, hkv, TILE_Q, g, d).permute(0, 2, 1, 3, 4).reshape(-1, hq, d)
    result = q.new_empty(n_tokens, hq, d)
    result[plan.q_rows.view(-1)[plan.valid]] = out[plan.valid]
    return result


def _split(qt: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, plan: _AttentionPlan,
           idx: torch.Tensor, s: int, split: int, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One split of keys [s*split, (s+1)*split) for the tiles ``idx``: (row max, [P@V | P@1])."""
    n, hkv, rows, d = qt.shape
    slots = plan.kv_slots[idx, s * split:(s + 1) * split]  # [n, split]
    k = k_flat[slots].permute(0, 2, 3, 1).reshape(n * hkv, d, split)
    v = v_flat[slots].permute(0, 2, 1, 3)  # [n, Hkv, split, D]
    v1 = torch.cat([v, v.new_ones(n, hkv, split, 1)], dim=-1).reshape(n * hkv, split, d + 1)
    scores = torch.bmm(qt.reshape(n * hkv, rows, d), k).float().view(n, hkv, -1, g, split)
    key_pos = torch.arange(s * split, (s + 1) * split, device=qt.device)
    causal = key_pos[None, None, :] <= plan.q_pos[idx][:, :, None]  # [n, TILE_Q, split]
    scores = scores.masked_fill(~causal[:, None, :, None, :], -math.inf).view(n, hkv, rows, split)
    m_s = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - torch.where(m_s == -math.inf, 0.0, m_s))
    acc_s = torch.bmm(p.to(v1.dtype).view(n * hkv, rows, split), v1).float()
    return torch.where(m_s == -math.inf, -math.inf, m_s), acc_s.view(n, hkv, rows, d + 1)


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
