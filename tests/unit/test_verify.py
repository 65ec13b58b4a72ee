"""The comparison behind ``samebits verify``: first divergent token position, distinct outputs;
and the local verify with a plot (the engine alone vs batched)."""

from __future__ import annotations

import json

from samebits.cli import main
from samebits.tools.verify import compare, first_divergence


def test_first_divergence_is_the_first_differing_token_or_the_shorter_length():
    a = [(1, -0.5), (2, -1.0), (3, -2.0)]
    assert first_divergence(a, list(a)) is None
    assert first_divergence(a, [(1, -0.5), (2, -1.0000001), (3, -2.0)]) == 1
    assert first_divergence(a, a[:2]) == 2


def test_compare_counts_distinct_outputs_and_differing_requests():
    ref = [(1, -0.5)]
    r = compare("x", [ref, ref, [(1, -0.25)]], [ref, ref, ref])
    assert (r.distinct, r.first_divergence, r.ok) == (2, (None, None, 0), False)
    other = [(2, -0.5)]
    assert compare("y", [ref, other], [ref, other]).distinct == 1


def test_local_verify_is_bitwise_and_plots(tmp_path, capsys):
    plot = tmp_path / "local.svg"
    assert main(["verify", "-n", "3", "--max-tokens", "4", "--plot", str(plot)]) == 0
    last = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert last["ok"] and last["bitwise_equal"] == 3
    assert b"<svg" in plot.read_bytes()
