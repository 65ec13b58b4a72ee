"""Async scheduling with sequences at staggered positions: the scheduler holds each decoding
sequence's next block (``lookahead_until``), so steps are launched ahead even when some sequence
is always at a block boundary, and the tokens and logprobs stay those of the synchronous engine.
The CUDA graphs are stood in for by eager forwards (``tests/eager_graphs.py``), so the runner
takes its graph branch and launches ahead on CPU. Control: without the lookahead the same
workload launches far fewer steps ahead."""

from __future__ import annotations

from samebits import LLM, SamplingParams
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
