"""The per-request masks ``allowed_token_ids`` and ``bad_words``: their semantics (``bad_words``
against transformers' ``NoBadWordsLogitsProcessor``), their tokenization (vLLM's rule), and a
masked row's bits independent of its neighbours and of the other processors beside it."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import NoBadWordsLogitsProcessor

from samebits.engine.logits_processor import apply_logits_processors, with_bad_words_token_ids
from samebits.engine.sequence import Sequence
from samebits.sampling_params import SamplingParams

V = 300
EOS = 2


def _seq(output: list[int], **params) -> Sequence:
    p = SamplingParams(max_tokens=64, **params)
    return Sequence("r", [1, 2, 3], p, 0, output_token_ids=list(output), stop_ids=frozenset({EOS}))


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 4


def test_allowed_token_ids_keep_only_those_tokens_bitwise_unchanged() -> None:
    logits = _logits(1)
    allowed = [7, 0, 299, 42]
    got = apply_logits_processors(logits, [_seq([], allowed_token_ids=allowed)])[0]
    assert torch.equal(got[allowed], logits[0, allowed])
    others = [t for t in range(V) if t not in allowed]
    assert (got[others] == -math.inf).all()


WORDS = [[17], [5, 6, 8], [5, 9], [11, 12, 13, 14]]


@pytest.mark.parametrize("output", [[5], [5, 6], [9, 5, 6], [6, 5], [11, 12], [11, 12, 13]])
def test_bad_words_equal_transformers_no_bad_words_on_the_output(output: list[int]) -> None:
    logits = _logits(1, seed=1)
    got = apply_logits_processors(logits, [_seq(output, bad_words_token_ids=WORDS)])
    # transformers reads the prompt too (no word here matches a prompt token) and skips words
    # longer than its input: the prompt in front keeps every word in reach
    want = NoBadWordsLogitsProcessor(WORDS, eos_token_id=EOS)(torch.tensor([[1, 2, 3] + output]),
                                                             logits.clone())
    assert torch.equal(got, want)


def test_bad_words_before_any_output_ban_only_one_token_words() -> None:
    logits = _logits(1, seed=1)
    got = apply_logits_processors(logits, [_seq([], bad_words_token_ids=WORDS)])[0]
    changed = (got != logits[0]).nonzero()[:, 0].tolist()
    assert changed == [17] and got[17] == -math.inf


class _WordTokenizer:
    """A tokenizer whose leading-space form of a word is one other token."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        table = {"cat": [10], " cat": [11], "hot dog": [20, 21], " hot dog": [22, 21],
                 "x y": [30, 31], " x y": [32]}
        return table[text]


def test_bad_words_tokenized_at_the_start_and_mid_text_as_vllm() -> None:
    params = SamplingParams(bad_words=["cat", " hot dog", "x y"])
    got = with_bad_words_token_ids(params, _WordTokenizer()).bad_words_token_ids
    # " x y" has another token count: only its start-of-text form is banned (vLLM's rule)
    assert got == [[10], [11], [20, 21], [22, 21], [30, 31]]
    assert with_bad_words_token_ids(SamplingParams(), _WordTokenizer()).bad_words_token_ids is None
    with pytest.raises(ValueError, match="bad_words needs a tokenizer"):
        with_bad_words_token_ids(params, None)


@pytest.mark.parametrize("bad", [dict(allowed_token_ids=[]), dict(allowed_token_ids=[-1]),
                                 dict(bad_words=["  "]), dict(bad_words="cat"),
                                 dict(bad_words_token_ids=[[]])])
def test_bad_mask_fields_raise_naming_the_field(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def _mixed() -> list[Sequence]:
    kinds = [
        dict(),
        dict(allowed_token_ids=[3, 4, 5, 250]),
        dict(bad_words_token_ids=[[7], [8, 9], [1, 2, 4]]),
        dict(allowed_token_ids=list(range(0, V, 3)), logit_bias={3: 5.0, 4: -2.0}),
        dict(bad_words_token_ids=[[9, 9], [4]], repetition_penalty=1.4, min_tokens=3),
        dict(frequency_penalty=0.7),
    ]
    gen = torch.Generator().manual_seed(2)
    seqs = []
    for i in range(12):
        output = torch.randint(0, 12, (i % 5,), generator=gen).tolist()
        seqs.append(_seq(output, **kinds[i % len(kinds)]))
    return seqs


def test_masked_rows_bitwise_equal_alone_and_beside_any_neighbours() -> None:
    seqs, logits = _mixed(), _logits(12, seed=3)
    batch = apply_logits_processors(logits, seqs)
    for r in range(12):
        alone = apply_logits_processors(logits[r:r + 1], [seqs[r]])
        assert torch.equal(alone[0], batch[r]), r
    order = [11 - i for i in range(12)]
    assert torch.equal(apply_logits_processors(logits[order], [seqs[i] for i in order]),
                       batch[order])
    unmasked = [0, 5]  # rows asking for no mask keep their logits bitwise
    assert torch.equal(batch[unmasked[0]], logits[unmasked[0]])

