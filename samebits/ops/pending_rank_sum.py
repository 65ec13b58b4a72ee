"""A row-parallel layer's output whose rank sum is left to the residual add + RMSNorm after it.

Under tensor parallel (the invariant mode) a row-parallel layer (o_proj, down_proj) ends with the
ranks' fp32 sums gathered, [N, ..., H] in rank order, tree-summed in ``tree_sum``'s order and cast
once (``OpBackend.sum_tree``); the decoder then adds that output to the residual stream and
normalizes it (``ops.rms_norm(h, w, eps, residual)``). A backend that fuses the sum into that
norm (``sums_in_norm``: the Triton backend) is handed the gathered parts instead of their sum and
computes, per element, the very adds and cast of ``sum_tree`` right before the add: the bits of
``sum_tree`` then the norm, one launch fewer per row-parallel layer.
``samebits.models.parallel.RowParallelLinear.gathered`` is the one place that hands one over;
whatever needs a tensor calls ``resolve``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from samebits.ops.backend import OpBackend


@dataclass(frozen=True)
class PendingRankSum:
    """``sum_tree(parts, dtype)`` -> [..., H] in ``dtype``, not yet computed."""

    parts: torch.Tensor  # [N, ..., H] fp32: the gathered sums (or partials), in tree order
    dtype: torch.dtype  # the layer's output dtype (its input's)

    def __post_init__(self) -> None:
        if self.parts.dim() < 2 or self.parts.dtype != torch.float32:
            raise ValueError(f"PendingRankSum: fp32 parts [N, ..., H] expected, got "
                             f"{tuple(self.parts.shape)} {self.parts.dtype}")

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    @property
    def count(self) -> int:
        """N, the number of parts summed."""
        return self.parts.shape[0]

    def resolve(self, ops: OpBackend) -> torch.Tensor:
        """The sum as a tensor: exactly ``ops.sum_tree(parts, dtype)``."""
        return ops.sum_tree(self.parts, self.dtype)


def resolved(ops: OpBackend, h: torch.Tensor | PendingRankSum) -> torch.Tensor:
    """``h`` as a tensor: a pending sum resolved, a tensor unchanged."""
    return h.resolve(ops) if isinstance(h, PendingRankSum) else h
