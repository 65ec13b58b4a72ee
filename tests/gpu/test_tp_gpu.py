"""Tensor parallel on two GPUs (NCCL); skipped without 2 CUDA devices.

What the tests prove: TP 2 (CUDA graphs, each rank's own KV cache and graphs) returns bitwise the
tokens and logprobs of one GPU computing the same K-chain arithmetic (its row-parallel layers
on their gathered path), and of the default one-GPU engine, which runs TP 2's two K chains
(``TritonBackend.row_parallel_chains``; one K chain instead differs: negative control); a
Qwen3-8B-shaped model starts at TP 2 with the default memory settings and each rank holds about
half of its weights, and at TP 2 returns TP 1's tokens, logprobs, scores and fingerprint (TP 1
with one K chain differs); the standard mode (an NCCL all-reduce of the partial sums) differs from its
one-GPU bits (negative control); a killed rank makes ``generate`` raise naming it within 30 s;
the two ranks issue the same NCCL and gloo collectives in the same order through start-up (KV
profiling, graph capture), steps and shutdown; shutdown returns within seconds, rank 1 exiting
by itself (code 0, no collective teardown) and rank 0 releasing its NCCL communicators alone
after destroying its CUDA graphs (which captured NCCL collectives), leaving no process group; and
a second TP 2 engine then starts in the same process and returns the first one's bits.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

from samebits import LLM, SamplingParams  # noqa: E402
from samebits.engine.executor import RankFailedError  # noqa: E402
from samebits.models.parallel import RowParallelLinear  # noqa: E402

CONFIGS = Path(__file__).parents[2] / "benchmarks" / "configs"
TINY, QWEN3_8B = str(CONFIGS / "qwen3-tiny.json"), str(CONFIGS / "qwen3-8b.json")
PROMPTS = [[3 + i] * (5 + 37 * i) for i in range(6)]
PARAMS = [SamplingParams(max_tokens=24, temperature=0.8 * (i % 2), seed=i, ignore_eos=True)
          for i in range(6)]
OPTIONS = dict(load_format="dummy", device="cuda", dtype="bfloat16", seed=0, max_num_seqs=8,
               kv_cache_memory_bytes=1 << 28)


def _generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    try:
        return [(o.outputs[0].token_ids, o.outputs[0].token_logprobs)
                for o in llm.generate(PROMPTS, PARAMS)]
    finally:
        llm.engine.runner.shutdown()


@pytest.fixture(scope="module")
def tp2() -> list:
    llm = LLM(TINY, tensor_parallel_size=2, **OPTIONS)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    return _generate(llm)


def test_tp_2_equals_one_gpu_on_the_segmented_path(tp2):
    llm = LLM(TINY, enforce_eager=True, **OPTIONS)
    for m in llm.engine.runner.model.modules():
        if isinstance(m, RowParallelLinear):
            m.forward = functools.partial(RowParallelLinear.gathered, m)
    assert _generate(llm) == tp2


def test_tp_2_equals_tp_1_default_engine(tp2):
    assert _generate(LLM(TINY, **OPTIONS)) == tp2


def test_negative_control_one_gpu_with_one_k_chain_differs_from_tp_2(tp2):
    llm = LLM(TINY, enforce_eager=True, **OPTIONS)  # eager: the chains are read as it runs
    for m in llm.engine.runner.model.modules():
        if isinstance(m, RowParallelLinear):
            m.k_bounds = None
    assert _generate(llm) != tp2


def test_negative_control_standard_mode_all_reduce_differs_from_one_gpu():
    one = _generate(LLM(TINY, batch_invariant=False, **OPTIONS))
    two = _generate(LLM(TINY, batch_invariant=False, tensor_parallel_size=2, **OPTIONS))
    assert [lp for _, lp in one] != [lp for _, lp in two]


def test_qwen3_8b_starts_at_tp_2_with_default_memory_and_half_the_weights_per_gpu():
    one_gpu_bytes = 2 * 8_190_735_360  # Qwen3-8B's parameters in bf16 (untied head)
    llm = LLM(QWEN3_8B, load_format="dummy", tensor_parallel_size=2, max_model_len=4096)
    try:
        per_rank = llm.engine.runner.weight_bytes()
        assert len(per_rank) == 2
        assert all(abs(b - one_gpu_bytes / 2) < 0.03 * one_gpu_bytes for b in per_rank), per_rank
        assert llm.engine.runner.num_blocks * llm.engine.config.block_size >= 64 * 1280
        out = llm.generate([[5] * 100] * 4, SamplingParams(max_tokens=8, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    finally:
        llm.engine.runner.shutdown()


def _tokens_logprobs_scores_fingerprint(llm: LLM) -> tuple:
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS)]
    scored = llm.score([PROMPTS[2] + outs[2].token_ids])
    return [(o.token_ids, o.token_logprobs) for o in outs], scored, llm.fingerprint


def test_qwen3_8b_tp_2_equals_tp_1_in_tokens_logprobs_scores_and_fingerprint():
    """The 8B shapes (8 KV heads: two chains of 4 on one GPU, one a rank). Negative control:
    the TP 1 engine with one K chain per linear differs."""
    options = dict(load_format="dummy", dtype="bfloat16", seed=0, max_num_seqs=8,
                   kv_cache_memory_bytes=4 << 30, max_model_len=2048)
    one = LLM(QWEN3_8B, enforce_eager=True, **options)  # eager: the chains are read as it runs
    try:
        want = _tokens_logprobs_scores_fingerprint(one)
        for m in one.engine.runner.model.modules():
            if isinstance(m, RowParallelLinear):
                m.k_bounds = None
        plain = _tokens_logprobs_scores_fingerprint(one)
    finally:
        one.engine.runner.shutdown()
    del one
    torch.cuda.empty_cache()
    two = LLM(QWEN3_8B, tensor_parallel_size=2, **options)
    try:
        assert _tokens_logprobs_scores_fingerprint(two) == want
    finally:
        two.engine.runner.shutdown()
    assert plain[:2] != want[:2]


def test_killed_rank_raises_naming_it_within_30s():
    llm = LLM(TINY, tensor_parallel_size=2, **OPTIONS)
    try:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
        os.kill(llm.engine.runner.peers.procs[1].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RankFailedError, match="rank 1"):
            llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=16))
        assert time.monotonic() - start < 30
    finally:
        llm.engine.runner.shutdown()


def _trace(directory: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (directory / f"rank-{rank}.jsonl").read_text().splitlines()]


def test_ranks_issue_the_same_collectives_and_shutdown_returns_within_seconds(tmp_path,
                                                                                monkeypatch):
    monkeypatch.setenv("SAMEBITS_TP_TRACE", str(tmp_path))  # read by both ranks at connect
    llm = LLM(TINY, tensor_parallel_size=2, load_format="dummy", device="cuda",
              dtype="bfloat16", max_num_seqs=4, max_model_len=512, gpu_memory_utilization=0.5)
    runner = llm.engine.runner
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=8, ignore_eos=True))
    rank_1, start = runner.peers.procs[1], time.monotonic()
    runner.shutdown()
    assert time.monotonic() - start < 10 and rank_1.exitcode == 0
    assert not torch.distributed.is_initialized()  # rank 0 released its side
    rank_0 = _trace(tmp_path, 0)
    assert rank_0 == _trace(tmp_path, 1)
    ops = {e["op"] for e in rank_0}
    assert {"broadcast_object:replay", "broadcast_tensor", "all_gather", "min_int"} <= ops


def test_a_second_tp_2_engine_in_the_same_process_returns_the_same_bits(tp2):
    llm = LLM(TINY, tensor_parallel_size=2, **OPTIONS)  # after the fixture's engine shut down
    assert llm.engine.runner.graphs is not None
    assert _generate(llm) == tp2
    assert not torch.distributed.is_initialized()
