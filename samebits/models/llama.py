"""One decoder for LlamaForCausalLM (Llama 2/3, SmolLM2, Mistral), Qwen2 (qkv bias) and Qwen3
(per-head q/k RMSNorm), with GQA and tied or untied embeddings, over a paged KV cache.

Every reduction goes through the ``OpBackend`` the model was built with; everything else here is
elementwise and does the same casts in the same order on every path, so the invariance of the
backend carries over to the logits. The residual stream is carried as in nano-vLLM: a layer
returns (its MLP output, the stream before it) and the next RMSNorm adds the two
(``rms_norm(x, w, eps, residual)``), the bits of separate adds; under tensor parallel the
row-parallel output it adds may be a ``PendingRankSum`` that this norm sums (the bits of summing
first: ``samebits.models.parallel``), so a layer's output is a ``Hidden``. q/k norm, RoPE and the
KV-cache write are one op (``qkv_rope_store``), which a backend may fuse.

One definition at every tensor-parallel size: the projections are the parallel layers of
``samebits.models.parallel`` (S = the KV heads segments), so a rank builds and loads only its
shard -- its KV groups' q/k/v heads and KV cache, its MLP slices, its vocab rows -- and one
device is the rank that owns every segment. The architecture's quirks (q/k norm, the defaults
of attention bias and tied embeddings) come from its registry entry.
Shapes: T = tokens in the flat batch, H = hidden size, Hq / Hkv = query / KV heads (this rank's
in the attention), D = head dim.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from samebits.config import ModelConfig, ModelFormatError
from samebits.distributed.group import TPGroup
from samebits.models.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    replicated_param,
)
from samebits.models.registry import architecture
from samebits.models.weights import load_weights, packed_hf_names
from samebits.ops.backend import AttentionMetadata, OpBackend
from samebits.ops.pending_merge import PendingMerge
from samebits.ops.pending_rank_sum import PendingRankSum, resolved

Hidden = torch.Tensor | PendingRankSum  # a layer's o_proj / MLP output, as the next norm takes it


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
    """``chains``: o_proj's K chains (``OpBackend.row_parallel_chains``), as MLP's down_proj."""

    def __init__(self, cfg: ModelConfig, group: TPGroup, chains: int, qk_norm: bool,
                 bias: bool) -> None:
        super().__init__()
        self.d, self.eps = cfg.head_dim, cfg.rms_norm_eps
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.d, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, group, bias)
        self.hq, self.hkv = self.qkv_proj.hq, self.qkv_proj.hkv  # this rank's heads
        # segment g of o_proj's K: KV group g's columns
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.d, cfg.hidden_size,
                                        cfg.num_key_value_heads, group, chains, into_norm=True)
        self.q_norm = replicated_param(self.d) if qk_norm else None
        self.k_norm = replicated_param(self.d) if qk_norm else None

    def forward(self, ops: OpBackend, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> Hidden:
        t = h.shape[0]
        qkv = self.qkv_proj(ops, h)  # [T, (Hq + 2 Hkv) D]
        # q/k norm (Qwen3), RoPE, K/V into the cache; q [T, Hq, D]
        q = ops.qkv_rope_store(qkv, cos, sin, self.q_norm, self.k_norm, self.eps, kv_cache[0],
                               kv_cache[1], meta.slot_mapping, self.hq, self.hkv, self.d)
        # one token: its attention may come unmerged (a PendingMerge), for o_proj to merge
        attend = ops.attention_deferred if t == 1 else ops.attention
        o = attend(q, kv_cache[0], kv_cache[1], meta, self.d ** -0.5)
        if not isinstance(o, PendingMerge):
            o = o.reshape(t, self.hq * self.d)
        return self.o_proj(ops, o)  # [T, H]


class MLP(nn.Module):
    """SwiGLU. ``into_norm``: its output goes straight into the residual add + norm (a decoder
    layer's MLP), so it may be a ``PendingRankSum``; else always a tensor."""

    def __init__(self, cfg: ModelConfig, group: TPGroup, chains: int,
                 into_norm: bool = False) -> None:
        super().__init__()
        inter, segments = cfg.intermediate_size, cfg.num_key_value_heads
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], segments, group,
                                                 cfg.mlp_bias)  # [gate; up]
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, segments, group, chains,
                                           cfg.mlp_bias, into_norm)

    def forward(self, ops: OpBackend, h: torch.Tensor) -> Hidden:
        gate, up = self.gate_up_proj(ops, h).chunk(2, dim=-1)
        act = ops.silu_mul(gate, up, self.down_proj.chains(ops))
        return self.down_proj(ops, act)


def add_norm(ops: OpBackend, h: Hidden, w: torch.Tensor, eps: float,
             residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's norm: (rms_norm(h + residual), h + residual), the add fused into
    the norm; before the first layer there is no stream yet: (rms_norm(h), h)."""
    if residual is None:
        h = resolved(ops, h)
        return ops.rms_norm(h, w, eps), h
    return ops.rms_norm(h, w, eps, residual)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, group: TPGroup, chains: int, qk_norm: bool,
                 bias: bool) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = replicated_param(cfg.hidden_size)
        self.post_attention_layernorm = replicated_param(cfg.hidden_size)
        self.self_attn = Attention(cfg, group, chains, qk_norm, bias)
        self.mlp = MLP(cfg, group, chains, into_norm=True)

    def forward(self, ops: OpBackend, h: Hidden, residual: torch.Tensor | None,
                cos: torch.Tensor, sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> tuple[Hidden, torch.Tensor]:
        """h: the previous layer's MLP output (the embeddings, with ``residual`` None, for the
        first layer); residual: the stream h is to be added to. Returns (this layer's MLP
        output, the stream before it). Each add is fused into the norm that follows it: the bits
        of ``h = h + attn(norm(h)); h = h + mlp(norm(h))``."""
        x, residual = add_norm(ops, h, self.input_layernorm, self.eps, residual)
        a = self.self_attn(ops, x, cos, sin, kv_cache, meta)
        x, residual = ops.rms_norm(a, self.post_attention_layernorm, self.eps, residual)
        return self.mlp(ops, x), residual


class LlamaForCausalLM(nn.Module):
    """The decoder (this rank's shard of it). ``forward`` returns hidden states (the same on
    every rank); ``compute_logits`` the fp32 logits over the whole vocabulary."""

    def __init__(self, cfg: ModelConfig, ops: OpBackend, max_model_len: int,
                 group: TPGroup | None = None) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.group = group = group or TPGroup()
        arch = architecture(cfg.architecture)
        bias = arch.resolve("attention_bias", cfg.attention_bias)
        tied = arch.resolve("tie_word_embeddings", cfg.tie_word_embeddings)
        segments = cfg.num_key_value_heads
        chains = ops.row_parallel_chains(segments, group.world_size)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, segments,
                                                   group)
        self.layers = nn.ModuleList(self.decoder_layer(cfg, group, chains, arch.qk_norm, bias, i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = replicated_param(cfg.hidden_size)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, segments, group,
                                      self.embed_tokens if tied else None)
        freqs = torch.outer(torch.arange(max_model_len, dtype=torch.float32), rope_inv_freq(cfg))
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_model_len, D]
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)

    def decoder_layer(self, cfg: ModelConfig, group: TPGroup, chains: int, qk_norm: bool,
                      bias: bool, index: int) -> nn.Module:
        """Layer ``index`` (a subclass varies it: ``samebits.models.moe``'s sparse layers)."""
        return DecoderLayer(cfg, group, chains, qk_norm, bias)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One layer's K (or V) cache on this rank: its KV heads only."""
        attn = self.layers[0].self_attn
        return (num_blocks, block_size, attn.hkv, attn.d)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata
                ) -> torch.Tensor:
        h, residual = self.embed(input_ids), None  # [T, H]
        h, residual = self.run_layers(h, residual, positions, kv_caches, meta,
                                      range(len(self.layers)))
        return self.final_norm(h, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def run_layers(self, h: Hidden, residual: torch.Tensor | None, positions: torch.Tensor,
                   kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                   layers: range) -> tuple[Hidden, torch.Tensor | None]:
        """Layers ``layers`` of ``forward`` on (h, residual) -- (embeddings, None) before layer 0:
        consecutive ranges compose to the whole forward, bit for bit (CUDA-graph pieces)."""
        cos, sin = self.rope_cos[positions].to(h.dtype), self.rope_sin[positions].to(h.dtype)
        for i in layers:
            h, residual = self.layers[i](self.ops, h, residual, cos, sin, kv_caches[i], meta)
        return h, residual

    def final_norm(self, h: Hidden, residual: torch.Tensor | None) -> torch.Tensor:
        return add_norm(self.ops, h, self.norm, self.cfg.rms_norm_eps, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] in fp32 (a collective under tensor parallel)."""
        return self.lm_head(self.ops, hidden)

    # ---- HF names (samebits.models.weights) ----------------------------------------------
    packed_modules_mapping = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1),
                              "v_proj": ("qkv_proj", 2), "gate_proj": ("gate_up_proj", 0),
                              "up_proj": ("gate_up_proj", 1)}

    def hf_names(self, param_name: str) -> list[str]:
        """HF tensor name of each shard of parameter ``param_name``."""
        if param_name in _TOP:
            return [_TOP[param_name]]
        head, _, leaf = param_name.rpartition(".")  # "layers.3.self_attn.qkv_proj", "weight"
        if leaf in ("weight", "bias"):
            module, _, stem = head.rpartition(".")
            if stem in ("qkv_proj", "gate_up_proj"):
                return packed_hf_names(self, f"model.{module}.", stem, leaf)
            return [f"model.{head}.{leaf}"]
        return [f"model.{param_name}.weight"]  # norms

    def hf_ignored(self, name: str) -> bool:
        """Checkpoint tensors that fill no parameter: rotary tables, a tied head's copy."""
        return "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head.tied)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (this rank's part of each), fusing q/k/v and gate/up; every
        parameter must be covered."""
        load_weights(self, weights)


_TOP = {"embed_tokens.weight": "model.embed_tokens.weight", "norm": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}
