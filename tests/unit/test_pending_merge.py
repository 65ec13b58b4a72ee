"""An attention output left unmerged (``PendingMerge``) reaches o_proj either merged inside the
backend's ``linear_partials`` or resolved first -- never read as a tensor it is not.

What they prove: a row-parallel layer that feeds the norm hands a PendingMerge to
``linear_partials`` untouched where the backend takes partials into the norm; any other path
(no partials into the norm, a bias) resolves it and computes exactly the product of the merged
tensor; a malformed PendingMerge is refused at construction."""

from __future__ import annotations

import pytest
import torch

from samebits.distributed.group import TPGroup
from samebits.models.parallel import RowParallelLinear
from samebits.ops.backend import get_backend
from samebits.ops.pending_merge import PendingMerge
from samebits.ops.pending_rank_sum import PendingRankSum


def _pending(merged: torch.Tensor) -> PendingMerge:
    hq, d = 2, merged.shape[-1] // 2
    return PendingMerge(torch.zeros(1, hq, 1, d), torch.zeros(1, hq, 1, 2),
                        torch.zeros(1, dtype=torch.int32), 128, 1.0, merged.dtype,
                        lambda: merged)


def _layer(into_norm: bool) -> RowParallelLinear:
    row = RowParallelLinear(8, 12, segments=2, group=TPGroup(0, 1), chains=2,
                            into_norm=into_norm)
    with torch.no_grad():
        row.weight.copy_(torch.randn(12, 8, generator=torch.Generator().manual_seed(0)))
    return row


class _TakesPartials:
    """The reference backend, but taking chain partials into the norm (as Triton does) and
    recording what ``linear_partials`` was handed."""

    def __init__(self) -> None:
        self.inner, self.seen = get_backend("cpu", True), []
        self.sums_in_norm, self.partials_into_norm_rows = True, 8

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def linear_partials(self, x, w, k_bounds):
        self.seen.append(x)
        x = x.resolve() if isinstance(x, PendingMerge) else x
        return self.inner.linear_partials(x, w, k_bounds)


def test_the_norm_path_hands_the_pending_merge_to_linear_partials():
    merged = torch.randn(1, 8, generator=torch.Generator().manual_seed(1))
    ops, row = _TakesPartials(), _layer(into_norm=True)
    out = row(ops, _pending(merged))
    assert isinstance(out, PendingRankSum) and isinstance(ops.seen[0], PendingMerge)
    want = row(ops, merged)
    assert torch.equal(out.parts, want.parts)


def test_every_other_path_resolves_it_first():
    merged = torch.randn(1, 8, generator=torch.Generator().manual_seed(2))
    ops, row = get_backend("cpu", True), _layer(into_norm=False)
    assert torch.equal(row(ops, _pending(merged)), row(ops, merged))
    other = torch.randn(1, 8, generator=torch.Generator().manual_seed(3))
    assert not torch.equal(row(ops, _pending(other)), row(ops, merged))  # the check can fail


def test_a_pending_merge_of_several_tokens_is_refused():
    with pytest.raises(ValueError, match="one token"):
        PendingMerge(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 2),
                     torch.zeros(2, dtype=torch.int32), 128, 1.0, torch.float32,
                     lambda: torch.zeros(2, 8))


@pytest.mark.parametrize("base", ["ReferenceBackend", "StandardBackend"])
def test_attention_deferred_runs_a_subclass_own_attention(base):
    """A backend with nothing to defer answers ``attention_deferred`` with its own ``attention``,
    a subclass's override included (the CUDA standard backend's graph-safe attention)."""
    from samebits.ops import reference, standard
    parent = {"ReferenceBackend": reference.ReferenceBackend,
              "StandardBackend": standard.StandardBackend}[base]
    marker = torch.ones(1)

    class Sub(parent):
        def attention(self, *args):
            return marker

    assert Sub().attention_deferred(None, None, None, None, 1.0) is marker
    assert parent.attention_deferred is not parent.attention
