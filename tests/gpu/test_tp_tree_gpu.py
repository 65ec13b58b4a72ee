"""Tensor parallel 2 over 8 KV-head segments on two GPUs (NCCL): each rank gathers one fp32 sum.

What the tests prove, for a tiny Qwen3 with 8 KV heads (S = 8 segments run as C = 2 K chains on
CUDA, 4 segments merged in each, one chain a rank): TP 2 (CUDA graphs) returns bitwise the tokens
and logprobs of the default one-GPU engine (two chains); every fp32 ``all_gather`` of a
row-parallel layer sends one [1, T, H] sum. Negative control: one GPU over all 8 segments as
chains differs. Skipped without 2 CUDA devices.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

from samebits import LLM  # noqa: E402
from samebits.models.parallel import RowParallelLinear  # noqa: E402
from samebits.ops.backend import chain_bounds  # noqa: E402
from tests.gpu.test_tp_gpu import OPTIONS, _generate  # noqa: E402

EIGHT_KV = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 4096, "hidden_size": 512,
            "intermediate_size": 1536, "num_hidden_layers": 3, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 32, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": False,
            "eos_token_id": 1}


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tree") / "config.json"
    path.write_text(json.dumps(EIGHT_KV))
    return str(path)


@pytest.fixture(scope="module")
def tp2(config, tmp_path_factory) -> tuple[list, list[dict]]:
    """TP 2's outputs and rank 0's collectives (``SAMEBITS_TP_TRACE``), its sums gathered by
    NCCL (``SAMEBITS_TP_PUSH=0``; the push's slots are the same values, tests/gpu/
    test_tp_push_gpu.py)."""
    traces = tmp_path_factory.mktemp("trace")
    variables = {"SAMEBITS_TP_TRACE": str(traces), "SAMEBITS_TP_PUSH": "0"}
    os.environ.update(variables)  # read by both ranks at connect
    try:
        llm = LLM(config, tensor_parallel_size=2, **OPTIONS)
    finally:
        for name in variables:
            del os.environ[name]
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    outs = _generate(llm)
    lines = (traces / "rank-0.jsonl").read_text().splitlines()
    return outs, [json.loads(line) for line in lines]


def test_tp_2_equals_the_default_one_gpu_engine(config, tp2):
    llm = LLM(config, **OPTIONS)
    chains = [len(m.k_bounds) for m in llm.engine.runner.model.modules()
              if isinstance(m, RowParallelLinear)]
    assert chains == [2] * 6  # o_proj and down_proj of 3 layers: 4 segments a chain
    assert _generate(llm) == tp2[0]


def test_negative_control_one_gpu_over_all_8_segments_differs_from_tp_2(config, tp2):
    llm = LLM(config, enforce_eager=True, **OPTIONS)  # eager: the chains are read as it runs
    for m in llm.engine.runner.model.modules():
        if isinstance(m, RowParallelLinear):
            m.k_bounds = chain_bounds(m.weight.shape[1], 8, 8)
    assert _generate(llm) != tp2[0]


def test_each_rank_gathers_its_chains_fp32_sum_per_row_parallel_layer(tp2):
    """The row-parallel layers run their gathered path: fp32 gathers of [1, T, hidden] (the
    rank's one chain, summed in fp32 before any cast; the LM head's fp32 gathers are
    [1, T, vocab / 2])."""
    sums = [e for e in tp2[1] if e["op"] == "all_gather" and e["dtype"] == "float32"
            and e["shape"][-1] == EIGHT_KV["hidden_size"]]
    assert sums, "no fp32 all_gather: the row-parallel layers did not run their gathered path"
    assert all(e["shape"][0] == 1 for e in sums), sums[:3]
