"""Tensor parallel keeps the bits: on CPU (gloo), a model sharded over 2 and 3 processes returns
bitwise the tokens and logprobs of ``tensor_parallel_size=1`` (the same segmented arithmetic on one
process), and a prompt scored through TP equals its generation. Negative controls: the plain
single-device arithmetic (no segments) gives other bits, and adding the same partials grouped by
rank first (what an all-reduce of rank sums does) changes the sum with N."""

from __future__ import annotations

import json

import pytest
import torch

from samebits import LLM, SamplingParams
from samebits.distributed import shutdown

# 12 query heads, 6 KV heads: N = 1, 2, 3 (and 6) divide them; odd sizes exercise uneven slices
CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 500, "hidden_size": 96,
          "intermediate_size": 200, "num_hidden_layers": 2, "num_attention_heads": 12,
          "num_key_value_heads": 6, "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "max_position_embeddings": 256, "tie_word_embeddings": False, "eos_token_id": 499}
PROMPTS = [[1, 2, 3, 4, 5], [7] * 20, list(range(10, 50))]
PARAMS = [SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True),
          SamplingParams(max_tokens=6, ignore_eos=True),
          SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)]


def _run(path: str, tp: int | None) -> tuple[list, list, str]:
    llm = LLM(path, load_format="dummy", tensor_parallel_size=tp, num_kv_blocks=64)
    try:
        outs = llm.generate(PROMPTS, PARAMS)
        outs = [o.outputs[0] for o in outs]
        scored = llm.score([PROMPTS[1] + outs[1].token_ids])
        return [(o.token_ids, o.logprobs) for o in outs], scored, llm.fingerprint
    finally:
        if tp is not None:
            shutdown(llm)


@pytest.fixture(scope="module")
def dummy_config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tp") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return str(path)


def test_tp_2_and_3_gloo_processes_equal_tp_1_bitwise(dummy_config):
    one, one_scored, fp1 = _run(dummy_config, 1)
    assert one[1][1] == one_scored[0][len(PROMPTS[1]) - 1:]  # score == generate under TP
    for n in (2, 3):
        outs, scored, fp = _run(dummy_config, n)
        assert outs == one, f"TP={n} differs from TP=1"
        assert scored == one_scored and fp == fp1


def test_negative_control_plain_arithmetic_differs_from_segmented(dummy_config):
    plain, _, fp_plain = _run(dummy_config, None)
    segmented, _, fp = _run(dummy_config, 1)
    assert plain != segmented and fp_plain != fp


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
def test_default_model_tp_3_equals_tp_1():
    """SmolLM2-135M: 9 query heads, 3 KV heads, so N = 3."""
    texts = ["The sea is", "Write one sentence about reproducibility."]
    params = SamplingParams(max_tokens=4, temperature=0.8, seed=5)
    got = {}
    for n in (1, 3):
        llm = LLM(tensor_parallel_size=n, num_kv_blocks=64)
        got[n] = [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                  for o in llm.generate(texts, params)]
        shutdown(llm)
    assert got[3] == got[1]
