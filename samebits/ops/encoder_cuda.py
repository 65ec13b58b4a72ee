"""The invariant encoder attention of the CUDA backend: fixed-shape torch products (the CPU backend
runs the C++ split attention of ``reference.split_attention`` instead).

A query tile holds up to ``TILE_Q`` queries of one sequence; its keys (all of its sequence's tokens)
are reduced in splits of ``ENCODER_SPLIT_SIZE`` keys, each split one fixed-shape [TILE_Q, D] @ [D, split]
product per head, splits merged in ascending order. Keys past the sequence's end are read from a
zero row and masked to -inf, so they add exact zeros. tests/gpu/test_embeddings_gpu.py checks a
vector's bits alone and batched, in bf16 and fp32.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from samebits.ops.encoder import ENCODER_SPLIT_SIZE, SeqLayout

TILE_Q = 16  # queries per attention tile


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bmm that never runs a batch of one (a library may take another path for it)."""
    if a.shape[0] > 1:
        return torch.bmm(a, b)
    return torch.bmm(a.expand(2, -1, -1), b.expand(2, -1, -1))[:1]


@dataclass(frozen=True)
class _AttentionPlan:
    """Index tensors shared by every layer. Tiles are sorted by split count (most first), so the
    tiles that reduce split s are the first ``active[s]``."""

    q_rows: torch.Tensor  # [n_tiles, TILE_Q] flat query row of each tile row (pad rows repeat)
    valid: torch.Tensor  # [n_tiles * TILE_Q] bool: tile rows that are real queries
    kv_rows: torch.Tensor  # [n_tiles, n_splits * split] flat key row (past the end -> zero row)
    kv_valid: torch.Tensor  # [n_tiles, n_splits * split] bool
    active: tuple[int, ...]


def _attention_plan(layout: SeqLayout, split: int, device: torch.device) -> _AttentionPlan:
    tiles = []  # (sequence, query rows, real rows)
    for b, (start, n) in enumerate(zip(layout.starts, layout.lens, strict=True)):
        for t0 in range(0, n, TILE_Q):
            real = min(TILE_Q, n - t0)
            tiles.append((b, [start + t0 + min(i, real - 1) for i in range(TILE_Q)], real))
    n_splits = [-(-layout.lens[t[0]] // split) for t in tiles]
    order = sorted(range(len(tiles)), key=lambda i: -n_splits[i])  # stable
    tiles, n_splits = [tiles[i] for i in order], [n_splits[i] for i in order]
    key = torch.arange(n_splits[0] * split)
    seq = torch.tensor([t[0] for t in tiles], dtype=torch.long)
    lens = torch.tensor(layout.lens, dtype=torch.long)[seq]
    starts = torch.tensor(layout.starts, dtype=torch.long)[seq]
    kv_valid = key[None, :] < lens[:, None]
    kv_rows = torch.where(kv_valid, starts[:, None] + key[None, :], layout.num_rows)
    return _AttentionPlan(
        q_rows=torch.tensor([t[1] for t in tiles], dtype=torch.long, device=device),
        valid=torch.tensor([i < t[2] for t in tiles for i in range(TILE_Q)], device=device),
        kv_rows=kv_rows.to(device), kv_valid=kv_valid.to(device),
        active=tuple(sum(1 for n in n_splits if n > s) for s in range(n_splits[0])))


def _head_major(x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
    """[T, heads, D] -> [heads, T + 1, D (+1)]: a zero row appended (the key past every sequence's
    end), and ``extra`` (ones: P @ 1 rides in the P @ V product) as a last column."""
    t, heads, d = x.shape
    out = x.new_zeros(heads, t + 1, d + (extra is not None))
    out[:, :t, :d] = x.transpose(0, 1)
    if extra is not None:
        out[..., d] = extra
    return out


def _gather(xh: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows [n, r] of every head of xh [heads, R, W] -> [n, heads, r, W], contiguous, one copy."""
    heads, num_rows, width = xh.shape
    h = torch.arange(heads, device=xh.device)[None, :, None] * num_rows
    flat = (h + rows[:, None, :]).reshape(-1)
    return xh.view(heads * num_rows, width).index_select(0, flat).view(*rows.shape[:1], heads, -1, width)


def _split(qt: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, plan: _AttentionPlan, n: int,
           s: int, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [s*split, (s+1)*split) for the first ``n`` tiles: (row max, [P @ V | P @ 1])."""
    _, heads, rows, d = qt.shape
    idx = plan.kv_rows[:n, s * split:(s + 1) * split]  # [n, split]
    k, v1 = _gather(kh, idx), _gather(vh, idx)  # [n, heads, split, D], [n, heads, split, D + 1]
    scores = _bmm(qt.reshape(n * heads, rows, d), k.view(n * heads, split, d).transpose(1, 2))
    scores = scores.float().view(n, heads, rows, split)
    scores.masked_fill_(~plan.kv_valid[:n, None, None, s * split:(s + 1) * split], -math.inf)
    m_s = scores.amax(-1, keepdim=True)  # every split a tile reduces holds >= 1 real key
    p = scores.sub_(m_s).exp_()
    acc_s = _bmm(p.to(v1.dtype).view(n * heads, rows, split), v1.view(n * heads, split, d + 1))
    return m_s, acc_s.float().view(n, heads, rows, d + 1)


def plan_encoder(lens: list[int], device: torch.device) -> SeqLayout:
    """Packed back to back, with the tile plan of ``encoder_attention``."""
    layout = SeqLayout.packed(lens)
    return dataclasses.replace(layout, plan=_attention_plan(layout, ENCODER_SPLIT_SIZE, device))


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SeqLayout,
                      scale: float) -> torch.Tensor:
    """Bidirectional attention of q, k, v [T, heads, D] within each sequence -> [T, heads, D]."""
    split = ENCODER_SPLIT_SIZE
    plan = layout.plan if isinstance(layout.plan, _AttentionPlan) else _attention_plan(
        layout, split, q.device)
    _, heads, d = q.shape
    n_tiles = plan.q_rows.shape[0]
    qt = _gather(_head_major(q * scale), plan.q_rows)  # [n_tiles, heads, TILE_Q, D]
    kh, vh = _head_major(k), _head_major(v, extra=q.new_ones(()))
    m = q.new_full((n_tiles, heads, TILE_Q, 1), -math.inf, dtype=torch.float32)
    acc = q.new_zeros((n_tiles, heads, TILE_Q, d + 1), dtype=torch.float32)
    for s, n in enumerate(plan.active):
        m_s, acc_s = _split(qt[:n], kh, vh, plan, n, s, split)
        m_new = torch.maximum(m[:n], m_s)
        acc[:n] = acc[:n] * torch.exp(m[:n] - m_new) + acc_s * torch.exp(m_s - m_new)
        m[:n] = m_new
    out = (acc[..., :d] / acc[..., d:]).to(q.dtype).permute(0, 2, 1, 3).reshape(-1, heads, d)
    result = q.new_zeros(q.shape)
    result[plan.q_rows.view(-1)[plan.valid]] = out[plan.valid]
    return result
