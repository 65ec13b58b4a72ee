"""Tensor parallel keeps a mixture of experts' bits (CPU, gloo): tiny random Qwen2-MoE (a shared
expert with its sigmoid gate, qkv bias), Qwen3-MoE and Mixtral checkpoints written by transformers return
bitwise the same tokens, logprobs, scores and fingerprint from ``LLM(path)`` on one device and
from two processes, each holding half of the experts whole (expert parallel) and half of the
attention and dense MLPs; an update of experts held by either rank, and of the router, reaches
the rank that holds them, and ``named_weights`` gathers one device's weights. Negative control
(``tests/unit/test_moe.py``): summing each rank's own weighted experts first -- the usual expert-
parallel all-reduce -- gives other bits than the one-device combine; and here the standard mode
(stock per-expert matmuls and combine, an all-reduce of the attention's partial sums) differs
between TP 1 and TP 2 on the same inputs."""

from __future__ import annotations

import pytest
import torch

from samebits import LLM, SamplingParams
from tests.moe_models import write_tiny_moe

pytest.importorskip("transformers")

PROMPTS = [[1, 2, 3, 4, 5], [7] * 20, list(range(10, 60)), [200, 9, 31] * 7]
PARAMS = [SamplingParams(max_tokens=8, temperature=0.9, seed=3, ignore_eos=True),
          SamplingParams(max_tokens=8, ignore_eos=True),
          SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True),
          SamplingParams(max_tokens=6, ignore_eos=True)]
# experts held by rank 0 (1, 4) and rank 1 (6) and the router, as Qwen and Mixtral name them
UPDATED = ("layers.0.mlp.experts.1.down_proj", "layers.0.mlp.experts.6.gate_proj",
           "layers.0.mlp.gate.weight", "layers.0.mlp.experts.4.up_proj",
           "layers.0.block_sparse_moe.experts.1.w2", "layers.0.block_sparse_moe.experts.6.w1",
           "layers.0.block_sparse_moe.gate.weight", "layers.0.block_sparse_moe.experts.4.w3")


def _outputs(llm: LLM) -> tuple[list, list, str]:
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS)]
    scored = llm.score([PROMPTS[1] + outs[1].token_ids])
    return [(o.token_ids, o.token_logprobs) for o in outs], scored, llm.fingerprint


def _run(path: str, new=None, **options) -> tuple[tuple[list, list, str], dict]:
    """The outputs (after ``update_weights(new)``, if given) and every weight as
    ``named_weights`` gives it."""
    llm = LLM(path, num_kv_blocks=64, **options)
    try:
        if new is not None:
            llm.update_weights(new)
        return _outputs(llm), {n: t.clone() for n, t in llm.named_weights()}
    finally:
        llm.engine.runner.shutdown()


@pytest.fixture(scope="module", params=["qwen2_moe", "qwen3_moe", "mixtral"])
def moe(request, tmp_path_factory):
    """(model dir, ``LLM(path)``'s outputs and weights: one device)."""
    path = tmp_path_factory.mktemp(request.param)
    write_tiny_moe(request.param, path)
    return str(path), _run(str(path))


def test_moe_tp_2_equals_one_device_bitwise(moe):
    path, (one, one_weights) = moe
    two, two_weights = _run(path, tensor_parallel_size=2)
    assert two == one, "TP=2 differs from LLM()"
    assert one_weights.keys() == two_weights.keys()
    assert all(torch.equal(one_weights[n], two_weights[n]) for n in one_weights)


def test_expert_updates_reach_the_rank_holding_them_tp_2_equals_tp_1(moe):
    path, (before, weights) = moe
    gen = torch.Generator().manual_seed(7)
    new = [(n, torch.randn(t.shape, generator=gen) * t.std())
           for n, t in weights.items() if any(u in n for u in UPDATED)]
    assert len(new) == 4
    one, one_weights = _run(path, new)
    assert one[0] != before[0] and one[2] != before[2]  # the update changed the bits
    two, two_weights = _run(path, new, tensor_parallel_size=2)
    assert two == one
    assert all(torch.equal(one_weights[n], two_weights[n]) for n in one_weights)
    assert all(torch.equal(one_weights[n], t) for n, t in new)


def test_negative_control_standard_mode_tp_2_differs_from_its_tp_1_within_rounding(moe):
    """The control differs in bits, and only there: its greedy tokens and fp32 scores agree
    (a standard TP path computing something else would not)."""
    path, _ = moe
    (one, _), (two, _) = (_run(path, tensor_parallel_size=n, batch_invariant=False)
                          for n in (1, 2))
    assert [lp for _, lp in one[0]] != [lp for _, lp in two[0]] or one[1] != two[1]
    assert [one[0][i][0] for i in (1, 3)] == [two[0][i][0] for i in (1, 3)]  # greedy tokens
    assert torch.allclose(torch.tensor(one[1][0]), torch.tensor(two[1][0]), rtol=0, atol=1e-4)
