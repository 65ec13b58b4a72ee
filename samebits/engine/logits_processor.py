"""Per-request logits processors: the ``allowed_token_ids`` and ``bad_words`` masks,
``logit_bias``, the repetition / frequency / presence penalties, and ``min_tokens``, applied to
the raw fp32 logits [B, V] of the rows being sampled, before the sampler (greedy argmax and
sampling both see the processed logits).

The reported logprobs are not affected: the runner takes them as the log_softmax of the *raw*
logits before calling ``apply_logits_processors``, so these controls change which token is chosen,
never the logprob reported for it (the same value ``LLM.score`` returns).

Invariance: each operation is elementwise and reads only its own row's request (its parameters
and token ids); nothing reduces across rows, or within a row, so a row's bits are the same
whatever its neighbours are or ask for. A processor touches only the rows of requests that use it;
rows that use none keep their logits, and a batch in which no request uses one returns the input
tensor itself, with no work.

Semantics (vLLM's, in its order): ``allowed_token_ids`` sets every other token to ``-inf``;
``bad_words`` sets to ``-inf`` the last token of each bad word whose other tokens the output
ends with (a one-token word always; only the request's own output is read, as vLLM); then
``logit_bias`` adds its value to the token's logit; then ``repetition_penalty`` r (HF / vLLM)
divides a positive logit by r and multiplies a negative one by r, for tokens in the prompt or the
output; ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI) subtract
``f * count + p * (count > 0)`` for tokens in the output; then ``min_tokens`` masks the tokens
that would end the sequence (EOS unless ignored, ``stop_token_ids``) to ``-inf`` while fewer than
``min_tokens`` tokens have been generated.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from samebits.engine.sequence import Sequence
from samebits.sampling_params import SamplingParams

if TYPE_CHECKING:
    from samebits.text.tokenizer import Tokenizer


def apply_logits_processors(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Raw logits [B, V] fp32 of ``seqs`` (one row each) -> the logits to sample from. Returns
    ``logits`` itself when no request in the batch uses a processor, otherwise a new tensor."""
    active = [(proc, rows) for proc in PROCESSORS if (rows := proc.rows(seqs))]
    if not active:
        return logits
    logits = logits.clone(memory_format=torch.contiguous_format)
    for proc, rows in active:
        proc.apply(logits, seqs, rows)
    return logits


class AllowedTokenIds:
    @staticmethod
    def rows(seqs: list[Sequence]) -> list[int]:
        return [i for i, s in enumerate(seqs) if s.params.allowed_token_ids]

    @staticmethod
    def apply(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        v, dev = logits.shape[-1], logits.device
        ids = [[t for t in seqs[i].params.allowed_token_ids or () if t < v] for i in rows]
        r, t = _pairs(ids, list(range(len(rows))), dev)
        banned = torch.ones(len(rows), v, dtype=torch.bool, device=dev)
        banned[r, t] = False
        index = torch.tensor(rows, dtype=torch.int64).to(dev)
        logits[index] = logits[index].masked_fill(banned, -math.inf)


class BadWords:
    @staticmethod
    def rows(seqs: list[Sequence]) -> list[int]:
        return [i for i, s in enumerate(seqs) if s.params.bad_words_token_ids]

    @staticmethod
    def apply(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        v = logits.shape[-1]
        ids = [[t for t in _completing(seqs[i]) if t < v] for i in rows]
        r, t = _pairs(ids, rows, logits.device)
        logits[r, t] = -math.inf


def _completing(seq: Sequence) -> list[int]:
    """The last token of each bad word whose other tokens end the output."""
    out, found = seq.output_token_ids, []
    for word in seq.params.bad_words_token_ids or ():
        prefix = word[:-1]
        if len(prefix) <= len(out) and (not prefix or out[len(out) - len(prefix):] == prefix):
            found.append(word[-1])
    return found


def with_bad_words_token_ids(params: SamplingParams, tokenizer: Tokenizer | None
                             ) -> SamplingParams:
    """``params`` with ``bad_words`` tokenized into ``bad_words_token_ids`` (as vLLM: each word
    as at the start of a text, and with a leading space when that gives other tokens of the
    same count); unchanged when there are no bad words or their ids are already given."""
    if not params.bad_words or params.bad_words_token_ids is not None:
        return params
    if tokenizer is None:
        raise ValueError("bad_words needs a tokenizer; this model has none")
    ids: list[list[int]] = []
    for word in params.bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        ids.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            ids.append(spaced)
    return replace(params, bad_words_token_ids=ids)


class LogitBias:
    @staticmethod
    def rows(seqs: list[Sequence]) -> list[int]:
        return [i for i, s in enumerate(seqs) if s.params.logit_bias]

    @staticmethod
    def apply(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        biases = [seqs[i].params.logit_bias for i in rows]
        r, t = _pairs([list(b) for b in biases], rows, logits.device)
        values = torch.tensor([v for b in biases for v in b.values()], dtype=logits.dtype)
        logits[r, t] = logits[r, t] + values.to(logits.device)


class Penalties:
    """Touches only the (row, token) pairs of tokens in a row's prompt or output: the others
    are left as they are (the dense formula leaves them bitwise unchanged too)."""

    @staticmethod
    def rows(seqs: list[Sequence]) -> list[int]:
        return [i for i, s in enumerate(seqs) if s.params.has_penalties]

    @staticmethod
    def apply(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        v, dtype = logits.shape[-1], logits.dtype
        out = _keys([seqs[i].output_token_ids for i in rows], rows, v)
        keys = torch.unique(torch.cat([_keys([seqs[i].prompt_token_ids for i in rows], rows, v),
                                       out]))  # sorted (row, token) pairs, each once
        out_keys, out_counts = torch.unique(out, return_counts=True)
        counts = torch.zeros_like(keys)
        counts[torch.searchsorted(keys, out_keys)] = out_counts
        row = keys // v
        params = [s.params for s in seqs]
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=dtype)[row]
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=dtype)[row]
        pres = torch.tensor([p.presence_penalty for p in params], dtype=dtype)[row]
        dev = logits.device
        keys, counts, rep, freq, pres = (t.to(dev) for t in (keys, counts, rep, freq, pres))
        flat = logits.view(-1)
        x = flat[keys]
        x = torch.where(x > 0, x / rep, x * rep)  # every key is in the prompt or the output
        x = x - freq * counts.to(dtype)
        x = x - pres * (counts > 0).to(dtype)
        flat[keys] = x


class MinTokens:
    @staticmethod
    def rows(seqs: list[Sequence]) -> list[int]:
        return [i for i, s in enumerate(seqs)
                if s.stop_ids and len(s.output_token_ids) < s.params.min_tokens]

    @staticmethod
    def apply(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        v = logits.shape[-1]
        ids = [[t for t in sorted(seqs[i].stop_ids) if t < v] for i in rows]
        r, t = _pairs(ids, rows, logits.device)
        logits[r, t] = -math.inf


PROCESSORS = (AllowedTokenIds, BadWords, LogitBias, Penalties, MinTokens)  # in this order


def _pairs(ids: list[list[int]], rows: list[int], device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch row, token id) index tensors of every entry of ``ids[k]``, on row ``rows[k]``."""
    r = torch.tensor([row for row, t in zip(rows, ids, strict=True) for _ in t], dtype=torch.int64)
    t = torch.tensor([tok for toks in ids for tok in toks], dtype=torch.int64)
    return r.to(device), t.to(device)


def _keys(ids: list[list[int]], rows: list[int], v: int) -> torch.Tensor:
    """Flat indices ``row * v + token`` (CPU int64) of every token of ``ids[k]`` on ``rows[k]``."""
    parts = [torch.tensor(t, dtype=torch.int64) + row * v for row, t in zip(rows, ids, strict=True)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
