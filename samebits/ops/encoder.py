"""Encoder numerics: LayerNorm, bidirectional attention over variable-length sequences, pooling and
L2 normalisation -- an invariant CPU set and the standard (stock torch) set of the negative control.

A forward holds a flat batch of token rows [T, ...]; ``SeqLayout`` says where each sequence's rows
sit (packed back to back, or padded to a common length as sentence-transformers does).

Invariant guarantee (``InvariantEncoderOps``): the bits of every output -- a token's hidden state, a
sequence's pooled vector -- depend only on that sequence's own tokens, the weights and the constants
``TILE_M``, ``TILE_Q`` and ``split_size``; never on the other sequences, their number, order or
lengths, nor on where the sequence sits in the flat batch. How:

- ``linear`` is the backend's (CPU: one identical [TILE_M, K] @ [K, N] mm per 16-row tile).
- ``layer_norm`` and ``normalize`` run row-wise on fixed [TILE_M, H] tiles.
- ``attention``: a query tile holds up to ``TILE_Q`` queries of one sequence; its keys (all of its
  sequence's tokens) are reduced in splits of ``split_size`` keys, each split one fixed-shape
  [TILE_Q, D] @ [D, split_size] product per head, splits merged in ascending order. Keys past the
  sequence's end are read from a zero row and masked to -inf, so they add exact zeros.
- ``pool`` (mean) sums a sequence's rows in tiles of ``TILE_M`` by a fixed pairwise tree of
  elementwise adds, then adds the tile sums in ascending order; only the sequence's own rows are read
  (the tail of the last tile is exact zeros, placed by the sequence's own length).

On CUDA the same fixed-shape arithmetic runs through torch's CUDA kernels (linear through the
Triton backend): bitwise invariant in float32 on an H100 in benchmarks/embedding_drift.py, but not
yet covered by a GPU test.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from samebits.ops.backend import OpBackend, get_backend
from samebits.ops.reference import TILE_Q, _bmm
from samebits.ops.tiles import TILE_M, by_tiles

POOLING_MODES = ("mean", "cls", "lasttoken")
DEFAULT_SPLIT_SIZE = 32  # keys per attention split (a tile reduces whole splits; texts are short)


@dataclass(frozen=True)
class SeqLayout:
    """Sequence b owns flat rows ``starts[b] : starts[b] + lens[b]`` of a [num_rows, ...] batch.

    ``padded_len`` is set when every sequence sits in its own block of that many rows
    (``starts[b] == b * padded_len``); the rows after a sequence's end are padding.
    """

    starts: tuple[int, ...]
    lens: tuple[int, ...]
    num_rows: int
    padded_len: int | None = None
    plan: object | None = None  # backend-specific index tensors, built once per forward

    @classmethod
    def packed(cls, lens: list[int]) -> SeqLayout:
        starts = [0]
        for n in lens[:-1]:
            starts.append(starts[-1] + n)
        return cls(tuple(starts), tuple(lens), sum(lens))

    @classmethod
    def padded(cls, lens: list[int]) -> SeqLayout:
        width = max(lens)
        return cls(tuple(b * width for b in range(len(lens))), tuple(lens), width * len(lens), width)

    @property
    def num_seqs(self) -> int:
        return len(self.lens)


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


def _with_zero_row(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


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


def _tile_tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim -2 of [..., TILE_M, H] by a fixed pairwise tree of elementwise adds."""
    while x.shape[-2] > 1:
        half = x.shape[-2] // 2
        x = x[..., :half, :] + x[..., half:, :]
    return x[..., 0, :]


class InvariantEncoderOps:
    """The invariant set; see the module docstring for the arithmetic it fixes."""

    batch_invariant = True

    def __init__(self, backend: OpBackend, split_size: int = DEFAULT_SPLIT_SIZE) -> None:
        self.linear = backend.linear
        self.split_size = split_size
        self.name = f"{backend.name}+encoder(split={split_size},tile={TILE_M},tile_q={TILE_Q})"

    def plan(self, layout: SeqLayout, device: torch.device) -> SeqLayout:
        return dataclasses.replace(layout, plan=_attention_plan(layout, self.split_size, device))

    def layer_norm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float
                   ) -> torch.Tensor:
        return by_tiles(lambda t: F.layer_norm(t, (t.shape[-1],), w, b, eps), x)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SeqLayout,
                  scale: float) -> torch.Tensor:
        """Bidirectional attention of q, k, v [T, heads, D] within each sequence -> [T, heads, D]."""
        plan = layout.plan if layout.plan is not None else _attention_plan(layout, self.split_size,
                                                                            q.device)
        split, (_, heads, d) = self.split_size, q.shape
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

    def pool(self, x: torch.Tensor, layout: SeqLayout, mode: str) -> torch.Tensor:
        """[T, H] -> [B, H]: mean / first (CLS) / last token of each sequence."""
        if mode != "mean":
            return _pick_token(x, layout, mode)
        n_tiles = -(-max(layout.lens) // TILE_M)
        j = torch.arange(n_tiles * TILE_M, device=x.device)
        lens = torch.tensor(layout.lens, device=x.device)
        starts = torch.tensor(layout.starts, device=x.device)
        rows = torch.where(j[None, :] < lens[:, None], starts[:, None] + j[None, :], x.shape[0])
        tiles = _tile_tree_sum(_with_zero_row(x)[rows].view(len(lens), n_tiles, TILE_M, -1))
        total = tiles[:, 0]
        for t in range(1, n_tiles):  # ascending; a sequence stops at its own last tile
            total = torch.where((t * TILE_M < lens)[:, None], total + tiles[:, t], total)
        return total / lens[:, None].to(x.dtype)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """L2-normalise each row [B, H] (eps 1e-12, as torch.nn.functional.normalize)."""
        return by_tiles(lambda t: F.normalize(t, p=2.0, dim=-1), x)


def _pick_token(x: torch.Tensor, layout: SeqLayout, mode: str) -> torch.Tensor:
    if mode not in ("cls", "lasttoken"):
        raise ValueError(f"unknown pooling mode {mode!r}; expected one of {POOLING_MODES}")
    last = [s + n - 1 for s, n in zip(layout.starts, layout.lens, strict=True)]
    rows = list(layout.starts) if mode == "cls" else last
    return x[torch.tensor(rows, device=x.device)]


def _padded(x: torch.Tensor, layout: SeqLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, ...] -> ([B, L, ...] view or gather, mask [B, L] bool of the real rows)."""
    lens = torch.tensor(layout.lens, device=x.device)
    width = layout.padded_len or max(layout.lens)
    j = torch.arange(width, device=x.device)
    mask = j[None, :] < lens[:, None]
    if layout.padded_len is not None:
        return x.view(layout.num_seqs, width, *x.shape[1:]), mask
    rows = torch.where(mask, torch.tensor(layout.starts, device=x.device)[:, None] + j, 0)
    return x[rows], mask


class StandardEncoderOps:
    """Stock torch, shaped as sentence-transformers runs it: padded batch, SDPA with a key mask,
    masked-sum mean pooling. No invariance guarantee: the negative control and the baseline."""

    batch_invariant = False

    def __init__(self, backend: OpBackend) -> None:
        self.linear = backend.linear
        self.name = f"{backend.name}+encoder(standard)"

    def plan(self, layout: SeqLayout, device: torch.device) -> SeqLayout:
        return layout

    def layer_norm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float
                   ) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SeqLayout,
                  scale: float) -> torch.Tensor:
        (qp, mask), (kp, _), (vp, _) = (_padded(t, layout) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qp.transpose(1, 2), kp.transpose(1, 2),
                                           vp.transpose(1, 2), attn_mask=mask[:, None, None, :],
                                           scale=scale).transpose(1, 2)  # [B, L, heads, D]
        if layout.padded_len is not None:
            return o.reshape(q.shape)
        out = q.new_zeros(q.shape)
        for b, (start, n) in enumerate(zip(layout.starts, layout.lens, strict=True)):
            out[start:start + n] = o[b, :n]
        return out

    def pool(self, x: torch.Tensor, layout: SeqLayout, mode: str) -> torch.Tensor:
        if mode != "mean":
            return _pick_token(x, layout, mode)
        xp, mask = _padded(x, layout)
        m = mask[..., None].to(x.dtype)
        return (xp * m).sum(1) / m.sum(1).clamp(min=1e-9)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, p=2.0, dim=1)


EncoderOps = InvariantEncoderOps | StandardEncoderOps


def get_encoder_ops(device: torch.device | str, batch_invariant: bool,
                    split_size: int = DEFAULT_SPLIT_SIZE) -> EncoderOps:
    """The encoder op set for a device and mode (linear from ``get_backend``)."""
    backend = get_backend(device, batch_invariant)
    if batch_invariant:
        return InvariantEncoderOps(backend, split_size)
    return StandardEncoderOps(backend)
