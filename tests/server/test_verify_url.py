"""``samebits verify --url`` audits a running OpenAI-compatible server through the openai SDK:
exit 0 against the invariant server, non-zero against the standard one (the negative control),
with one JSON line per check and a plot."""

from __future__ import annotations

import json

from samebits.cli import main
from tests.server.conftest import API_KEY

ARGS = ["-n", "6", "--max-tokens", "6"]


def _lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_verify_url_passes_on_the_invariant_server_and_plots(server, tmp_path, capsys):
    plot = tmp_path / "audit.png"
    code = main(["verify", "--url", server.url, "--api-key", API_KEY, "--plot", str(plot), *ARGS])
    lines = _lines(capsys.readouterr().out)
    assert code == 0, lines
    assert [x["name"] for x in lines[:-1]] == ["identical concurrent", "batch vs alone",
                                               "stream vs non-stream", "seeded sampling repeated"]
    assert all(x["distinct"] == 1 and x["ok"] for x in lines[:-1])
    assert lines[-1]["ok"] and lines[-1]["model"] == "SmolLM2-135M-Instruct"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_negative_control_verify_url_fails_on_the_standard_server(standard_server, capsys):
    code = main(["verify", "--url", f"{standard_server.url}/v1", *ARGS])
    lines = _lines(capsys.readouterr().out)
    assert code == 1
    differing = [x for x in lines[:-1] if not x["ok"]]
    assert differing and all(
        any(d is not None for d in x["first_divergence"]) for x in differing)


def test_verify_url_without_the_api_key_is_an_error_not_a_pass(server, capsys):
    assert main(["verify", "--url", server.url, *ARGS]) == 2
