"""One decoder for LlamaForCausalLM (Llama 2/3, SmolLM2, Mistral), Qwen2 (qkv bias) and Qwen3
(per-head q/k RMSNorm), with GQA and tied or untied embeddings, over a paged KV cache.

Every reduction goes through the ``OpBackend`` the model was built with; everything else here is
elementwise and does the same casts in the same order on every path, so the invariance of the
backend carries over to the logits. The residual stream is carried as in nano-vLLM: a layer
returns (its MLP output, the stream before it) and the next RMSNorm adds the two
(``rms_norm(x, w, eps, residual)``), the bits of separate adds; q/k norm, RoPE and the KV-cache
write are one op (``qkv_rope_store``), which a backend may fuse. The row-parallel linears (o_proj,
down_proj) pass the model's K segments (``samebits.distributed.segments.k_bounds``: S = the KV
heads) to the backend, so one device computes the tensor-parallel arithmetic and gives the bits
of every TP size.
Shapes: T = tokens in the flat batch, H = hidden size, Hq / Hkv = query / KV heads, D = head dim.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from samebits.config import ModelConfig, ModelFormatError
from samebits.distributed.segments import k_bounds
from samebits.models.weights import fused_param, packed_hf_names
from samebits.ops.backend import AttentionMetadata, OpBackend


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2] in fp32, with Llama-3 or linear scaling as HF computes them."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ModelFormatError(f"config.json: unsupported rope_scaling type {kind!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        shards = [self.hq * self.d, self.hkv * self.d, self.hkv * self.d]  # q, k, v rows
        self.qkv_proj = fused_param(shards, cfg.hidden_size)
        self.qkv_bias = fused_param(shards) if cfg.attention_bias else None
        self.o_proj = _param(cfg.hidden_size, self.hq * self.d)
        self.o_bounds = k_bounds(cfg, self.hq * self.d)  # segment g: KV group g's columns
        self.q_norm = _param(self.d) if cfg.qk_norm else None
        self.k_norm = _param(self.d) if cfg.qk_norm else None

    def forward(self, ops: OpBackend, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> torch.Tensor:
        t = h.shape[0]
        qkv = ops.linear(h, self.qkv_proj, self.qkv_bias)  # [T, (Hq + 2 Hkv) D]
        # q/k norm (Qwen3), RoPE, K/V into the cache; q [T, Hq, D]
        q = ops.qkv_rope_store(qkv, cos, sin, self.q_norm, self.k_norm, self.eps, kv_cache[0],
                               kv_cache[1], meta.slot_mapping, self.hq, self.hkv, self.d)
        o = ops.attention(q, kv_cache[0], kv_cache[1], meta, self.d ** -0.5)
        bounds = self.o_bounds if ops.row_parallel_segments else None
        return ops.linear(o.reshape(t, self.hq * self.d), self.o_proj, k_bounds=bounds)  # [T, H]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        shards = [cfg.intermediate_size] * 2  # gate, up rows
        self.gate_up_proj = fused_param(shards, cfg.hidden_size)
        self.gate_up_bias = fused_param(shards) if cfg.mlp_bias else None
        self.down_proj = _param(cfg.hidden_size, cfg.intermediate_size)
        self.down_bias = _param(cfg.hidden_size) if cfg.mlp_bias else None
        self.down_bounds = k_bounds(cfg, cfg.intermediate_size)

    def forward(self, ops: OpBackend, h: torch.Tensor) -> torch.Tensor:
        gate, up = ops.linear(h, self.gate_up_proj, self.gate_up_bias).chunk(2, dim=-1)
        bounds = self.down_bounds if ops.row_parallel_segments else None
        act = ops.silu_mul(gate, up, bounds)
        return ops.linear(act, self.down_proj, self.down_bias, k_bounds=bounds)


def add_norm(ops: OpBackend, h: torch.Tensor, w: torch.Tensor, eps: float,
             residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's norm: (rms_norm(h + residual), h + residual), the add fused into
    the norm; before the first layer there is no stream yet: (rms_norm(h), h)."""
    if residual is None:
        return ops.rms_norm(h, w, eps), h
    return ops.rms_norm(h, w, eps, residual)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = _param(cfg.hidden_size)
        self.post_attention_layernorm = _param(cfg.hidden_size)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, ops: OpBackend, h: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor, sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the previous layer's MLP output (the embeddings, with ``residual`` None, for the
        first layer); residual: the stream h is to be added to. Returns (this layer's MLP
        output, the stream before it). Each add is fused into the norm that follows it: the bits
        of ``h = h + attn(norm(h)); h = h + mlp(norm(h))``."""
        x, residual = add_norm(ops, h, self.input_layernorm, self.eps, residual)
        a = self.self_attn(ops, x, cos, sin, kv_cache, meta)
        x, residual = ops.rms_norm(a, self.post_attention_layernorm, self.eps, residual)
        return self.mlp(ops, x), residual


class LlamaForCausalLM(nn.Module):
    """The decoder. ``forward`` returns hidden states; ``compute_logits`` the fp32 logits."""

    def __init__(self, cfg: ModelConfig, ops: OpBackend, max_model_len: int) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = _param(cfg.hidden_size)
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size)
        freqs = torch.outer(torch.arange(max_model_len, dtype=torch.float32), rope_inv_freq(cfg))
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_model_len, D]
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata
                ) -> torch.Tensor:
        h, residual = self.embed(input_ids), None  # [T, H]
        h, residual = self.run_layers(h, residual, positions, kv_caches, meta,
                                      range(len(self.layers)))
        return self.final_norm(h, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens)

    def run_layers(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                   kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                   layers: range) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layers ``layers`` of ``forward`` on (h, residual) -- (embeddings, None) before layer 0:
        consecutive ranges compose to the whole forward, bit for bit (CUDA-graph pieces)."""
        cos, sin = self.rope_cos[positions].to(h.dtype), self.rope_sin[positions].to(h.dtype)
        for i in layers:
            h, residual = self.layers[i](self.ops, h, residual, cos, sin, kv_caches[i], meta)
        return h, residual

    def final_norm(self, h: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return add_norm(self.ops, h, self.norm, self.cfg.rms_norm_eps, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] in fp32."""
        w = self.embed_tokens if self.lm_head is None else self.lm_head
        return self.ops.linear(hidden, w).float()

    # ---- HF names (samebits.models.weights) ----------------------------------------------
    packed_modules_mapping = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2),
                              "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1)}

    def hf_names(self, param_name: str) -> list[str]:
        """HF tensor name of each shard of parameter ``param_name``."""
        if param_name in _TOP:
            return [_TOP[param_name]]
        head, _, leaf = param_name.rpartition(".")  # "layers.3.self_attn", "qkv_proj"
        prefix = f"model.{head}."
        stem, kind = (leaf[:-5], "bias") if leaf.endswith("_bias") else (leaf[:-5], "weight")
        if stem in ("qkv", "gate_up"):
            return packed_hf_names(self, prefix, stem, kind)
        if kind == "bias" or leaf.endswith("_proj"):
            return [f"{prefix}{stem}_proj.{kind}"]
        return [f"{prefix}{leaf}.weight"]  # norms

    def hf_ignored(self, name: str) -> bool:
        """Checkpoint tensors that fill no parameter: rotary tables, a tied head's copy."""
        return "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; every parameter must be covered."""
        from samebits.models.weights import load_weights
        load_weights(self, weights)


_TOP = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.norm.weight",
        "lm_head": "lm_head.weight"}
