"""Tensor parallel 2 over 8 KV-head segments on two GPUs (NCCL): each rank gathers one fp32 sum.

What the tests prove, for a tiny Qwen3 with 8 KV heads (S = 8 segments run as C = 2 K chains on
CUDA, one a rank): TP 2 (CUDA graphs) returns bitwise the tokens and logprobs of one GPU whose
row-parallel layers call the Triton linear over both chains (``linear(..., k_bounds)``); every
fp32 ``all_gather`` the ranks issue sends one [1, T, H] sum. Skipped without 2 CUDA devices.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

from samebits import LLM  # noqa: E402
from samebits.models.parallel import RowParallelLinear  # noqa: E402
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
    """TP 2's outputs and rank 0's collectives (``SAMEBITS_TP_TRACE``)."""
    traces = tmp_path_factory.mktemp("trace")
    os.environ["SAMEBITS_TP_TRACE"] = str(traces)  # read by both ranks at connect
    try:
        llm = LLM(config, tensor_parallel_size=2, **OPTIONS)
    finally:
        del os.environ["SAMEBITS_TP_TRACE"]
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    outs = _generate(llm)
    lines = (traces / "rank-0.jsonl").read_text().splitlines()
    return outs, [json.loads(line) for line in lines]


def _segmented(m: RowParallelLinear, ops, x: torch.Tensor) -> torch.Tensor:
    return ops.linear(x, m.weight, m.bias, k_bounds=m.k_bounds)


def test_tp_2_equals_one_gpu_triton_chained_linear(config, tp2):
    llm = LLM(config, enforce_eager=True, **OPTIONS)
    for m in llm.engine.runner.model.modules():
        if isinstance(m, RowParallelLinear):
            assert len(m.k_bounds) == 2
            m.forward = lambda ops, x, m=m: _segmented(m, ops, x)
    assert _generate(llm) == tp2[0]


def test_each_rank_gathers_one_fp32_sum_per_row_parallel_layer(tp2):
    """The row-parallel layers' gathers (fp32, [k, T, hidden]; the LM head's fp32 gathers are
    [1, T, vocab / 2]) send k = 1 sum: the rank's one chain."""
    sums = [e for e in tp2[1] if e["op"] == "all_gather" and e["dtype"] == "float32"
            and e["shape"][-1] == EIGHT_KV["hidden_size"]]
    assert sums, "no fp32 all_gather: the row-parallel layers did not run their gathered path"
    assert all(e["shape"][0] == 1 for e in sums), sums[:3]
