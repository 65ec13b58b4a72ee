"""Encoder numerics: LayerNorm, bidirectional attention over variable-length sequences, pooling and
L2 normalisation -- an invariant CPU set and the standard (stock torch) set of the negative control.

A forward holds a flat batch of token rows [T, ...]; ``SeqLayout`` says where each sequence's rows
sit (packed back to back, or padded to a common length as sentence-transformers does).

Invariant guarantee (``InvariantEncoderOps``): the bits of every output -- a token's hidden state, a
sequence's pooled vector -- depend only on that sequence's own tokens, the weights and the constants
``TILE_M``, the CPU kernels' arithmetic and ``split_size``; never on the other sequences, their
number, order or lengths, nor on where the sequence sits in the flat batch. How:

- ``linear`` is the backend's (CPU: each output element one ascending-K fma chain).
- ``layer_norm`` and ``normalize`` run row-wise on fixed [TILE_M, H] tiles.
- ``attention`` is the decoder's CPU split attention (``reference.split_attention``) run without a
  causal mask: every query of a sequence reads all of its sequence's keys, in splits of
  ``split_size`` keys merged in ascending order; padding rows read none and come out zero.
- ``pool`` (mean) sums a sequence's rows in tiles of ``TILE_M`` by a fixed pairwise tree of
  elementwise adds, then adds the tile sums in ascending order; only the sequence's own rows are read
  (the tail of the last tile is exact zeros, placed by the sequence's own length).

On CUDA the attention is ``encoder_cuda.attention`` (fixed-shape torch products, linear through the
Triton backend): bitwise invariant in float32 on an H100 in benchmarks/embedding_drift.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from samebits.ops.backend import OpBackend, get_backend
from samebits.ops.reference import SplitPlan, split_attention
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


def _attention_plan(layout: SeqLayout) -> SplitPlan:
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


def _with_zero_row(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


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
        self.name = f"{backend.name}+encoder(split={split_size},tile={TILE_M})"

    def plan(self, layout: SeqLayout, device: torch.device) -> SeqLayout:
        if device.type != "cpu":
            from samebits.ops import encoder_cuda
            return dataclasses.replace(layout, plan=encoder_cuda._attention_plan(
                layout, self.split_size, device))
        return dataclasses.replace(layout, plan=_attention_plan(layout))

    def layer_norm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float
                   ) -> torch.Tensor:
        return by_tiles(lambda t: F.layer_norm(t, (t.shape[-1],), w, b, eps), x)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SeqLayout,
                  scale: float) -> torch.Tensor:
        """Bidirectional attention of q, k, v [T, heads, D] within each sequence -> [T, heads, D]."""
        if q.device.type != "cpu":
            from samebits.ops import encoder_cuda
            return encoder_cuda.attention(q, k, v, layout, scale, self.split_size)
        plan = layout.plan if isinstance(layout.plan, SplitPlan) else _attention_plan(layout)
        t, heads, d = k.shape
        return split_attention(q, k.reshape(t, 1, heads, d), v.reshape(t, 1, heads, d), plan, scale,
                               self.split_size)

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
