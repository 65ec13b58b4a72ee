"""Sampling with a per-request counter-based random stream.

The noise for token ``v`` of a request's ``i``-th generated token is a hash of (request seed, i, v)
-- integer arithmetic, the same on every device and in every batch -- turned into Gumbel noise;
the sample is ``argmax(filtered logits / T + noise)``, an exact draw from the filtered softmax.
Filters on the temperature-scaled logits: top-k and top-p (``keep_mask``, one stable sort, masses
in integer units so cumulative sums are exact) and min-p (``exp(x - max) >= min_p``); each row's
decisions depend on that row alone. Greedy (temperature 0, or below ``GREEDY_BELOW`` = 1e-5, where
``logits / T`` would leave fp32's range) is ``argmax``; ties go to the lowest token id. A row whose
logits are not finite still gets a token, and no other row's draw changes (rows never mix); the
engine then fails that request alone (``samebits.engine.isolation``). Both
see the logits after the request's logits processors (``samebits.engine.logits_processor``: bias,
penalties, min_tokens) and grammar masks; the reported logprobs are ``log_softmax`` of the *raw*
fp32 logits, taken by the runner through the invariant backend before the processors run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from samebits.engine.transfer import to_device
from samebits.sampling_params import SamplingParams

_M32 = 0xFFFFFFFF
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


def gumbel_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """keys [B, 2] int64 -> Gumbel(0, 1) noise [B, V] in fp32, a pure function of (key, token id)."""
    width = -(-vocab_size // 64) * 64  # whole 64-element rows: see pad_cols
    tokens = torch.arange(width, device=keys.device, dtype=torch.int64)
    h = mix32(mix32(keys[:, :1] ^ tokens[None, :]) ^ keys[:, 1:])
    h = mix32(h ^ 0x85EBCA6B)
    u = ((h >> 8).to(torch.float64) + 0.5) / float(1 << 24)  # (0, 1), never 0 or 1
    return (-torch.log(-torch.log(u))).float()[:, :vocab_size]


def pad_cols(x: torch.Tensor) -> torch.Tensor:
    """``x`` [B, L] with L zero-padded to a multiple of 64. A CPU elementwise kernel computes the
    tail of a tensor with its scalar function, whose exp/log may differ from the vectorised one in
    the last ulp; with whole 64-element rows every element takes the vectorised path."""
    pad = -x.shape[1] % 64
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def weights(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled logits x [B, V] -> (w = exp(x - row max) fp32, q = floor(w * 2**32) int64)."""
    w = torch.exp(pad_cols(x - x.amax(-1, keepdim=True)))[:, :x.shape[1]]
    return w, torch.floor(w * _MASS_SCALE).to(torch.int64)


def keep_mask(x: torch.Tensor, q: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                 ) -> torch.Tensor:
    """Top-k and top-p keep set of scaled logits x [B, V] with integer masses q: order the tokens by
    (logit desc, id asc) with one stable sort; top-k keeps the first k; top-p keeps a token while
    the mass strictly before it (within the top-k set) is below p times the top-k set's mass. The
    masses are integers, so every sum is exact, whatever the scan algorithm or the row's batch."""
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices
    rank = torch.arange(x.shape[-1], device=x.device)[None, :]
    drop = rank >= top_k[:, None]
    qs = q.gather(-1, order).masked_fill(drop, 0)
    total = qs.sum(-1, keepdim=True).double()
    before = (torch.cumsum(qs, dim=-1) - qs).double()
    drop |= (top_p[:, None] < 1) & (before >= top_p[:, None] * total)
    return ~torch.zeros_like(drop).scatter(-1, order, drop)


def draw(x: torch.Tensor, params: list[SamplingParams], keys: torch.Tensor) -> torch.Tensor:
    """One token per row of temperature-scaled logits x [B, V]: the Gumbel-max draw over the
    tokens top-k, top-p and min-p keep; ties go to the lowest id."""
    dev, v = x.device, x.shape[-1]
    w, q = weights(x)
    keep = w >= torch.tensor([p.min_p for p in params], device=dev, dtype=torch.float32)[:, None]
    if any(0 < p.top_k < v or p.top_p < 1 for p in params):
        top_k = torch.tensor([p.top_k if 0 < p.top_k < v else v for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=torch.float64)
        keep &= keep_mask(x, q, top_k, top_p)
    return _gumbel_argmax(x, keep, keys)


def _gumbel_argmax(x: torch.Tensor, keep: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """argmax over kept tokens of x + gumbel_noise (first maximum: ties -> lowest id); on CUDA one
    fused kernel computes the same function (ops/triton/gumbel.py)."""
    if x.is_cuda:
        from samebits.ops.triton.gumbel import gumbel_argmax
        return gumbel_argmax(x, keep, keys)
    return (x.masked_fill(~keep, -math.inf) + gumbel_noise(keys, x.shape[-1])).argmax(dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
           indices: list[int]) -> list[int]:
    """Processed logits [B, V] fp32 (``apply_logits_processors``) -> one token id per row."""
    pending = start_sample(logits, params, seeds, indices)
    return pending.complete(pending.tokens.tolist())


@dataclass
class PendingSample:
    """``sample``'s tokens, queued on the device and not yet read: ``tokens`` [B] int64, negative
    in rows the host must still complete; ``complete(ids)``, given ``tokens`` as the caller read
    them (with whatever else it reads in the same transfer), returns every row's token."""

    tokens: torch.Tensor
    complete: Callable[[list[int]], list[int]] = lambda ids: ids


def start_sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                 indices: list[int]) -> PendingSample:
    """Queue ``sample`` with no host sync. On CUDA the filtered draws take the rejection chain's
    first round (``sample_chained``: the same tokens, no sort); rows it leaves undecided are
    completed on the host (more rounds, then the sort), rarely."""
    if logits.is_cuda and not all(p.greedy for p in params):
        run = _chain(logits, params, seeds, indices)
        return PendingSample(run.out, lambda ids: _fallback(
            run.finish(ids), logits, params, seeds, indices))
    return PendingSample(_sorted(logits, params, seeds, indices))


def sample_sorted(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                  indices: list[int]) -> list[int]:
    """The definition, computed as written: one stable sort per filtered row (``keep_mask``)."""
    return _sorted(logits, params, seeds, indices).tolist()


def _sorted(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
            indices: list[int]) -> torch.Tensor:
    tokens = logits.argmax(dim=-1)  # first maximum: ties -> lowest id
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        dev = logits.device
        idx = to_device(rows, torch.int64, dev)
        temps = to_device([params[i].temperature for i in rows], torch.float32, dev)
        keys = to_device([stream_key(seeds[i], indices[i]) for i in rows], torch.int64,
                         dev)  # [B, 2]
        tokens[idx] = draw(logits[idx] / temps[:, None], [params[i] for i in rows], keys)
    return tokens


def chain_table(params: list[SamplingParams], seeds: list[int], indices: list[int], vocab: int
                ) -> tuple[list[float], int]:
    """The rejection chain's parameter table, flat, row by row (``rejection_chain.draw``), and
    the largest k < vocab of a filtered row (0: none). Every value is exact in fp64; the stream
    key is hashed on the device from the seed's words and the index."""
    table, kmax = [], 0
    for p, seed, index in zip(params, seeds, indices, strict=True):
        k = p.top_k if 0 < p.top_k < vocab else vocab
        kmax = max(kmax, k if k < vocab and not p.greedy else 0)
        table += [1.0 if p.greedy else p.temperature, float(p.greedy), k, p.top_p, p.min_p,
                  seed & _M32, (seed >> 32) & _M32, index & _M32]
    return table, kmax


def sample_chained(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                   indices: list[int], steps: int | None = None, max_steps: int | None = None,
                   chunk: int | None = None, block: int | None = None) -> list[int]:
    """``sample_sorted``'s tokens through the rejection chain (ops/triton/rejection_chain.py): the
    row parameters reach the device in one copy, a fixed number of launches, one host sync (more
    only while a row is undecided); rows the chain leaves undecided after ``max_steps`` steps, or
    not finite, are drawn by ``sample_sorted``. ``steps``, ``max_steps``, ``chunk`` and ``block``
    change the cost, never a token."""
    run = _chain(logits, params, seeds, indices, steps, max_steps, chunk, block)
    return _fallback(run.finish(run.out.tolist()), logits, params, seeds, indices)


def _chain(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
           indices: list[int], steps: int | None = None, max_steps: int | None = None,
           chunk: int | None = None, block: int | None = None):
    """The rejection chain's first round over these rows, queued (``rejection_chain.ChainDraw``;
    None: the chain's defaults)."""
    from samebits.ops.triton import rejection_chain as chain
    table, kmax = chain_table(params, seeds, indices, logits.shape[-1])
    table = to_device(table, torch.float64, logits.device).view(-1, chain.COLS)
    return chain.ChainDraw(logits, table, kmax, chain.STEPS if steps is None else steps,
                           chain.MAX_STEPS if max_steps is None else max_steps, chunk,
                           block or chain.BLOCK)


def _fallback(tokens: list[int], logits: torch.Tensor, params: list[SamplingParams],
              seeds: list[int], indices: list[int]) -> list[int]:
    """``tokens`` with the rows the chain left negative drawn by ``sample_sorted``."""
    rest = [i for i, t in enumerate(tokens) if t < 0]
    if rest:
        drawn = sample_sorted(logits[rest], [params[i] for i in rest], [seeds[i] for i in rest],
                              [indices[i] for i in rest])
        for i, t in zip(rest, drawn, strict=True):
            tokens[i] = t
    return tokens
