"""Prompt logprobs collected while a request is prefilled for generation
(``SamplingParams.prompt_logprobs``) are bitwise ``LLM.score``'s values: with the prompt prefilled
in small chunks beside decoding neighbours, and with its prefix already in the prefix cache (a
request asking for prompt logprobs computes every position). No negative control here: on the
CPU machines tried, the standard numerics' chunked prefill also gave score's bits (the chunk
sizes' MKL paths agreed); the invariance of chunked prefill itself is controlled in
test_batch_invariance.py."""

from __future__ import annotations

from samebits import LLM, SamplingParams

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
