"""The command line: ``python -m samebits`` works, every option of every command has a help line
and shows its default, the engine options become an ``EngineConfig`` through one builder, and
``generate -v`` prints its JSON on stdout."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from samebits.cli import build_parser
from samebits.cli import main as cli_main
from samebits.config import EngineConfig


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_python_m_samebits_shows_help():
    out = subprocess.run([sys.executable, "-m", "samebits", "--help"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "generate" in out.stdout and "serve" in out.stdout


def test_every_option_has_help_and_shows_its_default():
    for name, sub in _subparsers(build_parser()).items():
        assert sub.formatter_class is argparse.ArgumentDefaultsHelpFormatter, name
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
        text = sub.format_help()
        assert "(default: 64)" in text and "(default: auto)" in text, name


@pytest.mark.smoke
def test_engine_options_become_one_engine_config():
    args = build_parser().parse_args(["serve", "--standard", "--max-model-len", "100",
                                      "--no-prefix-caching", "--max-num-seqs", "3"])
    config = EngineConfig.from_cli_args(args, seed=args.seed)
    assert (config.batch_invariant, config.max_model_len, config.enable_prefix_caching,
            config.max_num_seqs, config.seed) == (False, 100, False, 3, 0)
    bench = build_parser().parse_args(["bench", "--device", "cpu"])
    assert EngineConfig.from_cli_args(bench, batch_invariant=True).device == "cpu"


def test_generate_verbose_prints_json_on_stdout(capsys):
    assert cli_main(["generate", "Hello", "--max-tokens", "2", "-v", "--num-kv-blocks", "8"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    info = json.loads(lines[-1])
    assert len(info["token_ids"]) <= 2 and info["system_fingerprint"].startswith("fp_")


def test_cpu_bench_reports_decode_and_e2e_rates_of_all_three_engines(tiny_llama_dir, capsys):
    cli_main(["bench", "--device", "cpu", "--model", str(tiny_llama_dir), "--batch-sizes", "2",
              "--max-tokens", "3", "--repeats", "1", "--prompt-len", "4", "--threads", "1"])
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    engines = {x["engine"]: x for x in lines if "engine" in x}
    assert set(engines) == {"invariant", "standard", "transformers"}
    assert all(e["decode_tokens_per_s"] > 0 and e["e2e_tokens_per_s"] > 0 for e in engines.values())
    ratios = lines[-1]
    assert {"decode_invariant_over_standard", "decode_invariant_over_transformers",
            "e2e_invariant_over_transformers"} <= set(ratios)
