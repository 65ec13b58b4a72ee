"""Sampling controls (logit_bias, presence / frequency / repetition penalties, min_tokens) change
the answer, and a request using them gets the same bits alone as in a batch of mixed plain,
biased and penalised neighbours; its logprobs stay those of the raw distribution (== score)."""

from __future__ import annotations

import pytest

from samebits import LLM, SamplingParams

PROMPT = "The cat sat on the mat. The cat was happy because the cat"
WAS = 436  # the plain greedy answer's first token (" was")
GREEDY = dict(max_tokens=10, temperature=0.0)
SAMPLED = dict(max_tokens=10, temperature=0.9, seed=5)
REQUESTS = {  # name -> params; every one on PROMPT
    "plain": SamplingParams(**GREEDY),
    "presence": SamplingParams(**GREEDY, presence_penalty=2.0),
    "frequency": SamplingParams(**GREEDY, frequency_penalty=2.0),
    "repetition": SamplingParams(**GREEDY, repetition_penalty=1.3),
    "bias": SamplingParams(**GREEDY, logit_bias={260: 8.0}),
    "sampled": SamplingParams(**SAMPLED),
    "sampled_all": SamplingParams(**SAMPLED, logit_bias={WAS: -100.0}, repetition_penalty=1.2,
                                  presence_penalty=1.0, frequency_penalty=-0.5),
    "stop_id": SamplingParams(**GREEDY, stop_token_ids=[WAS]),
    "stop_id_min": SamplingParams(**GREEDY, stop_token_ids=[WAS], min_tokens=10),
}
NAMES = list(REQUESTS)


def _run(llm: LLM, names: list[str]) -> dict[str, tuple[list[int], list[float]]]:
    outs = llm.generate([PROMPT] * len(names), [REQUESTS[n] for n in names])
    return {n: (o.outputs[0].token_ids, o.outputs[0].token_logprobs)
            for n, o in zip(names, outs, strict=True)}


ALONE = ["bias", "frequency", "sampled_all"]  # run alone too (each alone is a whole generate)


def _alone(llm: LLM) -> dict[str, tuple[list[int], list[float]]]:
    return {n: _run(llm, [n])[n] for n in ALONE}


@pytest.fixture(scope="module")
def invariant() -> LLM:
    return LLM(max_num_seqs=16)


@pytest.fixture(scope="module")
def batched(invariant):
    order = NAMES[::-1]  # neither the order nor the neighbours may matter
    return _run(invariant, order)


def test_each_control_changes_the_answer(batched):
    plain = batched["plain"][0]
    for name in ("presence", "frequency", "repetition", "bias"):
        assert batched[name][0] != plain, name
    assert batched["sampled_all"][0] != batched["sampled"][0]
    assert WAS not in batched["sampled_all"][0]
    assert batched["stop_id"][0] == [WAS]  # stops on its first token
    min_held = batched["stop_id_min"][0]
    assert len(min_held) == 10 and WAS not in min_held  # held back for all 10 tokens


def test_controlled_requests_bitwise_equal_alone_and_among_mixed_neighbours(invariant, batched):
    alone = _alone(invariant)
    assert [n for n in ALONE if alone[n] != batched[n]] == []


def test_logprobs_stay_those_of_the_raw_distribution(invariant, batched):
    prompt = invariant.get_tokenizer().encode(PROMPT)
    names = ["presence", "repetition", "bias", "sampled_all"]
    scored = invariant.score([prompt + batched[n][0] for n in names])
    for n, s in zip(names, scored, strict=True):
        assert s[len(prompt) - 1:] == batched[n][1], n


def test_negative_control_standard_mode_differs_alone_vs_batch():
    llm = LLM(max_num_seqs=16, batch_invariant=False)
    alone, batched = _alone(llm), _run(llm, NAMES[::-1])
    assert [n for n in ALONE if alone[n] != batched[n]] != [], "standard mode should differ"
