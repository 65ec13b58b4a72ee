"""The standard backend on CUDA: cuBLAS, torch's fused RMSNorm, SDPA for prefill, flash-decoding
for decode.

What a production engine runs when it does not promise invariance, so the invariant engine is
measured against a fast baseline rather than a strawman. Torch has no paged attention, so:

- prefill chunks go to SDPA (cuDNN / FlashAttention, whichever torch picks) on K/V gathered from
  the cache -- ``is_causal`` when the chunk starts the sequence, a lower-right causal bias
  otherwise;
- single-query sequences (decode) go to the paged split kernel of ``ops/triton/attention.py``
  with the split size chosen *from the batch*, as FlashDecoding and vLLM do: few splits when
  many sequences fill the GPU, many when few do. That choice is exactly what makes a token's bits
  depend on the batch, which is the point of this backend.

It guarantees nothing about batch invariance: it is the baseline of the CUDA benchmarks and the
negative control of the GPU determinism tests.
"""

from __future__ import annotations

import dataclasses
import functools
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from samebits.ops.backend import AttentionMetadata, register
from samebits.ops.standard import StandardBackend
from samebits.ops.triton import attention as paged
from samebits.ops.triton import launcher

MIN_SPLIT = 256  # keys; the smallest split the batch-driven choice may pick


def _num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device`` (an H100's 132 off CUDA: the interpreter tests)."""
    return _cuda_sms(device.index or 0) if device.type == "cuda" else 132


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_split_size(num_tokens: int, max_len: int, num_sms: int) -> int:
    """Split size for ``num_tokens`` decode queries over at most ``max_len`` keys: enough splits
    that the tokens' programs cover every SM, each split a power of two >= MIN_SPLIT keys (a
    handful of compiled variants)."""
    splits = max(1, min(-(-num_sms // max(num_tokens, 1)), -(-max_len // MIN_SPLIT)))
    per_split = -(-max_len // splits)
    return max(MIN_SPLIT, 1 << (per_split - 1).bit_length())


@register("cuda", False)
class StandardCudaBackend(StandardBackend):
    name = "standard-cuda"
    batch_invariant = False

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """torch's fused RMSNorm (one kernel; fp32 inside, one rounding at the end)."""
        return F.rms_norm(x, w.shape, w, eps)

    def plan_attention(self, meta: AttentionMetadata) -> AttentionMetadata:
        qsl = meta.query_start_loc_list
        dec = [meta.seq_lens_list[b] for b in range(meta.num_seqs) if qsl[b + 1] - qsl[b] == 1]
        split = decode_split_size(len(dec), max(dec, default=1),
                                  _num_sms(meta.seq_lens.device))
        return dataclasses.replace(meta, plan=paged.plan(meta, min_prefill=2, split_size=split))

    def plan_decode(self, meta: AttentionMetadata, positions: torch.Tensor, max_len: int
                    ) -> AttentionMetadata:
        """The pure-decode plan over caller-owned tensors (CUDA graphs); see paged.plan_decode."""
        split = decode_split_size(positions.shape[0], max_len, _num_sms(positions.device))
        plan = paged.plan_decode(meta, positions, -(-max_len // split), split)
        return dataclasses.replace(meta, plan=plan)

    def as_captured(self) -> AbstractContextManager[None]:
        """The paged attention's Triton kernels as in the engine's graphs (stock ops launch the
        same way in and out of them)."""
        return launcher.as_captured()

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
        p = meta.plan if isinstance(meta.plan, paged.TritonAttentionPlan) else \
            self.plan_attention(meta).plan
        out = torch.empty_like(q) if out is None else out
        paged.decode(q, k_cache, v_cache, meta, p, scale, out)
        qsl = meta.query_start_loc_list
        for b in range(meta.num_seqs):
            lo, hi = qsl[b], qsl[b + 1]
            if hi - lo > 1:
                out[lo:hi] = self._prefill(q[lo:hi], k_cache, v_cache, meta, b, scale)
        return out

    @staticmethod
    def _prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, b: int, scale: float) -> torch.Tensor:
        """SDPA for one chunk q [n, Hq, D] of sequence b, over its whole context [L, Hkv, D].

        Contiguous [1, H, len, D] operands, so torch may pick cuDNN or FlashAttention; a chunk
        after cached context needs a lower-right causal mask, which only the memory-efficient
        kernel takes, and that one has no GQA: its K/V heads are repeated."""
        n, hq, _ = q.shape
        ctx = meta.seq_lens_list[b]
        slots = _slots(meta, b, ctx)
        k = k_cache.flatten(0, 1)[slots].transpose(0, 1)[None]  # [1, Hkv, L, D]
        v = v_cache.flatten(0, 1)[slots].transpose(0, 1)[None]
        qh = q.transpose(0, 1)[None].contiguous()  # [1, Hq, n, D]
        if ctx == n:
            o = F.scaled_dot_product_attention(qh, k.contiguous(), v.contiguous(), is_causal=True,
                                               scale=scale, enable_gqa=True)
        else:
            g = hq // k.shape[1]
            o = F.scaled_dot_product_attention(
                qh, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1),
                attn_mask=causal_lower_right(n, ctx), scale=scale)
        return o[0].transpose(0, 1)  # [n, Hq, D]


def _slots(meta: AttentionMetadata, b: int, n: int) -> torch.Tensor:
    """Cache slots of positions [0, n) of sequence b."""
    pos = torch.arange(n, device=meta.block_tables.device)
    return meta.block_tables[b].long()[pos // meta.block_size] * meta.block_size \
        + pos % meta.block_size
