"""The encoder ops of ``OpBackend`` (LayerNorm, GELU, pooling, L2 normalisation, the batch layout)
that do not depend on the device, as two mixins the backends inherit; each backend adds its own
``plan_encoder`` and ``encoder_attention`` (CPU: ``reference.py``; CUDA: ``encoder_cuda.py``).

``InvariantEncoderOps`` (the invariant backends): the bits of every output -- a token's hidden
state, a sequence's pooled vector -- depend only on that sequence's own rows, the weights and the
constants ``TILE_M`` and ``ENCODER_SPLIT_SIZE``; never on the other sequences, their number, order
or lengths, nor on where the sequence sits in the flat batch. How:

- sequences are packed back to back (``SeqLayout.packed``): no padding row enters a reduction;
- ``layer_norm`` and ``l2_normalize`` run row-wise on fixed [TILE_M, H] tiles;
- ``pool`` (mean) sums a sequence's rows in tiles of ``TILE_M`` by a fixed pairwise tree of
  elementwise adds, then adds the tile sums in ascending order; only the sequence's own rows are
  read (the tail of its last tile is exact zeros, placed by its own length). CLS and last token
  are picked by index.

``StandardEncoderOps`` (the standard backends): stock torch, shaped as sentence-transformers runs
a batch -- padded to its longest sequence, SDPA with a key mask, masked-sum mean pooling. No
invariance guarantee: the baseline and the negative control.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from samebits.ops.tiles import TILE_M, by_tiles

POOLING_MODES = ("mean", "cls", "lasttoken")
ENCODER_SPLIT_SIZE = 32  # keys per encoder attention split (a tile reduces whole splits)


@dataclass(frozen=True)
class SeqLayout:
    """Where each sequence of an encoder forward sits in its flat batch of token rows [T, ...]:
    sequence b owns rows ``starts[b] : starts[b] + lens[b]``. ``padded_len`` is set when every
    sequence sits in a block of that many rows of its own (``starts[b] == b * padded_len``), the
    rows after its end padding; ``plan``: the backend's index tensors, built once per forward
    (``OpBackend.plan_encoder``) and shared by every layer."""

    starts: tuple[int, ...]
    lens: tuple[int, ...]
    num_rows: int
    padded_len: int | None = None
    plan: object | None = None

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


def _with_zero_row(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


def _tile_tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim -2 of [..., TILE_M, H] by a fixed pairwise tree of elementwise adds."""
    while x.shape[-2] > 1:
        half = x.shape[-2] // 2
        x = x[..., :half, :] + x[..., half:, :]
    return x[..., 0, :]


def pick_token(x: torch.Tensor, layout: SeqLayout, mode: str) -> torch.Tensor:
    """[T, H] -> [B, H]: the first (``cls``) or last (``lasttoken``) row of each sequence."""
    if mode not in ("cls", "lasttoken"):
        raise ValueError(f"unknown pooling mode {mode!r}; expected one of {POOLING_MODES}")
    last = [s + n - 1 for s, n in zip(layout.starts, layout.lens, strict=True)]
    rows = list(layout.starts) if mode == "cls" else last
    return x[torch.tensor(rows, device=x.device)]


class InvariantEncoderOps:
    """The invariant encoder ops (module docstring): packed layout, fixed tiles and trees."""

    @staticmethod
    def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
        return by_tiles(lambda t: F.layer_norm(t, (t.shape[-1],), w, b, eps), x)

    @staticmethod
    def gelu(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)

    @staticmethod
    def pool(x: torch.Tensor, layout: SeqLayout, mode: str) -> torch.Tensor:
        if mode != "mean":
            return pick_token(x, layout, mode)
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

    @staticmethod
    def l2_normalize(x: torch.Tensor) -> torch.Tensor:
        return by_tiles(lambda t: F.normalize(t, p=2.0, dim=-1), x)


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
    """Stock torch on a padded batch (module docstring): the baseline and negative control."""

    @staticmethod
    def plan_encoder(lens: list[int], device: torch.device) -> SeqLayout:
        return SeqLayout.padded(lens)

    @staticmethod
    def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SeqLayout,
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

    @staticmethod
    def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)

    @staticmethod
    def gelu(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)

    @staticmethod
    def pool(x: torch.Tensor, layout: SeqLayout, mode: str) -> torch.Tensor:
        if mode != "mean":
            return pick_token(x, layout, mode)
        xp, mask = _padded(x, layout)
        m = mask[..., None].to(x.dtype)
        return (xp * m).sum(1) / m.sum(1).clamp(min=1e-9)

    @staticmethod
    def l2_normalize(x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, p=2.0, dim=1)
