"""examples/rl_grpo.py end to end for one tiny step in each mode: the batch-invariant run's trainer
reproduces the sampler's logprobs exactly (KL == 0.0), the standard run's does not."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_grpo.py"


def _example():
    spec = importlib.util.spec_from_file_location("rl_grpo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("standard", [False, True])
def test_grpo_example_kl_is_zero_only_in_invariant_mode(standard, tmp_path):
    ex = _example()
    argv = ["--steps", "1", "--prompts", "1", "--group-size", "2", "--max-tokens", "4"]
    argv += ["--standard"] if standard else ["--plot", str(tmp_path / "grpo.png")]
    (rec,) = ex.run(ex.parse_args(argv))
    if standard:
        assert rec["kl"] != 0.0 and rec["max_abs_logprob_diff"] > 0.0
    else:
        assert rec["kl"] == 0.0 and rec["max_abs_logprob_diff"] == 0.0
        assert (tmp_path / "grpo.png").stat().st_size > 0
    assert 0.0 <= rec["reward"] <= 1.0
