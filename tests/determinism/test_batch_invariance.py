"""The strict criterion: a request's token ids and logprobs do not depend on what else runs.

Every test compares against the same reference (each request alone) with exact equality.
"""

from __future__ import annotations

import pytest

from samebits import LLM
from tests.determinism.workload import run_shuffled


def _mismatches(got, want) -> list[int]:
    return [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]


@pytest.mark.parametrize("max_num_seqs,shuffle_seed", [(4, 1), (16, 2), (64, 3)])
def test_tokens_and_logprobs_bitwise_equal_alone_vs_batch(reference, max_num_seqs, shuffle_seed):
    reqs, want = reference
    llm = LLM(max_num_seqs=max_num_seqs)
    got = run_shuffled(llm, reqs, shuffle_seed)
    assert _mismatches(got, want) == []


def test_bitwise_equal_with_chunked_prefill_at_odd_boundaries_and_prefix_hits(reference):
    reqs, want = reference
    llm = LLM(max_num_seqs=16, max_num_batched_tokens=37)
    first = run_shuffled(llm, reqs, 4)  # every prompt chunked at 37-token boundaries
    assert _mismatches(first, want) == []
    outs = llm.generate([r[0] for r in reqs], [r[1] for r in reqs])  # again: cache hits
    assert sum(o.num_cached_tokens for o in outs) > 0, "the test must exercise cache hits"
    assert _mismatches([(o.outputs[0].token_ids, o.outputs[0].token_logprobs) for o in outs], want) == []


@pytest.mark.slow  # the default CPU chunk (128 tokens) runs in every test here; this one uses 7
def test_bitwise_equal_with_a_small_per_step_prefill_chunk(reference):
    reqs, want = reference
    llm = LLM(max_num_seqs=16, long_prefill_token_threshold=7)  # prefills share 7 tokens a step
    assert _mismatches(run_shuffled(llm, reqs, 5), want) == []


def test_bitwise_equal_when_requests_are_preempted_and_recomputed(reference):
    reqs, want = reference
    llm = LLM(max_num_seqs=16, num_kv_blocks=40, enable_prefix_caching=False)
    got = run_shuffled(llm, reqs, 6)
    assert llm.engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert llm.engine.kv.pool.num_used == 0
    assert _mismatches(got, want) == []


def test_score_of_prompt_plus_generation_equals_generation_logprobs(reference):
    reqs, want = reference
    llm = LLM(max_num_seqs=16, max_num_batched_tokens=97)
    full = [prompt + tokens for (prompt, _), (tokens, _) in zip(reqs, want, strict=True)]
    scored = llm.score(full)
    for (prompt, _), (_, logprobs), s in zip(reqs, want, scored, strict=True):
        assert s[len(prompt) - 1:] == logprobs


def test_negative_control_standard_mode_differs_with_batch_size(reference):
    reqs, _ = reference
    some = reqs[::4]  # a quarter of the requests alone is enough to show the variance
    alone = run_shuffled(LLM(max_num_seqs=1, batch_invariant=False), some, None)
    batched = run_shuffled(LLM(max_num_seqs=32, batch_invariant=False), reqs, 7)[::4]
    assert _mismatches(batched, alone) != [], "standard mode should show batch variance"
