"""The logits processors: each control's semantics (against transformers' own processors where
one exists), a row's bits independent of its neighbours, and no work when no request uses one."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from samebits.engine.logits_processor import apply_logits_processors
from samebits.engine.sequence import Sequence
from samebits.sampling_params import SamplingParams

V = 300
EOS = 2


def _seq(prompt: list[int], output: list[int], **params) -> Sequence:
    p = SamplingParams(max_tokens=64, **params)
    stop = frozenset() if p.ignore_eos else frozenset({EOS})
    return Sequence("r", list(prompt), p, 0, output_token_ids=list(output),
                    stop_ids=stop | frozenset(p.stop_token_ids or ()))


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 4


def test_batch_without_processors_returns_the_input_tensor_itself() -> None:
    logits = _logits(3)
    seqs = [_seq([5, 6], [7]), _seq([5], [], temperature=0.5), _seq([1], [9], min_tokens=1)]
    assert apply_logits_processors(logits, seqs) is logits


def test_logit_bias_equals_transformers_sequence_bias() -> None:
    logits = _logits(1)
    bias = {3: 5.5, 17: -100.0, 250: 0.25}
    got = apply_logits_processors(logits, [_seq([1], [], logit_bias=bias)])
    hf = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    want = hf(torch.tensor([[1]]), logits.clone())
    assert torch.equal(got, want)
    assert not torch.equal(got, logits)


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers_on_prompt_and_output(penalty: float) -> None:
    logits = _logits(1, seed=1)
    prompt, output = [4, 8, 15, 16, 4], [23, 42, 42, 0]
    got = apply_logits_processors(logits, [_seq(prompt, output, repetition_penalty=penalty)])
    want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]),
                                                     logits.clone())
    assert torch.equal(got, want)
    changed = set((got != logits)[0].nonzero()[:, 0].tolist())
    assert changed == set(prompt + output) - {t for t in prompt + output if logits[0, t] == 0}


def test_frequency_and_presence_penalties_count_generated_tokens_only() -> None:
    logits = _logits(1, seed=2)
    prompt, output = [10, 11], [11, 12, 12, 12]
    got = apply_logits_processors(
        logits, [_seq(prompt, output, frequency_penalty=0.5, presence_penalty=1.5)])[0]
    x = logits[0]
    f, p = torch.tensor(0.5), torch.tensor(1.5)
    assert got[10] == x[10]  # in the prompt only: untouched (OpenAI semantics)
    assert got[11] == x[11] - f * 1 - p
    assert got[12] == x[12] - f * 3 - p
    untouched = [t for t in range(V) if t not in (11, 12)]
    assert torch.equal(got[untouched], x[untouched])


def test_min_tokens_masks_eos_and_stop_ids_like_transformers_until_reached() -> None:
    logits = _logits(1, seed=3)
    for generated in range(4):
        seq = _seq([1], [7] * generated, min_tokens=3, stop_token_ids=[9])
        got = apply_logits_processors(logits, [seq])
        hf = MinNewTokensLengthLogitsProcessor(1, 3, [EOS, 9])
        want = hf(torch.tensor([[1] + [7] * generated]), logits.clone())
        assert torch.equal(got, want), generated
        assert (got[0, [EOS, 9]] == -math.inf).all() == (generated < 3)


def test_min_tokens_with_ignore_eos_masks_only_the_stop_ids() -> None:
    got = apply_logits_processors(_logits(1), [_seq([1], [], min_tokens=2, ignore_eos=True,
                                                    stop_token_ids=[9])])
    assert got[0, 9] == -math.inf and math.isfinite(got[0, EOS])


def _mixed() -> list[Sequence]:
    kinds = [
        dict(),
        dict(logit_bias={5: 3.0, 6: -2.5}),
        dict(repetition_penalty=1.7),
        dict(frequency_penalty=0.9),
        dict(presence_penalty=-1.1, temperature=0.7),
        dict(min_tokens=5, stop_token_ids=[4]),
        dict(logit_bias={EOS: 10.0}, repetition_penalty=0.6, frequency_penalty=-0.4,
             presence_penalty=2.0, min_tokens=2),
        dict(repetition_penalty=1.2, ignore_eos=True),
    ]
    gen = torch.Generator().manual_seed(4)
    seqs = []
    for i in range(16):
        prompt = torch.randint(0, V, (3 + i,), generator=gen).tolist()
        output = torch.randint(0, V, (i % 6,), generator=gen).tolist()
        seqs.append(_seq(prompt, output, **kinds[i % len(kinds)]))
    return seqs


@pytest.mark.smoke
def test_each_row_bitwise_equal_alone_and_in_any_batch() -> None:
    seqs, logits = _mixed(), _logits(16, seed=5)
    batch = apply_logits_processors(logits, seqs)
    assert not torch.equal(batch, logits)
    for r in range(16):
        alone = apply_logits_processors(logits[r:r + 1], [seqs[r]])
        assert torch.equal(alone[0], batch[r]), r
    order = [15 - i for i in range(16)]
    reversed_batch = apply_logits_processors(logits[order], [seqs[i] for i in order])
    assert torch.equal(reversed_batch, batch[order])
    pairs = [(1, 2), (3, 4), (6, 0), (2, 6)]
    for a, b in pairs:  # one processor's neighbour uses another, or none
        pair = apply_logits_processors(logits[[a, b]], [seqs[a], seqs[b]])
        assert torch.equal(pair, batch[[a, b]])


def test_input_logits_are_not_modified() -> None:
    seqs, logits = _mixed(), _logits(16, seed=6)
    before = logits.clone()
    apply_logits_processors(logits, seqs)
    assert torch.equal(logits, before)
