"""The fixed segmentation of every sharded weight: S segments, whatever the number of ranks.

S is the model's number of KV heads. Segment g of the attention is KV group g (its G = Hq/Hkv
query heads, one K and one V head); segment c of the MLP is the c-th of S near-equal slices of the
intermediate dimension; segment v of the vocabulary the v-th of S near-equal slices of the vocab.
Rank r of N owns segments [r S/N, (r+1) S/N).

``k_bounds`` is the one definition of the row-parallel linears' K segments (o_proj: the KV groups'
columns; down_proj: the MLP slices): the single-device model computes o_proj and down_proj over
these segments too, so one device and N ranks give the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from samebits.config import ModelConfig
from samebits.ops.backend import KBounds


def bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous near-equal [lo, hi) slices of range(total) (torch.tensor_split's)."""
    edges = [0]
    for i in range(parts):
        edges.append(edges[-1] + total // parts + (1 if i < total % parts else 0))
    return list(zip(edges[:-1], edges[1:], strict=True))


def row_parallel_bounds(k: int, num_segments: int) -> KBounds:
    """The K segments of a row-parallel weight with ``k`` input columns: ``bounds(k, S)``. For
    o_proj (k = Hq D, a multiple of S) segment g is KV group g's columns."""
    return tuple(bounds(k, num_segments))


def k_bounds(cfg: ModelConfig, k: int) -> KBounds:
    """The model's segmentation (S = its KV heads) of a row-parallel weight's ``k`` columns."""
    return row_parallel_bounds(k, cfg.num_key_value_heads)


@dataclass(frozen=True)
class Segments:
    num_segments: int
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.num_segments % self.world_size:
            raise ValueError(f"tensor_parallel_size={self.world_size} must divide the model's "
                             f"{self.num_segments} KV heads")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside [0, {self.world_size})")

    @classmethod
    def for_model(cls, cfg: ModelConfig, rank: int, world_size: int) -> Segments:
        return cls(cfg.num_key_value_heads, rank, world_size)

    @property
    def per_rank(self) -> int:
        return self.num_segments // self.world_size

    def owned(self, rank: int | None = None) -> range:
        r = self.rank if rank is None else rank
        return range(r * self.per_rank, (r + 1) * self.per_rank)

    def qkv_rows(self, cfg: ModelConfig, g: int) -> torch.Tensor:
        """Rows of the fused [q; k; v] weight that make KV group g: its q heads, its k, its v."""
        d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        q = hq // hkv * d
        return torch.cat([torch.arange(g * q, (g + 1) * q),
                          hq * d + torch.arange(g * d, (g + 1) * d),
                          (hq + hkv) * d + torch.arange(g * d, (g + 1) * d)])

    def o_cols(self, cfg: ModelConfig, g: int) -> slice:
        return slice(*k_bounds(cfg, cfg.num_attention_heads * cfg.head_dim)[g])

    def mlp_slice(self, cfg: ModelConfig, c: int) -> slice:
        return slice(*k_bounds(cfg, cfg.intermediate_size)[c])

    def vocab_slice(self, cfg: ModelConfig, v: int) -> slice:
        lo, hi = bounds(cfg.vocab_size, self.num_segments)[v]
        return slice(lo, hi)

    def vocab_range(self, cfg: ModelConfig, rank: int | None = None) -> tuple[int, int]:
        """The contiguous vocab rows rank ``rank`` owns."""
        owned = self.owned(rank)
        return (self.vocab_slice(cfg, owned[0]).start, self.vocab_slice(cfg, owned[-1]).stop)
