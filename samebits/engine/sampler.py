"""Sampling with a per-request counter-based random stream.

The noise for token ``v`` of a request's ``i``-th generated token is a hash of (request seed, i, v)
-- integer arithmetic, the same on every device and in every batch -- turned into Gumbel noise;
the sample is ``argmax(filtered logits / T + noise)``, an exact draw from the filtered softmax.
Filters: top-k (exactly k tokens; among equal logits the lowest ids) and top-p on one stable sort,
through fixed 16-row tiles so a row's cumulative sums never depend on its neighbours; min-p
(``exp(x - max) >= min_p``, no reduction). Greedy is ``argmax``; ties go to the lowest token id.
Both see the logits after the request's logits processors (``samebits.engine.logits_processor``:
bias, penalties, min_tokens); the reported logprobs are ``log_softmax`` of the *raw* fp32 logits,
taken by the runner through the invariant backend before the processors run.
"""

from __future__ import annotations

import math

import torch

from samebits.ops.tiles import by_tiles
from samebits.sampling_params import SamplingParams

_M32 = 0xFFFFFFFF


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


def gumbel_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """keys [B, 2] int64 -> Gumbel(0, 1) noise [B, V] in fp32, a pure function of (key, token id)."""
    tokens = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    h = mix32(mix32(keys[:, :1] ^ tokens[None, :]) ^ keys[:, 1:])
    h = mix32(h ^ 0x85EBCA6B)
    u = ((h >> 8).to(torch.float64) + 0.5) / float(1 << 24)  # (0, 1), never 0 or 1
    return (-torch.log(-torch.log(u))).float()


def _sorted_mask(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """True for tokens outside the top ``k`` (stable descending order: among equal logits the
    lowest ids come first), or outside the smallest prefix of those whose mass reaches ``p``."""
    v = x.shape[-1]

    def tile(t: torch.Tensor) -> torch.Tensor:
        logits, k, p = t[:, :v], t[:, v:v + 1], t[:, v + 1:]
        sorted_x, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        drop = torch.arange(v, device=t.device)[None, :] >= k
        probs = torch.softmax(sorted_x.masked_fill(drop, -math.inf), dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each token
        drop |= (p < 1) & (before >= p)
        return torch.zeros_like(drop).scatter(-1, order, drop)

    return by_tiles(tile, torch.cat([x, top_k[:, None].to(x.dtype), top_p[:, None].to(x.dtype)],
                                     dim=-1))


def _filter(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Apply top-k, top-p and min-p to temperature-scaled logits x [B, V] (masked -> -inf)."""
    dev, v = x.device, x.shape[-1]
    if any(0 < p.top_k < v or p.top_p < 1 for p in params):
        top_k = torch.tensor([p.top_k if 0 < p.top_k < v else v for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        x = x.masked_fill(_sorted_mask(x, top_k, top_p), -math.inf)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=dev, dtype=torch.float32)
        ratio = torch.exp(x - x.amax(-1, keepdim=True))
        x = x.masked_fill(ratio < min_p[:, None], -math.inf)
    return x


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
           indices: list[int]) -> list[int]:
    """Processed logits [B, V] fp32 (``apply_logits_processors``) -> one token id per row."""
    tokens = logits.argmax(dim=-1)  # first maximum: ties -> lowest id
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        temps = torch.tensor([params[i].temperature for i in rows], device=logits.device)
        x = _filter(logits[idx] / temps[:, None], [params[i] for i in rows])
        keys = torch.tensor([stream_key(seeds[i], indices[i]) for i in rows],
                            device=logits.device, dtype=torch.int64)  # [B, 2]
        tokens[idx] = (x + gumbel_noise(keys, logits.shape[-1])).argmax(dim=-1)
    return tokens.tolist()
