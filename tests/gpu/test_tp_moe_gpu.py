"""A mixture of experts under tensor parallel on two GPUs (NCCL); skipped without 2 CUDA devices.

What the tests prove: Qwen3-30B-A3B's shapes (4 of its 48 layers, 128 experts, top 8, dummy
bf16) at TP 2 -- each rank holding 64 whole experts and half of the attention, with CUDA graphs
-- return bitwise the tokens, logprobs, scores and fingerprint of the default one-GPU engine, at
batch 1 (one block per assignment) and batch 6 (the aligned layout) and through prefill; each
rank holds about half of the weights. Negative control: the standard mode (stock grouped GEMMs,
NCCL all-reduce of the attention's partial sums, torch's combine) differs between TP 1 and TP 2
on the same inputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

from samebits import LLM, SamplingParams  # noqa: E402

MOE = str(Path(__file__).parents[2] / "benchmarks" / "configs" / "qwen3-30b-a3b-4layers.json")
PROMPTS = [[3 + i] * (5 + 37 * i) for i in range(6)]
PARAMS = [SamplingParams(max_tokens=16, temperature=0.8 * (i % 2), seed=i, ignore_eos=True)
          for i in range(6)]
OPTIONS = dict(load_format="dummy", dtype="bfloat16", seed=0, max_num_seqs=8,
               kv_cache_memory_bytes=1 << 30, max_model_len=2048)


def _outputs(llm: LLM) -> tuple:
    """(batch of 6, the first request alone, a score, the fingerprint, weight bytes per rank)."""
    try:
        batch = [(o.outputs[0].token_ids, o.outputs[0].token_logprobs)
                 for o in llm.generate(PROMPTS, PARAMS)]
        alone = llm.generate(PROMPTS[:1], PARAMS[:1])[0].outputs[0]
        scored = llm.score([PROMPTS[3] + batch[3][0]])
        return (batch, (alone.token_ids, alone.token_logprobs), scored, llm.fingerprint,
                llm.engine.runner.weight_bytes())
    finally:
        llm.engine.runner.shutdown()


def test_moe_tp_2_equals_tp_1_in_tokens_logprobs_scores_and_fingerprint():
    one = _outputs(LLM(MOE, **OPTIONS))
    torch.cuda.empty_cache()
    llm = LLM(MOE, tensor_parallel_size=2, **OPTIONS)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    two = _outputs(llm)
    assert two[:4] == one[:4]
    assert one[1] == one[0][0]  # alone == in the batch
    (whole,), halves = one[4], two[4]
    assert len(halves) == 2 and all(abs(b - whole / 2) < 0.03 * whole for b in halves), halves


def test_negative_control_standard_mode_tp_2_differs_from_tp_1():
    one = _outputs(LLM(MOE, batch_invariant=False, **OPTIONS))
    torch.cuda.empty_cache()
    two = _outputs(LLM(MOE, batch_invariant=False, tensor_parallel_size=2, **OPTIONS))
    assert [lp for _, lp in one[0]] != [lp for _, lp in two[0]]
