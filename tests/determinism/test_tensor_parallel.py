"""Tensor parallel keeps the bits, and the default engine has them: on CPU (gloo), ``LLM()`` (one
device, ``tensor_parallel_size`` left at 1), ``tensor_parallel_size=1`` and a model sharded over 2
and 3 processes (each rank building and loading only its shard) return bitwise the same tokens,
logprobs, scores and fingerprint, and a prompt scored through TP equals its generation; a weight
update reaches every rank, and ``named_weights`` gathers every rank's parts into TP 1's weights.
Negative controls: the plain unsegmented arithmetic (one K chain for o_proj and down_proj) gives
other bits on the same inputs, and adding the same partials grouped by rank first (what an all-
reduce of rank sums does) changes the sum with N."""

from __future__ import annotations

import pytest
import torch

from samebits import LLM, SamplingParams
from tests.tiny_models import TP_LLAMA_CONFIG, write_config

PROMPTS = [[1, 2, 3, 4, 5], [7] * 20, list(range(10, 50))]
PARAMS = [SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True),
          SamplingParams(max_tokens=6, ignore_eos=True),
          SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)]


def _outputs(llm: LLM) -> tuple[list, list, str]:
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS)]
    scored = llm.score([PROMPTS[1] + outs[1].token_ids])
    return [(o.token_ids, o.token_logprobs) for o in outs], scored, llm.fingerprint


def shutdown(llm: LLM) -> None:
    llm.engine.runner.shutdown()


def _run(path: str, **options) -> tuple[list, list, str]:
    llm = LLM(path, load_format="dummy", num_kv_blocks=64, **options)
    try:
        return _outputs(llm)
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def dummy_config(tmp_path_factory) -> str:
    path = write_config(tmp_path_factory.mktemp("tp"), TP_LLAMA_CONFIG)
    return str(path)


@pytest.fixture(scope="module")
def default_run(dummy_config) -> tuple[list, list, str]:
    """``LLM(path)`` with no tensor-parallel option: one device, the default arithmetic."""
    return _run(dummy_config)


def test_default_llm_equals_tp_1_bitwise(dummy_config, default_run):
    outs, scored, fp = default_run
    assert outs[1][1] == scored[0][len(PROMPTS[1]) - 1:]  # score == generate
    assert _run(dummy_config, tensor_parallel_size=1) == (outs, scored, fp)


@pytest.mark.parametrize("n", [2, 3])
def test_tp_n_gloo_processes_equal_default_llm_bitwise(dummy_config, default_run, n):
    outs, scored, fp = _run(dummy_config, tensor_parallel_size=n)
    assert outs == default_run[0], f"TP={n} differs from LLM()"
    assert scored == default_run[1] and fp == default_run[2]


def test_negative_control_plain_unsegmented_arithmetic_differs(dummy_config, default_run):
    """The same engine with o_proj and down_proj as one K chain each (no segments)."""
    llm = LLM(dummy_config, load_format="dummy", num_kv_blocks=64)
    for layer in llm.engine.runner.model.layers:
        layer.self_attn.o_proj.k_bounds = layer.mlp.down_proj.k_bounds = None
    plain, plain_scored, _ = _outputs(llm)
    assert plain != default_run[0] and plain_scored != default_run[1]


def _new_weights(path: str) -> list[tuple[str, torch.Tensor]]:
    """Every row-parallel, column-parallel and vocab-parallel kind of weight, changed."""
    llm = LLM(path, load_format="dummy", num_kv_blocks=64, seed=1)  # other random weights
    wanted = ("layers.0.self_attn.o_proj", "layers.1.mlp.down_proj", "layers.0.self_attn.q_proj",
              "layers.1.mlp.up_proj", "embed_tokens", "lm_head", "layers.0.input_layernorm")
    return [(n, t.clone()) for n, t in llm.named_weights() if any(w in n for w in wanted)]


def _run_updated(path: str, new, **options) -> tuple[tuple[list, list, str], dict]:
    """The outputs after ``update_weights(new)``, and every weight as ``named_weights`` gives it
    (under TP: every rank's parts gathered)."""
    llm = LLM(path, load_format="dummy", num_kv_blocks=64, **options)
    try:
        llm.update_weights(new)
        return _outputs(llm), {n: t.clone() for n, t in llm.named_weights()}
    finally:
        shutdown(llm)


def test_update_weights_reaches_every_rank_tp_2_equals_tp_1(dummy_config, default_run):
    new = _new_weights(dummy_config)
    assert len(new) == 7
    one, one_weights = _run_updated(dummy_config, new)
    assert one[0] != default_run[0] and one[2] != default_run[2]  # the update changed the bits
    two, two_weights = _run_updated(dummy_config, new, tensor_parallel_size=2)
    assert two == one
    assert one_weights.keys() == two_weights.keys()
    assert all(torch.equal(one_weights[n], two_weights[n]) for n in one_weights)
    assert all(torch.equal(one_weights[n], t) for n, t in new)


def test_negative_control_rank_grouped_sums_depend_on_n():
    gen = torch.Generator().manual_seed(0)
    parts = torch.randn(6, 64, 96, generator=gen) * torch.logspace(0, 3, 96)

    def grouped(n: int) -> torch.Tensor:  # each rank adds its own segments, then ranks are added
        sums = [p.sum(0) for p in parts.split(6 // n)]
        acc = sums[0].clone()
        for s in sums[1:]:
            acc += s
        return acc

    assert not torch.equal(grouped(2), grouped(3))


@pytest.mark.slow
def test_default_model_tp_3_equals_default_llm():
    """SmolLM2-135M: 9 query heads, 3 KV heads, so N = 3."""
    texts = ["The sea is", "Write one sentence about reproducibility."]
    params = SamplingParams(max_tokens=4, temperature=0.8, seed=5)
    got = {}
    for n in (1, 3):
        llm = LLM(tensor_parallel_size=n, num_kv_blocks=64)
        got[n] = [(o.outputs[0].token_ids, o.outputs[0].token_logprobs)
                  for o in llm.generate(texts, params)]
        shutdown(llm)
    assert got[3] == got[1]
