"""The standard backend: stock PyTorch ops (MKL, SDPA), as fast as the library makes them.

On CUDA, ``standard_cuda.py`` extends it with paged decode (torch has none).

It guarantees nothing about batch invariance: it is the baseline of every benchmark and the negative
control of every determinism test.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from samebits.ops import rope
from samebits.ops.backend import (
    AttentionMetadata,
    KBounds,
    NothingDeferred,
    check_sum_outs,
    into_sum_outs,
    norm_with_residual,
    one_chain_per_rank,
    register,
    sum_tree,
    tree_sum,
)
from samebits.ops.encoder import StandardEncoderOps


@register("cpu", False)
class StandardBackend(StandardEncoderOps, NothingDeferred):
    name = "standard"
    batch_invariant = False
    row_parallel_chains = staticmethod(one_chain_per_rank)  # stock kernels pick the K order
    sums_in_norm = False
    partials_into_norm_rows = 0

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
               k_bounds: KBounds | None = None) -> torch.Tensor:
        """Stock ``F.linear``; ``k_bounds`` is ignored (the library picks its own K order)."""
        return F.linear(x, w, b)

    def linear_partials(self, x: torch.Tensor, w: torch.Tensor, k_bounds: KBounds
                        ) -> torch.Tensor:
        """Stock ``F.linear`` of each segment's columns (a tensor-parallel rank's products)."""
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        return torch.stack([F.linear(x[..., lo:hi], w[:, lo:hi]).to(acc) for lo, hi in k_bounds])

    def linear_sum(self, x: torch.Tensor, w: torch.Tensor, k_bounds: KBounds,
                   out: torch.Tensor | None = None, peer_out: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """``tree_sum`` of ``linear_partials``; copied into ``out`` and ``peer_out`` when given
        (``check_sum_outs``), as the reference backend does."""
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        check_sum_outs(x, w.shape[0], acc, out, peer_out)
        return into_sum_outs(tree_sum(self.linear_partials(x, w, k_bounds)), out, peer_out)

    sum_tree = staticmethod(sum_tree)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor, k_bounds: KBounds | None = None
                 ) -> torch.Tensor:
        return F.silu(gate) * up

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """HF's formula; with ``residual``, a separate add first."""
        return norm_with_residual(self._rms_norm, x, w, eps, residual)

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(x.dtype)

    def qkv_rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       hq: int, hkv: int, d: int, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """The stock composition (``samebits.ops.rope``)."""
        return rope.qkv_rope_store(self._rms_norm, qkv, cos, sin, q_norm, k_norm, eps, k_cache,
                                   v_cache, slot_mapping, hq, hkv, d, out)

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x, dim=-1)

    def plan_attention(self, meta: AttentionMetadata) -> AttentionMetadata:
        return meta

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
        """SDPA over contexts gathered from the cache: every single-query sequence (decode) in
        one padded call, each longer chunk (prefill) in a call of its own (into ``out`` when
        given)."""
        out = torch.empty_like(q) if out is None else out
        qsl = meta.query_start_loc_list
        decode = [b for b in range(meta.num_seqs) if qsl[b + 1] - qsl[b] == 1]
        if decode:
            rows = [qsl[b] for b in decode]
            out[rows] = _sdpa(q[rows][:, None], k_cache, v_cache, meta, decode, scale)[:, 0]
        for b in range(meta.num_seqs):
            if qsl[b + 1] - qsl[b] > 1:
                out[qsl[b]:qsl[b + 1]] = _sdpa(q[None, qsl[b]:qsl[b + 1]], k_cache, v_cache,
                                               meta, [b], scale)[0]
        return out


def _sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
          seqs: list[int], scale: float) -> torch.Tensor:
    """q [n, q_len, Hq, D] of sequences ``seqs`` (each with q_len queries) -> [n, q_len, Hq, D]."""
    dev, bs = q.device, meta.block_size
    lens = torch.tensor([meta.seq_lens_list[b] for b in seqs], device=dev)
    pos = torch.arange(int(lens.max()), device=dev)
    tables = meta.block_tables[seqs].long()
    block = (pos // bs).clamp(max=tables.shape[1] - 1)
    slots = tables[:, block] * bs + pos % bs  # [n, L]
    k = k_cache.flatten(0, 1)[slots].transpose(1, 2)  # [n, Hkv, L, D]
    v = v_cache.flatten(0, 1)[slots].transpose(1, 2)
    q_pos = lens[:, None] - q.shape[1] + torch.arange(q.shape[1], device=dev)[None, :]
    mask = pos[None, None, :] <= q_pos[:, :, None]  # [n, q_len, L]; also hides padding keys
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None],
                                       scale=scale, enable_gqa=True)
    return o.transpose(1, 2)
