"""Prefill and mixed steps through the piecewise CUDA graphs' forward: the model under the
graphs' splitter over the padded rows of a token bucket, each layer's attention run between the
pieces over the real rows (``tests/eager_graphs.py`` stands in for the CUDA replay on CPU, in
the replay's order). The tokens and logprobs are the eager engine's, bit for bit, with chunked
prefills, decodes joining prefills and prompt logprobs. Control: padding rows whose K/V is
written to a real block instead of the scratch block change them. The CUDA replay itself is
checked against the eager engine in tests/gpu/test_piecewise_gpu.py."""

from __future__ import annotations

import pytest
import torch

from samebits import LLM, SamplingParams
from samebits.engine.piecewise_graph import token_bucket, token_buckets
from tests.eager_graphs import EagerPiecewise

PROMPTS = [[(11 * i + j) % 250 + 1 for j in range(5 + 9 * i)] for i in range(6)]  # 5..50 tokens
PARAMS = [SamplingParams(max_tokens=8, temperature=0.7 * (i % 2), seed=i, logprobs=2,
                         prompt_logprobs=1 if i == 3 else None, ignore_eos=True)
          for i in range(6)]


def _generate(model_dir, piecewise: bool, pad_slot: int | None = None) -> tuple[list, int]:
    """Outputs (tokens, logprobs, prompt logprobs) and the steps the piecewise forward ran."""
    llm = LLM(str(model_dir), seed=0, block_size=4, max_num_batched_tokens=40, max_num_seqs=4)
    runner = llm.engine.runner
    if piecewise:
        runner.piecewise = EagerPiecewise(runner, 40, pad_slot)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    steps = runner.piecewise.steps if piecewise else 0
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs)
            for o in outs], steps


def test_buckets_cover_every_token_count_with_the_smallest_bucket_that_fits():
    for max_tokens in (1, 16, 17, 100, 512, 2000, 2048):
        buckets = token_buckets(max_tokens)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens
        for n in range(1, max_tokens + 1):
            picked = min(token_bucket(n), buckets[-1])
            assert picked in buckets and picked >= n
            assert all(b < n for b in buckets if b < picked)
    assert token_buckets(2048) == [16, 32, 64, 128, 256, 512, 1024, 1536, 2048]


def test_piecewise_forward_of_mixed_steps_has_the_eager_engines_bits(tiny_llama_dir):
    want, _ = _generate(tiny_llama_dir, piecewise=False)
    got, steps = _generate(tiny_llama_dir, piecewise=True)
    assert steps >= 10
    assert got == want


@pytest.mark.parametrize("pad_slot", [0, 4])
def test_negative_control_padding_written_to_a_real_block_changes_the_outputs(tiny_llama_dir,
                                                                              pad_slot):
    want, _ = _generate(tiny_llama_dir, piecewise=False)
    got, _ = _generate(tiny_llama_dir, piecewise=True, pad_slot=pad_slot)
    assert got != want


def test_hidden_states_of_prompt_chunks_are_the_callers_and_equal_one_pass(tiny_llama_dir,
                                                                         monkeypatch):
    """``prompt_hidden`` in two chunks of one bucket through the piecewise forward, whose result
    is a view of its bucket's buffer: ``all_hidden`` hands each chunk's rows over as the
    caller's own, so the chunks equal one eager pass. Control: without that copy the second
    chunk's forward overwrites the first chunk's rows."""
    llm = LLM(str(tiny_llama_dir), seed=0, block_size=4, max_num_batched_tokens=40, max_num_seqs=4)
    engine, runner = llm.engine, llm.engine.runner
    ids = PROMPTS[5][:20]
    whole = engine.prompt_hidden(ids)
    runner.piecewise = EagerPiecewise(runner, 40)
    assert torch.equal(engine.prompt_hidden(ids, chunks=[10, 10]), whole)
    assert runner.piecewise.steps == 2
    monkeypatch.setattr(runner, "all_hidden", torch.inference_mode()(
        lambda batch: runner._forward(runner.prepare(batch).forward)))
    assert not torch.equal(engine.prompt_hidden(ids, chunks=[10, 10]), whole)
