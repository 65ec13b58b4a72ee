"""A grammar-constrained request's bits do not depend on its neighbours: the same tokens and
logprobs alone as in a batch beside unconstrained (and differently constrained) requests. Its
output satisfies its constraint, and standard mode (the negative control) differs on the same run.
"""

from __future__ import annotations

import json

import pytest

from samebits import LLM, SamplingParams
from samebits.structured_outputs import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
PROMPTS = ["Describe a person as JSON:", "A phone extension:", "Write about the sea.",
           "Is water wet? Answer:", "List three fruits.", "Once upon a time"]
CONSTRAINED = [0, 1, 3]  # indices of the constrained requests


def _params() -> list[SamplingParams]:
    so = StructuredOutputsParams
    return [SamplingParams(max_tokens=24, temperature=0.8, seed=11, structured_outputs=so(json=SCHEMA)),
            SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=so(regex=r"\d{3}-[a-z]{2,4}")),
            SamplingParams(max_tokens=12, temperature=0.9, seed=5),
            SamplingParams(max_tokens=6, temperature=0.7, seed=2,
                           structured_outputs=so(choice=["yes", "no"])),
            SamplingParams(max_tokens=12, temperature=0.0),
            SamplingParams(max_tokens=12, temperature=1.0, seed=9)]


def _alone_and_batched(llm: LLM) -> tuple[list, list]:
    params = _params()
    alone = [llm.generate(PROMPTS[i], params[i])[0].outputs[0] for i in CONSTRAINED]
    batched = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    return ([(o.token_ids, o.token_logprobs) for o in alone],
            [(batched[i].token_ids, batched[i].token_logprobs) for i in CONSTRAINED])


@pytest.fixture(scope="module")
def invariant_runs():
    llm = LLM(max_num_seqs=16)
    alone, batched = _alone_and_batched(llm)
    return llm, alone, batched


def test_constrained_request_bitwise_equal_alone_and_in_mixed_batch(invariant_runs):
    _, alone, batched = invariant_runs
    assert alone == batched


def test_constrained_outputs_satisfy_their_constraints(invariant_runs):
    llm, alone, _ = invariant_runs
    texts = [llm.tokenizer.decode(ids) for ids, _ in alone]
    person = json.loads(texts[0])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    head, _, tail = texts[1].partition("-")
    assert len(head) == 3 and head.isdigit() and 2 <= len(tail) <= 4 and tail.isalpha()
    assert texts[2] in ("yes", "no")


def test_reported_logprobs_are_the_raw_distributions_not_the_masked_ones(invariant_runs):
    llm, alone, _ = invariant_runs
    prompts = [llm.tokenizer.encode(PROMPTS[i]) for i in CONSTRAINED]
    scored = llm.score([p + ids for p, (ids, _) in zip(prompts, alone, strict=True)])
    for p, (_, logprobs), s in zip(prompts, alone, scored, strict=True):
        assert s[len(p) - 1:] == logprobs  # teacher-forced, unconstrained: bitwise equal
    assert any(lp < -1e-3 for _, lps in alone for lp in lps), "masking would renormalise"


def test_negative_control_standard_mode_differs_alone_vs_batch():
    alone, batched = _alone_and_batched(LLM(max_num_seqs=16, batch_invariant=False))
    assert alone != batched, "standard mode should show batch variance"
