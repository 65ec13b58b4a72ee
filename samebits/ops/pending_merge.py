"""An attention output whose decode split partials are not merged yet (one token).

``OpBackend.attention_deferred`` may return one instead of the output tensor; the layer's o_proj
hands it to ``linear_partials``, whose backend may merge the partials inside its product (the
merge's arithmetic, so the same bits), and anything else calls ``resolve``: the merge kernel,
exactly what ``attention`` would have returned, flattened to [1, Hq * D].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True, eq=False)
class PendingMerge:
    """Invariant: ``positions[0] // split_size < S`` -- every split the token has is in the
    partials (the split kernel wrote it); a consumer merges exactly those."""

    part_acc: torch.Tensor  # [1, Hq, S, D] fp32: each split's unnormalized output
    part_ml: torch.Tensor  # [1, Hq, S, 2] fp32: each split's (row max, sum)
    positions: torch.Tensor  # [1] int32: the token's position (splits 0..pos // split_size)
    split_size: int
    c: float  # softmax scale * log2(e)
    dtype: torch.dtype  # the attention output's (q's)
    merge: Callable[[], torch.Tensor]  # the merge kernel -> [1, Hq * D] in ``dtype``

    def __post_init__(self) -> None:
        if self.part_acc.dim() != 4 or self.part_acc.shape[0] != 1:
            raise ValueError(f"PendingMerge: partials of one token [1, Hq, S, D] expected, got "
                             f"{tuple(self.part_acc.shape)}")

    @property
    def shape(self) -> torch.Size:
        _, hq, _, d = self.part_acc.shape
        return torch.Size((1, hq * d))

    def resolve(self) -> torch.Tensor:
        return self.merge()
