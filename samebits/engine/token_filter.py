"""Top-k / top-p / min-p keep sets, exact, without sorting the vocabulary.

The definition (``keep_by_sort``): order a row's tokens by (scaled logit desc, token id asc); top-k
keeps the first k; top-p keeps a token while the mass strictly before it (within the top-k set) is
below p times the top-k set's mass; min-p keeps ``exp(x - max) >= min_p``. Masses are counted in
integer units (``weights``), so every sum is exact whatever its order or algorithm.

``keep_by_radix`` computes the same set without a sort: it finds the boundary logit by radix
selection over the logits' bits (three passes of 11/11/10-bit digits, per-digit counts and masses
summed in integers), then splits the tie group at the boundary by token id. Each row's result
depends on that row alone and equals the definition's bit for bit (tests/unit/test_sampler.py
compares them on peaked, flat, tied and masked rows).
"""

from __future__ import annotations

import torch

_MASS_SCALE = 2.0 ** 32  # mass unit: 2**-32 of the most likely token's weight
_DIGITS = ((21, 11), (10, 11), (0, 10))  # (shift, width) of the radix passes over 32-bit keys


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


def keep_by_sort(x: torch.Tensor, q: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                 ) -> torch.Tensor:
    """The definition, through one stable descending sort of the whole vocabulary."""
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices
    rank = torch.arange(x.shape[-1], device=x.device)[None, :]
    drop = rank >= top_k[:, None]
    qs = q.gather(-1, order).masked_fill(drop, 0)
    total = qs.sum(-1, keepdim=True).double()
    before = (torch.cumsum(qs, dim=-1) - qs).double()
    drop |= (top_p[:, None] < 1) & (before >= top_p[:, None] * total)
    return ~torch.zeros_like(drop).scatter(-1, order, drop)


def _order_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 keys in [0, 2**32) ordered as the fp32 values (-0.0 and +0.0 equal)."""
    bits = (x + 0.0).view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) + (1 << 31)


def _suffix_bins(digit: torch.Tensor, weight: torch.Tensor, present: torch.Tensor, bins: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and digit value: (weight of tokens in strictly higher bins, any token in the bin)."""
    shape = (digit.shape[0], bins)
    w = torch.zeros(shape, dtype=torch.int64, device=digit.device).scatter_add_(1, digit, weight)
    n = torch.zeros(shape, dtype=torch.int64, device=digit.device).scatter_add_(1, digit, present)
    return w.flip(-1).cumsum(-1).flip(-1) - w, n > 0


def _boundary(keys: torch.Tensor, weight: torch.Tensor, limit: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the smallest present key u whose strictly-higher tokens weigh < ``limit``, and that
    weight (the tokens above u are the ones a sorted walk passes before reaching u). One pass per
    digit, most significant first, each within the prefix chosen so far."""
    prefix = torch.zeros(keys.shape[0], dtype=torch.int64, device=keys.device)
    base = torch.zeros_like(prefix)
    inside = torch.ones_like(keys)
    for shift, width in _DIGITS:
        bins = 1 << width
        digit = (keys >> shift) & (bins - 1)
        above, present = _suffix_bins(digit, weight * inside, inside, bins)
        above += base[:, None]
        values = torch.arange(bins, device=keys.device)[None, :]
        best = torch.where(present & (above.double() < limit[:, None]), values, bins).amin(-1)
        base = above.gather(1, best[:, None])[:, 0]
        prefix = (prefix << width) | best
        inside = inside * (digit == best[:, None])
    return prefix, base


def _first_of_ties(keys: torch.Tensor, boundary: torch.Tensor, weight: torch.Tensor,
                   above: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Keep mask: keys above the boundary, and the tokens of the boundary's tie group (in id order)
    while the weight before them stays below ``limit``."""
    tie = keys == boundary[:, None]
    w = weight * tie
    before = above[:, None] + torch.cumsum(w, dim=-1) - w
    return (keys > boundary[:, None]) | (tie & (before.double() < limit[:, None]))


def keep_by_radix(x: torch.Tensor, q: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                  ) -> torch.Tensor:
    """The definition's keep set (top-k and top-p) without a sort; see the module docstring."""
    keys = _order_keys(x)
    keep = torch.ones_like(x, dtype=torch.bool)
    if bool((top_k < x.shape[-1]).any()):
        ones, k = torch.ones_like(q), top_k.double()
        boundary, above = _boundary(keys, ones, k)
        keep = _first_of_ties(keys, boundary, ones, above, k)
    if bool((top_p < 1).any()):
        total = q.masked_fill(~keep, 0).sum(-1)
        limit = top_p * total.double()
        boundary, above = _boundary(keys, q, limit)
        keep &= _first_of_ties(keys, boundary, q, above, limit) | (top_p[:, None] >= 1)
    return keep
