"""Prompt logprobs collected while a request is prefilled for generation
(``SamplingParams.prompt_logprobs``) are bitwise ``LLM.score``'s values: with the prompt prefilled
in small chunks beside decoding neighbours, and with its prefix already in the prefix cache (a
request asking for prompt logprobs computes every position). No negative control here: on the
CPU machines tried, the standard numerics' chunked prefill also gave score's bits (the chunk
sizes' MKL paths agreed); the invariance of chunked prefill itself is controlled in
test_batch_invariance.py."""

from __future__ import annotations

from samebits import LLM, SamplingParams
from tests.eager_graphs import EagerGraphs

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs away. " * 3


def _chunked_prompt_logprobs(llm: LLM, ids: list[int]) -> list[float]:
    neighbours = [llm.tokenizer.encode(f"Tell me about the number {i}.") for i in range(3)]
    params = [SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)] + [
        SamplingParams(max_tokens=6, temperature=0.8, seed=i) for i in range(3)]
    out = llm.generate([ids] + neighbours, params)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    assert out.num_cached_tokens == 0
    return [out.prompt_logprobs[i + 1][ids[i + 1]].logprob for i in range(len(ids) - 1)]


def test_prompt_logprobs_equal_score_chunked_beside_neighbours_with_a_cached_prefix():
    llm = LLM(max_num_batched_tokens=3, num_kv_blocks=64)
    ids = llm.tokenizer.encode(TEXT)
    llm.generate(ids, SamplingParams(max_tokens=1))  # its blocks are now in the prefix cache
    assert _chunked_prompt_logprobs(llm, ids) == llm.score([ids])[0]


def test_prompt_logprobs_survive_decode_steps_taken_as_graph_replays(tiny_llama_dir):
    """A request keeping prompt logprobs that then decodes through the graph branch (CUDA's
    decode path, stood in for by eager forwards): its decode steps carry no prompt span, and
    the engine must not expect one (it raised StopIteration at the first graph step)."""
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, prompt_logprobs=1)
    prompts = [[5, 17, 42, 99, 7, 3, 250, 11], [8, 9, 10]]  # the tiny model's vocabulary: 256
    eager = LLM(str(tiny_llama_dir), seed=0, async_scheduling=False)
    want = eager.generate(prompts, params, use_tqdm=False)
    graphed = LLM(str(tiny_llama_dir), seed=0, async_scheduling=False)
    graphed.engine.runner.graphs = EagerGraphs(graphed.engine.runner)
    got = graphed.generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, got, strict=True):
        assert a.prompt_logprobs == b.prompt_logprobs
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
