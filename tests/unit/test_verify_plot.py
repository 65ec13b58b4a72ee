"""``samebits verify --plot``: without matplotlib the option is refused when the arguments are
parsed, before any work, naming the extra to install; with it, the results are printed before
the plot is drawn (a failing plot cannot swallow them)."""

from __future__ import annotations

import importlib.util
import json

import pytest

import samebits.tools.audit
import samebits.tools.verify
from samebits.cli import build_parser
from samebits.cli import main as cli_main
from samebits.tools.verify import CheckResult


def test_plot_without_matplotlib_is_refused_at_parse_time(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["verify", "--url", "http://127.0.0.1:1", "--plot", "x.png"])
    assert "samebits[plot]" in capsys.readouterr().err


def test_results_are_printed_before_the_plot(monkeypatch, capsys, tmp_path):
    result = CheckResult("identical concurrent", 2, 1, (None, None))
    monkeypatch.setattr(samebits.tools.audit, "audit", lambda config: ("m", [result]))

    def failing_plot(*args):
        raise RuntimeError("plotting failed")

    monkeypatch.setattr(samebits.tools.verify, "plot", failing_plot)
    with pytest.raises(RuntimeError, match="plotting failed"):
        cli_main(["verify", "--url", "http://127.0.0.1:1", "--plot", str(tmp_path / "p.png")])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["name"] == "identical concurrent" and lines[-1]["ok"] is True
