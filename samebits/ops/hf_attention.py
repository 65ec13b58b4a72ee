"""The engine's attention as Hugging Face's ``"sdpa"`` attention function, for
``batch_invariant()``.

HF's sdpa path calls a fused CPU flash-attention kernel (its own block size, exp and
normalisation) that no aten override can make agree with the engine. So inside
``batch_invariant()`` the ``"sdpa"`` entry of transformers' ``AttentionInterface`` registry points
here: each batch item becomes one sequence of the engine's paged attention (keys laid out in
16-token blocks, ``attention_split_size``-key splits), so every real query gets the engine's
arithmetic bit for bit. A right-padded batch with an attention mask is supported (each item's
length is its count of unmasked keys in the last real query row); anything else -- a KV cache
longer than the queries (HF ``generate`` with a cache), left padding, non-causal attention,
dropout -- runs HF's own function.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

import samebits.ops as ops
from samebits.ops.autograd import attention_vjp, invariant_apply
from samebits.ops.backend import AttentionMetadata, get_backend

BLOCK = 16  # keys per cache block of the per-call cache (the bits do not depend on it)
SPLIT = 128  # EngineConfig.attention_split_size's default: the engine's split


def _lengths(mask: torch.Tensor | None, b: int, s: int) -> list[int] | None:
    """Each item's real length if ``mask`` is causal + right padding (None mask: all ``s``)."""
    if mask is None:
        return [s] * b
    if mask.dim() != 4 or mask.shape[-2:] != (s, s):
        return None
    allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0  # [B, S, S]
    causal = torch.ones(s, s, dtype=torch.bool, device=mask.device).tril()
    lens = []
    for i in range(b):
        n = int(allowed[i].diagonal().long().cumprod(0).sum())  # leading real positions
        expect = causal.clone()
        expect[:n, n:] = False
        if not torch.equal(allowed[i, :n], expect[:n]):
            return None
        lens.append(max(n, 1))
    return lens


def _meta(lens: list[int], blocks: int, device: torch.device) -> AttentionMetadata:
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    tables = torch.arange(len(lens) * blocks, dtype=torch.int32, device=device).view(len(lens), -1)
    meta = AttentionMetadata(tables, torch.tensor(lens, dtype=torch.int32, device=device),
                             torch.tensor(qsl, dtype=torch.int32, device=device),
                             torch.empty(0, dtype=torch.int64, device=device), tuple(lens),
                             tuple(qsl), BLOCK, SPLIT)
    return get_backend(device, batch_invariant=True).plan_attention(meta)


def engine_sdpa(stock: Callable, busy: Callable, module: torch.nn.Module, query: torch.Tensor,
                key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention signature: query [B, Hq, S, D], key/value [B, Hkv, S, D] -> [B, S, Hq, D]."""
    b, hq, s, d = query.shape
    lens = _lengths(attention_mask, b, s)
    if (lens is None or key.shape[2] != s or dropout or is_causal is False
            or not getattr(module, "is_causal", True)):
        return stock(module, query, key, value, attention_mask, dropout=dropout,
                     scaling=scaling, is_causal=is_causal, **kwargs)
    blocks = -(-s // BLOCK)
    pad = blocks * BLOCK - s

    def cache(t: torch.Tensor) -> torch.Tensor:  # [B, Hkv, S, D] -> [B * blocks, BLOCK, Hkv, D]
        t = torch.nn.functional.pad(t.transpose(1, 2), (0, 0, 0, 0, 0, pad))
        return t.reshape(b * blocks, BLOCK, t.shape[2], d)

    q = torch.cat([query[i, :, :n].transpose(0, 1) for i, n in enumerate(lens)])  # [T, Hq, D]
    meta = _meta(lens, blocks, query.device)
    scale = d ** -0.5 if scaling is None else scaling
    with busy():  # nested aten calls of the engine's kernel run stock, as in the engine
        out = invariant_apply(partial(ops.attention, meta=meta, scale=scale),
                              attention_vjp(query, meta, scale),
                              q.contiguous(), cache(key), cache(value))
    result = query.new_zeros(b, s, hq, d)
    for i, part in enumerate(out.split(lens)):
        result[i, :lens[i]] = part
    return result, None
