"""Per-request logits processors: ``logit_bias``, the repetition / frequency / presence penalties,
and ``min_tokens``, applied to the raw fp32 logits [B, V] of the rows being sampled, before the
sampler (greedy argmax and sampling both see the processed logits).

The reported logprobs are not affected: the runner takes them as the log_softmax of the *raw*
logits before calling ``apply_logits_processors``, so these controls change which token is chosen,
never the logprob reported for it (the same value ``LLM.score`` returns).

Invariance: each operation is elementwise and reads only its own row's request (its parameters
and token ids); nothing reduces across rows, or within a row, so a row's bits are the same
whatever its neighbours are or ask for. A processor touches only the rows of requests that use it;
rows that use none keep their logits, and a batch in which no request uses one returns the input
tensor itself, with no work.

Semantics (vLLM's, in its order): ``logit_bias`` adds its value to the token's logit; then
``repetition_penalty`` r (HF / vLLM) divides a positive logit by r and multiplies a negative one
by r, for tokens in the prompt or the output; ``frequency_penalty`` f and ``presence_penalty`` p
(OpenAI) subtract ``f * count + p * (count > 0)`` for tokens in the output; then ``min_tokens``
masks the tokens that would end the sequence (EOS unless ignored, ``stop_token_ids``) to ``-inf``
while fewer than ``min_tokens`` tokens have been generated.
"""

from __future__ import annotations

import math

import torch

from samebits.engine.sequence import Sequence


def apply_logits_processors(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Raw logits [B, V] fp32 of ``seqs`` (one row each) -> the logits to sample from. Returns
    ``logits`` itself when no request in the batch uses a processor, otherwise a new tensor."""
    active = [(proc, rows) for proc in PROCESSORS if (rows := proc.rows(seqs))]
    if not active:
        return logits
    logits = logits.clone()
    for proc, rows in active:
        proc.apply(logits, seqs, rows)
    return logits


class LogitBias:
    @staticmethod
    def rows(seqs: list[Sequence]) -> list[int]:
        return [i for i, s in enumerate(seqs) if s.params.logit_bias]

    @staticmethod
    def apply(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        r, t, v = [], [], []
        for i in rows:
            for token, bias in seqs[i].params.logit_bias.items():
                r.append(i)
                t.append(token)
                v.append(bias)
        dev = logits.device
        r_idx, t_idx = torch.tensor(r, device=dev), torch.tensor(t, device=dev)
        logits[r_idx, t_idx] = logits[r_idx, t_idx] + torch.tensor(v, device=dev,
                                                                   dtype=logits.dtype)


class Penalties:
    @staticmethod
    def rows(seqs: list[Sequence]) -> list[int]:
        return [i for i, s in enumerate(seqs) if s.params.has_penalties]

    @staticmethod
    def apply(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        dev, dtype, v = logits.device, logits.dtype, logits.shape[-1]
        ps = [seqs[i].params for i in rows]
        x = logits[torch.tensor(rows, device=dev)]
        counts = _counts([seqs[i].output_token_ids for i in rows], v, dev)
        seen = _mask([seqs[i].prompt_token_ids for i in rows], v, dev) | (counts > 0)
        rep = torch.tensor([p.repetition_penalty for p in ps], device=dev, dtype=dtype)[:, None]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        freq = torch.tensor([p.frequency_penalty for p in ps], device=dev, dtype=dtype)[:, None]
        x = x - freq * counts.to(dtype)
        pres = torch.tensor([p.presence_penalty for p in ps], device=dev, dtype=dtype)[:, None]
        x = x - pres * (counts > 0).to(dtype)
        logits[torch.tensor(rows, device=dev)] = x


class MinTokens:
    @staticmethod
    def rows(seqs: list[Sequence]) -> list[int]:
        return [i for i, s in enumerate(seqs)
                if s.stop_ids and len(s.output_token_ids) < s.params.min_tokens]

    @staticmethod
    def apply(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        v = logits.shape[-1]
        ids = [[t for t in sorted(seqs[i].stop_ids) if t < v] for i in rows]
        logits[_mask(ids, v, logits.device, rows, logits.shape[0])] = -math.inf


PROCESSORS = (LogitBias, Penalties, MinTokens)  # applied in this order


def _flat(ids: list[list[int]], device: torch.device, rows: list[int] | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every entry of the ragged lists, as two index tensors."""
    rows = range(len(ids)) if rows is None else rows
    r = [row for row, t in zip(rows, ids, strict=True) for _ in t]
    t = [tok for toks in ids for tok in toks]
    return (torch.tensor(r, dtype=torch.int64, device=device),
            torch.tensor(t, dtype=torch.int64, device=device))


def _counts(ids: list[list[int]], v: int, device: torch.device) -> torch.Tensor:
    """[len(ids), v] int64: how often each token occurs in each list (exact integer adds)."""
    counts = torch.zeros(len(ids), v, dtype=torch.int64, device=device)
    r, t = _flat(ids, device)
    counts.index_put_((r, t), torch.ones_like(t), accumulate=True)
    return counts


def _mask(ids: list[list[int]], v: int, device: torch.device, rows: list[int] | None = None,
          num_rows: int | None = None) -> torch.Tensor:
    """[num_rows, v] bool: True where row ``rows[k]`` has a token of ``ids[k]``."""
    mask = torch.zeros(len(ids) if num_rows is None else num_rows, v, dtype=torch.bool,
                       device=device)
    r, t = _flat(ids, device, rows)
    mask[r, t] = True
    return mask
