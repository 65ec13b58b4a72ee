"""The standard backend: stock PyTorch ops (MKL / cuBLAS / SDPA), as fast as the library makes them.

It guarantees nothing about batch invariance: it is the baseline of every benchmark and the negative
control of every determinism test.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from samebits.ops.backend import AttentionMetadata, register


@register("cpu", False)
@register("cuda", False)
class StandardBackend:
    name = "standard"
    batch_invariant = False

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
               ) -> torch.Tensor:
        return F.linear(x, w, b)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(x.dtype)

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x, dim=-1)

    def plan_attention(self, meta: AttentionMetadata) -> AttentionMetadata:
        return meta

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """SDPA per sequence over its context gathered contiguously from the cache."""
        out = torch.empty_like(q)
        qsl, bs = meta.query_start_loc_list, meta.block_size
        for b, seq_len in enumerate(meta.seq_lens_list):
            qs, qe = qsl[b], qsl[b + 1]
            pos = torch.arange(seq_len, device=q.device)
            slots = meta.block_tables[b, pos // bs].long() * bs + pos % bs
            k = k_cache.flatten(0, 1)[slots].transpose(0, 1)  # [Hkv, L, D]
            v = v_cache.flatten(0, 1)[slots].transpose(0, 1)
            qb = q[qs:qe].transpose(0, 1)  # [Hq, q_len, D]
            q_pos = pos[seq_len - (qe - qs):]
            mask = pos[None, :] <= q_pos[:, None]  # [q_len, L]
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
            out[qs:qe] = o.transpose(0, 1)
        return out
