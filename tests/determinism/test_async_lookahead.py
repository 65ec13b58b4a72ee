"""Async scheduling with sequences at staggered positions: the scheduler holds each decoding
sequence's next block (``lookahead_until``), so steps are launched ahead even when some sequence
is always at a block boundary, and the tokens and logprobs stay those of the synchronous engine.
The CUDA graphs are stood in for by eager forwards (``tests/eager_graphs.py``), so the runner
takes its graph branch and launches ahead on CPU. Controls: without the lookahead the same
workload launches far fewer steps ahead; steps launched ahead that read wrong input ids change
the outputs (the comparison sees what a served step computed)."""

from __future__ import annotations

import torch

from samebits import LLM, SamplingParams
from samebits.engine.runner import ModelRunner
from tests.eager_graphs import EagerGraphs

PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(3 + i)] for i in range(8)]  # 3..10 tokens
PARAMS = SamplingParams(max_tokens=12, temperature=0.8, seed=5, logprobs=1, ignore_eos=True)


def _generate(model_dir, lookahead: bool | None) -> tuple[list, int]:
    """Outputs and steps served ahead: ``lookahead`` None is the synchronous engine."""
    llm = LLM(str(model_dir), seed=0, block_size=4, async_scheduling=lookahead is not None)
    runner = llm.engine.runner
    if lookahead is not None:
        runner.graphs = EagerGraphs(runner)
        llm.engine.scheduler.lookahead_until = llm.engine.max_model_len if lookahead else 0
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], \
        runner.ahead_steps_used


def test_staggered_decodes_are_launched_ahead_with_the_synchronous_bits(tiny_llama_dir):
    want, _ = _generate(tiny_llama_dir, None)
    got, ahead = _generate(tiny_llama_dir, True)
    assert got == want
    _, without = _generate(tiny_llama_dir, False)
    assert ahead >= 8 and ahead >= 3 * without, (ahead, without)


def test_negative_control_steps_launched_ahead_with_wrong_ids_differ(tiny_llama_dir,
                                                                      monkeypatch):
    """Each sampled token shifted by one before a step launched ahead reads it: the served
    steps compute other tokens, so the equality above can fail."""
    want, _ = _generate(tiny_llama_dir, None)
    real = ModelRunner._launch_ahead

    def shifted(self, seqs, decode, tokens):
        real(self, seqs, decode, torch.where(tokens > 1, tokens - 1, tokens + 1))

    monkeypatch.setattr(ModelRunner, "_launch_ahead", shifted)
    got, ahead = _generate(tiny_llama_dir, True)
    assert ahead >= 8
    assert got != want
