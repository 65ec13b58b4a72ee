"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE (shared expert + sigmoid gate) and Mixtral.

The Llama decoder (``samebits.models.llama``) with the MLP of each sparse layer
(``MoeConfig.is_sparse``: ``decoder_sparse_step`` / ``mlp_only_layers``) replaced by a
``SparseMoeBlock``: router logits (the backend's linear), routing (``samebits.ops.moe.
select_experts``: fp32 softmax, top-k with ties to the lowest expert id), the experts and their
fixed-order fp32 combine (``samebits.ops.moe.fused_experts``). Attention, norms, the dense MLPs
and the LM head are the Llama decoder's own.

Expert weights are stacked at load: ``experts_gate_up`` holds expert e's gate rows then its up
rows at rows [2 I e, 2 I (e + 1)) ([E, 2I, H] as a view, transformers' in-memory layout),
``experts_down`` expert e's down_proj at rows [H e, H (e + 1)) ([E, H, I]). Each is one fused
parameter whose shards are the per-expert HF tensors (``model.layers.L.mlp.experts.e.gate_proj.
weight``...; Mixtral: ``block_sparse_moe.experts.e.w1/w3/w2``), so loading, ``update_weights``,
``named_weights`` and ``save_pretrained`` speak the checkpoint's per-expert names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from samebits.config import ModelConfig
from samebits.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, rope_inv_freq
from samebits.models.moe_config import MoeConfig
from samebits.models.weights import fused_param
from samebits.ops.backend import OpBackend
from samebits.ops.moe import fused_experts, select_experts, sigmoid_gate


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class SparseMoeBlock(nn.Module):
    """Router + ``E`` SwiGLU experts (+ Qwen2-MoE's gated shared expert) over [T, H] tokens."""

    def __init__(self, cfg: ModelConfig, moe: MoeConfig) -> None:
        super().__init__()
        e, h, i = moe.num_experts, cfg.hidden_size, moe.moe_intermediate_size
        self.moe = moe
        self.gate = _param(e, h)  # router weight
        self.experts_gate_up = fused_param([i] * (2 * e), h)  # [E, 2I, H] as a view
        self.experts_down = fused_param([h] * e, i)  # [E, H, I] as a view
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            shared = dataclasses.replace(cfg, intermediate_size=moe.shared_expert_intermediate_size)
            self.shared_expert = MLP(shared)
            self.shared_expert_gate = _param(1, h)

    def forward(self, ops: OpBackend, h: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        logits = ops.linear(h, self.gate)  # [T, E] in h's dtype
        weights, ids = select_experts(ops, logits, moe.top_k, moe.renormalize,
                                      moe.round_weights)
        shared = scale = None
        if self.shared_expert is not None:
            shared = self.shared_expert(ops, h)
            scale = sigmoid_gate(ops, ops.linear(h, self.shared_expert_gate))
        e = moe.num_experts
        return fused_experts(ops, h, self.experts_gate_up.view(e, -1, h.shape[-1]),
                             self.experts_down.view(e, h.shape[-1], -1), weights, ids, shared,
                             scale)


class MoeDecoderLayer(DecoderLayer):
    """The Llama layer (``DecoderLayer.forward``) with a sparse block or a dense MLP."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        nn.Module.__init__(self)
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = _param(cfg.hidden_size)
        self.post_attention_layernorm = _param(cfg.hidden_size)
        self.self_attn = Attention(cfg)
        self.mlp = SparseMoeBlock(cfg, cfg.moe) if cfg.moe.is_sparse(layer) else MLP(cfg)


class MoeForCausalLM(LlamaForCausalLM):
    """Qwen3MoeForCausalLM, Qwen2MoeForCausalLM and MixtralForCausalLM."""

    def __init__(self, cfg: ModelConfig, ops: OpBackend, max_model_len: int) -> None:
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture} has no mixture-of-experts config")
        nn.Module.__init__(self)
        self.cfg, self.ops = cfg, ops
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MoeDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = _param(cfg.hidden_size)
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size)
        freqs = torch.outer(torch.arange(max_model_len, dtype=torch.float32), rope_inv_freq(cfg))
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_model_len, D]
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)

    # ---- HF names ------------------------------------------------------------------------
    @property
    def _mixtral(self) -> bool:
        return self.cfg.architecture == "MixtralForCausalLM"

    def hf_names(self, param_name: str) -> list[str]:
        """HF tensor name of each shard of ``param_name``: one per expert (and gate / up)."""
        head, _, leaf = param_name.rpartition(".")  # "layers.3.mlp", "experts_gate_up"
        if leaf in ("experts_gate_up", "experts_down"):
            return list(self._expert_names(f"model.{head}.experts", leaf))
        names = super().hf_names(param_name)
        if self._mixtral:
            names = [n.replace(".mlp.", ".block_sparse_moe.") for n in names]
        return names

    def _expert_names(self, prefix: str, leaf: str) -> Iterator[str]:
        gate, up, down = ("w1", "w3", "w2") if self._mixtral else ("gate_proj", "up_proj",
                                                                  "down_proj")
        if self._mixtral:
            prefix = prefix.replace(".mlp.", ".block_sparse_moe.")
        for e in range(self.cfg.moe.num_experts):
            if leaf == "experts_down":
                yield f"{prefix}.{e}.{down}.weight"
            else:
                yield f"{prefix}.{e}.{gate}.weight"
                yield f"{prefix}.{e}.{up}.weight"

    def hf_rename(self, name: str) -> str:
        """A checkpoint name as ``hf_names`` spells it: Mixtral's in-memory ``mlp`` (written by
        ``save_original_format=False``) is its checkpoints' ``block_sparse_moe``."""
        return name.replace(".mlp.", ".block_sparse_moe.") if self._mixtral else name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Per-expert HF tensors (as transformers saves them), or transformers' stacked
        in-memory form (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I],
        ``save_original_format=False``) split into them."""
        from samebits.models.weights import load_weights
        load_weights(self, _unstacked(weights, self._mixtral))


def _unstacked(weights: Iterable[tuple[str, torch.Tensor]], mixtral: bool
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """Each stacked expert tensor as its per-expert HF tensors (views); others unchanged."""
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for name, t in weights:
        stem, _, leaf = name.rpartition(".experts.")
        if leaf == "gate_up_proj" and t.dim() == 3:
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{stem}.experts.{e}.{gate}.weight", t[e, :half]
                yield f"{stem}.experts.{e}.{up}.weight", t[e, half:]
        elif leaf == "down_proj" and t.dim() == 3:
            for e in range(t.shape[0]):
                yield f"{stem}.experts.{e}.{down}.weight", t[e]
        else:
            yield name, t
