"""Sampling with a per-request counter-based random stream.

The noise for token ``v`` of a request's ``i``-th generated token is a hash of (request seed, i, v)
-- integer arithmetic, the same on every device and in every batch -- turned into Gumbel noise;
the sample is ``argmax(filtered logits / T + noise)``, an exact draw from the filtered softmax.
Filters, on the temperature-scaled logits: top-k keeps exactly k tokens (among equal logits the
lowest ids); top-p keeps the shortest prefix, in that order, whose mass reaches p, with the mass
counted in integer units (``_weights``) so that cumulative sums are exact; min-p keeps
``exp(x - max) >= min_p``. Every decision depends on the row alone. The definition sorts the whole
vocabulary; rows whose kept set provably lies among their top ``CANDIDATES`` logits get the same
tokens from those candidates alone. Greedy is ``argmax`` of the logits; ties go to the lowest token
id. Reported logprobs are ``log_softmax`` of the raw fp32 logits through the invariant backend.
"""

from __future__ import annotations

import math

import torch

from samebits.ops.backend import OpBackend
from samebits.sampling_params import SamplingParams

_M32 = 0xFFFFFFFF
CANDIDATES = (256, 4096)  # candidate-set sizes tried before a full sort (never changes bits)
_MASS_SCALE = 2.0 ** 32  # top-p mass unit: 2**-32 of the most likely token's weight


def mix32(x):  # works on Python ints and on int64 tensors holding values < 2**32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def stream_key(seed: int, index: int) -> tuple[int, int]:
    """The 64-bit key (two 32-bit words) of a request's ``index``-th token draw."""
    lo, hi, idx = seed & _M32, (seed >> 32) & _M32, index & _M32
    k1 = mix32(mix32(mix32(lo ^ 0x9E3779B9) ^ hi) ^ idx)
    k2 = mix32(mix32(mix32(hi ^ 0x7F4A7C15) ^ lo) ^ mix32(idx ^ 0x94D049BB))
    return k1, k2


def gumbel_at(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """keys [B, 2] int64, token_ids [B, L] int64 -> Gumbel(0, 1) noise [B, L] fp32, a pure function
    of (key, token id): the same value wherever and in whatever layout a token is asked for."""
    ids = _pad_cols(token_ids)  # every element through the vectorised log (see _pad_cols)
    h = mix32(mix32(keys[:, :1] ^ ids) ^ keys[:, 1:])
    h = mix32(h ^ 0x85EBCA6B)
    u = ((h >> 8).to(torch.float64) + 0.5) / float(1 << 24)  # (0, 1), never 0 or 1
    return (-torch.log(-torch.log(u))).float()[:, :token_ids.shape[1]]


def gumbel_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """keys [B, 2] int64 -> noise [B, V] for every token id of the vocabulary."""
    ids = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    return gumbel_at(keys, ids.expand(keys.shape[0], vocab_size))


def _pad_cols(x: torch.Tensor) -> torch.Tensor:
    """``x`` [B, L] with L zero-padded to a multiple of 64. A CPU elementwise kernel computes the
    tail of a tensor with its scalar function, whose exp/log may differ from the vectorised one in
    the last ulp; with whole 64-element rows every element takes the vectorised path."""
    pad = -x.shape[1] % 64
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def _weights(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled logits x [B, V] -> (w = exp(x - row max) fp32, q = floor(w * 2**32) int64).

    Top-p mass is summed in the integers q: exact and associative, so a cumulative mass is the same
    bits whatever the scan algorithm, the row length or the number of candidates summed."""
    w = torch.exp(_pad_cols(x - x.amax(-1, keepdim=True)))[:, :x.shape[1]]
    return w, torch.floor(w * _MASS_SCALE).to(torch.int64)


def _sorted_drop(q_sorted: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 total: torch.Tensor) -> torch.Tensor:
    """Drop mask over tokens in (logit desc, id asc) order: rank >= k, or the kept mass strictly
    before the token already reaches p of ``total`` (the mass of the top-k set)."""
    rank = torch.arange(q_sorted.shape[-1], device=q_sorted.device)[None, :]
    drop = rank >= top_k[:, None]
    q = q_sorted.masked_fill(drop, 0)
    before = (torch.cumsum(q, dim=-1) - q).double()
    return drop | ((top_p[:, None] < 1) & (before >= top_p[:, None] * total.double()[:, None]))


def _keep_full(x: torch.Tensor, q: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
               ) -> torch.Tensor:
    """The definition: one stable descending sort of the whole vocabulary (among equal logits the
    lowest ids first); True where top-k and top-p keep the token."""
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices
    qs = q.gather(-1, order)
    rank = torch.arange(x.shape[-1], device=x.device)[None, :]
    total = qs.masked_fill(rank >= top_k[:, None], 0).sum(-1)
    drop = _sorted_drop(qs, top_k, top_p, total)
    return ~torch.zeros_like(drop).scatter(-1, order, drop)


def _keep_candidates(x: torch.Tensor, q: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same keep set from the ``count`` largest logits, without sorting the vocabulary.

    Returns (candidate ids [B, C] in (logit desc, id asc) order, keep [B, C], exact [B]). Tokens
    strictly above the smallest candidate logit b are all candidates and sit in the definition's
    order with the definition's integer masses, so their decisions are the definition's. ``exact``
    says the kept set stops before the first candidate at b (rank >= k or mass reached there), so
    no token outside the candidates (nor a tie at b) could be kept; other rows take ``_keep_full``.
    """
    vals, ids = torch.topk(x, count, dim=-1)
    ids, by_id = ids.sort(dim=-1)
    vals, by_val = vals.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, by_val)
    qc = q.gather(-1, ids)
    rank = torch.arange(count, device=x.device)[None, :]
    in_k = rank < top_k[:, None]
    total = torch.where(top_k < x.shape[-1], qc.masked_fill(~in_k, 0).sum(-1), q.sum(-1))
    drop = _sorted_drop(qc, top_k, top_p, total)
    num_above = (vals > vals[:, -1:]).sum(-1)
    exact = drop.gather(-1, num_above[:, None])[:, 0]
    return ids, ~drop, exact


def _draw_full(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor, min_p: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    keep = (w >= min_p[:, None])
    if bool(((top_k < x.shape[-1]) | (top_p < 1)).any()):
        keep &= _keep_full(x, q, top_k, top_p)
    scores = x.masked_fill(~keep, -math.inf) + gumbel_noise(keys, x.shape[-1])
    return scores.argmax(dim=-1)  # first maximum: ties -> lowest id


def _draw_candidates(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, min_p: torch.Tensor, keys: torch.Tensor, count: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, exact): the draw among the ``count`` candidates; valid where ``exact``."""
    ids, keep, exact = _keep_candidates(x, q, top_k, top_p, count)
    keep &= w.gather(-1, ids) >= min_p[:, None]
    scores = x.gather(-1, ids).masked_fill(~keep, -math.inf) + gumbel_at(keys, ids)
    best = scores.amax(-1, keepdim=True)
    tokens = torch.where(scores == best, ids, x.shape[-1]).amin(-1)  # ties -> lowest id
    return tokens, exact


def draw(x: torch.Tensor, params: list[SamplingParams], keys: torch.Tensor) -> torch.Tensor:
    """Sample one token per row of temperature-scaled logits x [B, V]: the Gumbel-max draw over the
    tokens top-k, top-p and min-p keep. A row whose keep set provably lies among its top ``c``
    logits (``_keep_candidates``, c from ``CANDIDATES``) never sorts the vocabulary; every row's
    token is the one the full-sort definition gives, so the path taken never changes a bit."""
    dev, v = x.device, x.shape[-1]
    w, q = _weights(x)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < v else v for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=torch.float64)
    min_p = torch.tensor([p.min_p for p in params], device=dev, dtype=torch.float32)
    tokens = torch.empty(len(params), device=dev, dtype=torch.int64)
    todo = list(range(len(params)))
    for count in (c for c in CANDIDATES if c < v):
        fast = [i for i in todo if (params[i].top_p < 1 or 0 < params[i].top_k < v)
                and not count < params[i].top_k < v]
        if not fast:
            break
        f = torch.tensor(fast, device=dev)
        drawn, exact = _draw_candidates(x[f], w[f], q[f], top_k[f], top_p[f], min_p[f], keys[f],
                                        count)
        tokens[f] = drawn
        done = {i for i, ok in zip(fast, exact.tolist(), strict=True) if ok}
        todo = [i for i in todo if i not in done]
    if todo:
        r = torch.tensor(todo, device=dev)
        tokens[r] = _draw_full(x[r], w[r], q[r], top_k[r], top_p[r], min_p[r], keys[r])
    return tokens


def sample(ops: OpBackend, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
           indices: list[int]) -> tuple[list[int], torch.Tensor]:
    """logits [B, V] fp32 -> (token ids, log_softmax of the raw logits [B, V])."""
    logprobs = ops.log_softmax(logits)
    tokens = logits.argmax(dim=-1)  # first maximum: ties -> lowest id
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        temps = torch.tensor([params[i].temperature for i in rows], device=logits.device)
        keys = torch.tensor([stream_key(seeds[i], indices[i]) for i in rows],
                            device=logits.device, dtype=torch.int64)  # [B, 2]
        tokens[idx] = draw(logits[idx] / temps[:, None], [params[i] for i in rows], keys)
    return tokens.tolist(), logprobs
