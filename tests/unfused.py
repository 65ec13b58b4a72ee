"""The decoder's forward as it was before the fused ops, kept as the tests' yardstick.

Op for op what ``LlamaForCausalLM.forward`` computed with a separate residual add before each
RMSNorm, q/k norm through ``ops.rms_norm`` on the head views, RoPE by stock torch ops, two
``index_copy_`` into the cache, and SiLU then multiply: the fused path must give these bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from samebits.models.llama import Attention, DecoderLayer, LlamaForCausalLM
from samebits.ops.backend import AttentionMetadata, OpBackend, store_kv


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _attention(attn: Attention, ops: OpBackend, h: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata) -> torch.Tensor:
    t, hq, hkv, d = h.shape[0], attn.hq, attn.hkv, attn.d
    qkv = ops.linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    if attn.q_norm is not None:
        q = ops.rms_norm(q, attn.q_norm, attn.eps)
        k = ops.rms_norm(k, attn.k_norm, attn.eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    store_kv(k, v.contiguous(), kv_cache[0], kv_cache[1], meta.slot_mapping)
    o = ops.attention(q.contiguous(), kv_cache[0], kv_cache[1], meta, d ** -0.5)
    bounds = attn.o_proj.chains(ops)
    return ops.linear(o.reshape(t, hq * d), attn.o_proj.weight, k_bounds=bounds)


def stock_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _layer(layer: DecoderLayer, ops: OpBackend, h: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
           meta: AttentionMetadata, silu_mul: Callable) -> torch.Tensor:
    a = _attention(layer.self_attn, ops, ops.rms_norm(h, layer.input_layernorm, layer.eps), cos,
                   sin, kv_cache, meta)
    h = h + a
    mlp, x = layer.mlp, ops.rms_norm(h, layer.post_attention_layernorm, layer.eps)
    gate, up = ops.linear(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias).chunk(2, dim=-1)
    bounds = mlp.down_proj.chains(ops)
    act = _activation(ops, gate, up, bounds, silu_mul)
    return h + ops.linear(act, mlp.down_proj.weight, mlp.down_proj.bias, k_bounds=bounds)


def _activation(ops: OpBackend, gate: torch.Tensor, up: torch.Tensor, bounds,
                silu_mul: Callable | None) -> torch.Tensor:
    """SiLU(gate) * up as the ranks compute it, per K chain: ``silu_mul`` (a reference) on each
    chain's own columns; None: the backend's own (the CPU's is the definition of its rounding)."""
    if silu_mul is None:
        return ops.silu_mul(gate, up, bounds)
    if bounds is None:
        return silu_mul(gate, up)
    return torch.cat([silu_mul(gate[..., lo:hi].contiguous(), up[..., lo:hi].contiguous())
                      for lo, hi in bounds], dim=-1)


def unfused_forward(model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                    silu_mul: Callable | None = None) -> torch.Tensor:
    """``model.forward``'s hidden states, computed the unfused way (``silu_mul``: a reference
    for the MLP's activation, applied per K chain; None: the backend's own)."""
    h = F.embedding(input_ids, model.embed_tokens.weight)
    cos = model.rope_cos[positions].to(h.dtype)
    sin = model.rope_sin[positions].to(h.dtype)
    for layer, kv_cache in zip(model.layers, kv_caches, strict=True):
        h = _layer(layer, model.ops, h, cos, sin, kv_cache, meta, silu_mul)
    return model.ops.rms_norm(h, model.norm, model.cfg.rms_norm_eps)
