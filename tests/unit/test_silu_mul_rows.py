"""The invariant CPU backend's SiLU(gate) * up is row-invariant at any row count (many threads):
the rows of a [1025, I] MLP activation (gate and up the halves of one gate_up output, as the
decoder passes them) are those of its first 512 and last 513 rows computed alone, with and
without down_proj's K segments. Negative control: torch's plain ``F.silu(gate) * up`` on the
same inputs, per segment, gives some rows other bits (a thread's share starting inside a row
moves that row's vector / scalar-tail boundary; needs more than one thread)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from samebits.ops.backend import get_backend
from samebits.ops.tiles import silu_mul_rows

ROWS, CUT, INTER = 1025, 512, 200


def _halves_match(fn) -> bool:
    gate, up = torch.randn(ROWS, 2 * INTER, generator=torch.Generator().manual_seed(0)).chunk(2, -1)
    whole = fn(gate, up)
    return torch.equal(torch.cat([fn(gate[:CUT], up[:CUT]), fn(gate[CUT:], up[CUT:])]), whole)


@pytest.mark.parametrize("k_bounds", [None, ((0, 100), (100, 200))])
def test_cpu_silu_mul_rows_do_not_depend_on_the_row_count(k_bounds):
    ops = get_backend("cpu", True)
    assert _halves_match(lambda g, u: ops.silu_mul(g, u, k_bounds))


def test_silu_of_rows_does_not_depend_on_their_count():
    g = torch.randn(301, 2 * 1001)
    gate, up = g[:, :1001], g[:, 1001:]
    want = torch.cat([silu_mul_rows(gate[i:i + 1], up[i:i + 1]) for i in range(301)])
    assert torch.equal(silu_mul_rows(gate, up), want)


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one thread never splits a row")
def test_negative_control_plain_silu_mul_depends_on_the_row_count():
    segments = ((0, 100), (100, 200))
    assert not _halves_match(lambda g, u: torch.cat(
        [F.silu(g[:, lo:hi]) * u[:, lo:hi] for lo, hi in segments], dim=-1))
