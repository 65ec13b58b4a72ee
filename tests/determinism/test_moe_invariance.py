"""Batch invariance of the mixture-of-experts decoders (tiny random Qwen3-MoE and Mixtral written
by transformers, CPU, fp32): a request's token ids and logprobs are bitwise those it gets alone
(``max_num_seqs=1``) in any batch, with chunked prefill at odd boundaries, prefix-cache hits and
preemption, and ``score(prompt + generation)`` returns the generation's logprobs. How many tokens
an expert gets depends on the neighbours; the invariant experts' bits do not. Negative control:
the standard mode (per-expert stock matmuls over the routed tokens) changes bits with the batch.
"""

from __future__ import annotations

import random

import pytest

from samebits import LLM, SamplingParams
from tests.moe_models import write_tiny_moe

pytest.importorskip("transformers")

NUM = 16
KV_BLOCKS = 256  # a small cache, quick to allocate (the default is 1 GiB)
MAX_TOKENS = 12


def _requests() -> list[tuple[list[int], SamplingParams]]:
    """16 prompts of 4 to 94 tokens (every fourth starting with a shared 40-token prefix), even
    ones greedy, odd ones sampled with their own seed."""
    rng = random.Random(0)
    corpus = [rng.randrange(256) for _ in range(400)]
    reqs = []
    for i in range(NUM):
        n = 4 + 6 * i
        prompt = corpus[:n] if i % 4 == 0 else corpus[11 * i:11 * i + n]
        params = (SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
                  if i % 2 == 0 else
                  SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95,
                                 seed=500 + i, ignore_eos=True))
        reqs.append((prompt, params))
    return reqs


def _run(llm: LLM, reqs, shuffle_seed: int | None):
    order = list(range(len(reqs)))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    outs = llm.generate([reqs[i][0] for i in order], [reqs[i][1] for i in order])
    got = [None] * len(reqs)
    for i, o in zip(order, outs, strict=True):
        got[i] = (o.outputs[0].token_ids, o.outputs[0].token_logprobs)
    return got


def _mismatches(got, want) -> list[int]:
    return [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]


@pytest.fixture(scope="module",
                params=["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def moe(request, tmp_path_factory):
    """(model dir, requests, every request's result alone)."""
    path = tmp_path_factory.mktemp(request.param)
    write_tiny_moe(request.param, path)
    reqs = _requests()
    return str(path), reqs, _run(LLM(str(path), max_num_seqs=1, num_kv_blocks=KV_BLOCKS), reqs, None)


def test_moe_bitwise_equal_alone_and_in_any_batch(moe):
    path, reqs, want = moe
    assert _mismatches(_run(LLM(path, max_num_seqs=16, num_kv_blocks=KV_BLOCKS), reqs, 1), want) == []


def test_moe_bitwise_equal_with_chunked_prefill_prefix_hits_and_preemption(moe):
    path, reqs, want = moe
    llm = LLM(path, max_num_seqs=16, max_num_batched_tokens=37, num_kv_blocks=24)
    assert _mismatches(_run(llm, reqs, 2), want) == []
    assert llm.engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    outs = llm.generate([r[0] for r in reqs], [r[1] for r in reqs])  # again: cache hits
    assert sum(o.num_cached_tokens for o in outs) > 0, "the test must exercise cache hits"
    got = [(o.outputs[0].token_ids, o.outputs[0].token_logprobs) for o in outs]
    assert _mismatches(got, want) == []


def test_moe_score_of_prompt_plus_generation_equals_generation_logprobs(moe):
    path, reqs, want = moe
    scored = LLM(path, max_num_batched_tokens=53, num_kv_blocks=KV_BLOCKS).score(
        [p + tokens for (p, _), (tokens, _) in zip(reqs, want, strict=True)])
    for (prompt, _), (_, logprobs), s in zip(reqs, want, scored, strict=True):
        assert s[len(prompt) - 1:] == logprobs


def test_moe_negative_control_standard_mode_differs_with_batch(moe):
    path, reqs, _ = moe
    some = reqs[:8]  # enough to show the variance
    alone = _run(LLM(path, max_num_seqs=1, batch_invariant=False, num_kv_blocks=KV_BLOCKS), some, None)
    batched = _run(LLM(path, max_num_seqs=16, batch_invariant=False,
                           num_kv_blocks=KV_BLOCKS), reqs, 3)[:8]
    assert _mismatches(batched, alone) != [], "standard mode should show batch variance"
