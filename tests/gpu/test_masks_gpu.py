"""The per-request masks ``allowed_token_ids`` and ``bad_words`` on CUDA with CUDA graphs: a masked
request gets the same bits alone (eager, batch of one) as among plain and masked neighbours in a
graph-replayed batch, and its output obeys its mask. Negative control: the standard mode differs
alone vs batched on the same requests. Model and byte-level tokenizer: test_features_gpu's."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from samebits import SamplingParams  # noqa: E402
from tests.gpu import test_features_gpu as features  # noqa: E402
from tests.gpu.findings import record  # noqa: E402
from tests.gpu.test_features_gpu import PROMPTS, _alone, _keys, _llm, _run  # noqa: E402

model_dir = features.model_dir  # the fixture: the tiny model with its byte-level tokenizer

ALLOWED = [ord(c) for c in "abc xyz."]  # byte tokens: the outputs below decode as text
BAD_WORDS = ["ab", "c"]
MASKS = {
    "plain": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    "allowed": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                              allowed_token_ids=ALLOWED),
    "allowed_sampled": SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True,
                                      allowed_token_ids=ALLOWED),
    "bad": SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True,
                          allowed_token_ids=ALLOWED, bad_words=BAD_WORDS),
    "sampled": SamplingParams(max_tokens=24, temperature=0.9, seed=8, ignore_eos=True),
}


def _has_bad_word(tokens: list[int]) -> bool:
    return any(w in bytes(tokens).decode() for w in BAD_WORDS)


def test_gpu_masked_requests_bitwise_equal_alone_eager_and_in_mixed_graph_batch(model_dir):
    keys = _keys(MASKS)[::-1]
    llm = _llm(model_dir, max_num_seqs=64)
    got = _run(llm, keys, MASKS)
    assert len(llm.engine.runner.graphs.graphs) > 0
    for p in range(len(PROMPTS)):
        for name in ("allowed", "allowed_sampled", "bad"):
            assert set(got[p, name][0]) <= set(ALLOWED), (p, name)
        assert not _has_bad_word(got[p, "bad"][0]), p
    assert any(_has_bad_word(got[p, "allowed_sampled"][0]) for p in range(len(PROMPTS)))
    alone = _alone(_llm(model_dir, max_num_seqs=1, enforce_eager=True), keys, MASKS)
    assert [k for k in keys if alone[k] != got[k]] == []


def test_gpu_negative_control_standard_mode_masked_requests_differ_alone_vs_batched(model_dir):
    keys = _keys(MASKS)[::-1]
    batched = _run(_llm(model_dir, max_num_seqs=64, batch_invariant=False), keys, MASKS)
    alone = _alone(_llm(model_dir, max_num_seqs=1, batch_invariant=False, enforce_eager=True),
                   keys, MASKS)
    differing = [k for k in keys if alone[k] != batched[k]]
    record("masks_standard_alone_vs_batch", differing=len(differing), of=len(keys))
    assert differing != []
