"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE (shared expert + sigmoid gate) and Mixtral.

The Llama decoder (``samebits.models.llama``) with the MLP of each sparse layer
(``MoeConfig.is_sparse``: ``decoder_sparse_step`` / ``mlp_only_layers``) replaced by a
``SparseMoeBlock``: router logits (the backend's linear), routing (``samebits.ops.moe.
select_experts``: fp32 softmax, top-k with ties to the lowest expert id), the experts and their
fixed-order fp32 combine (``samebits.ops.moe.fused_experts``). Attention, norms, the dense MLPs
(and Qwen2-MoE's shared expert, a dense MLP) and the LM head are the Llama decoder's own.

Expert weights are stacked at load: ``experts_gate_up`` holds expert e's gate rows then its up
rows at rows [2 I e, 2 I (e + 1)) ([E, 2I, H] as a view, transformers' in-memory layout),
``experts_down`` expert e's down_proj at rows [H e, H (e + 1)) ([E, H, I]). Each is one fused
parameter whose shards are the per-expert HF tensors (``model.layers.L.mlp.experts.e.gate_proj.
weight``...; Mixtral: ``block_sparse_moe.experts.e.w1/w3/w2``), so loading, ``update_weights``,
``named_weights`` and ``save_pretrained`` speak the checkpoint's per-expert names.

Under tensor parallel the attention, dense MLPs and shared expert are split as the Llama
decoder's; the experts are split by expert (``expert_param``): rank r holds experts
[r E/N, (r+1) E/N) whole, computes the outputs of the assignments routed to them
(``expert_outputs``), and the ranks gather every assignment's output from the rank holding its
expert before the same fixed-order combine (``combine_experts``). An expert's output is one
device's arithmetic whatever N, and the combine sees the same values in the same order, so every
N dividing E (and the KV heads) gives the bits of one device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from samebits.distributed.group import TPGroup
from samebits.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from samebits.models.moe_config import MoeModelConfig
from samebits.models.parallel import expert_param, replicated_param
from samebits.models.weights import tensor_shape
from samebits.ops.backend import OpBackend
from samebits.ops.moe import (
    combine_experts,
    expert_outputs,
    fused_experts,
    select_experts,
    sigmoid_gate,
)


class SparseMoeBlock(nn.Module):
    """Router + ``E`` SwiGLU experts (+ Qwen2-MoE's gated shared expert) over [T, H] tokens."""

    def __init__(self, cfg: MoeModelConfig, group: TPGroup, chains: int) -> None:
        super().__init__()
        moe = self.moe = cfg.moe
        e, h, i = moe.num_experts, cfg.hidden_size, moe.moe_intermediate_size
        self.group = group
        self.gate = replicated_param(e, h)  # router weight
        self.experts_gate_up = expert_param(e, [i, i], h, group)  # [E', 2I, H] as a view
        self.experts_down = expert_param(e, [h], i, group)  # [E', H, I] as a view
        self.local_experts = e // group.world_size
        self.first_expert = group.rank * self.local_experts
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            shared = dataclasses.replace(cfg, intermediate_size=moe.shared_expert_intermediate_size)
            self.shared_expert = MLP(shared, group, chains)
            self.shared_expert_gate = replicated_param(1, h)

    def forward(self, ops: OpBackend, h: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        logits = ops.linear(h, self.gate)  # [T, E] in h's dtype
        weights, ids = select_experts(ops, logits, moe.top_k, moe.renormalize,
                                      moe.round_weights)
        shared = scale = None
        if self.shared_expert is not None:
            shared = self.shared_expert(ops, h)
            scale = sigmoid_gate(ops, ops.linear(h, self.shared_expert_gate))
        e = self.local_experts
        w13 = self.experts_gate_up.view(e, -1, h.shape[-1])
        w2 = self.experts_down.view(e, h.shape[-1], -1)
        if self.group.world_size == 1:
            return fused_experts(ops, h, w13, w2, weights, ids, shared, scale)
        y = expert_outputs(ops, h, w13, w2, ids, self.first_expert, moe.num_experts)
        return combine_experts(ops, self.gathered(y, ids), weights, shared, scale)

    def gathered(self, y: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """y [T, k, H] with every slot from the rank holding its expert (in rank order)."""
        every = self.group.all_gather(y.unsqueeze(0))  # [N, T, k, H]
        owner = (ids // self.local_experts).long()[None, :, :, None]
        return torch.take_along_dim(every, owner, dim=0)[0]


class MoeDecoderLayer(DecoderLayer):
    """The Llama layer (``DecoderLayer.forward``) with a sparse block or a dense MLP."""

    def __init__(self, cfg: MoeModelConfig, group: TPGroup, chains: int, qk_norm: bool,
                 bias: bool, index: int) -> None:
        nn.Module.__init__(self)
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = replicated_param(cfg.hidden_size)
        self.post_attention_layernorm = replicated_param(cfg.hidden_size)
        self.self_attn = Attention(cfg, group, chains, qk_norm, bias)
        self.mlp = (SparseMoeBlock(cfg, group, chains) if cfg.moe.is_sparse(index)
                    else MLP(cfg, group, chains))


class MoeForCausalLM(LlamaForCausalLM):
    """Qwen3MoeForCausalLM, Qwen2MoeForCausalLM and MixtralForCausalLM."""

    def decoder_layer(self, cfg: MoeModelConfig, group: TPGroup, chains: int, qk_norm: bool,
                      bias: bool, index: int) -> nn.Module:
        return MoeDecoderLayer(cfg, group, chains, qk_norm, bias, index)

    # ---- HF names ------------------------------------------------------------------------
    @property
    def _mixtral(self) -> bool:
        return self.cfg.architecture == "MixtralForCausalLM"

    def hf_names(self, param_name: str) -> list[str]:
        """HF tensor name of each shard of ``param_name``: one per expert (and gate / up)."""
        head, _, leaf = param_name.rpartition(".")  # "layers.3.mlp", "experts_gate_up"
        if leaf in ("experts_gate_up", "experts_down"):
            names = list(self._expert_names(f"model.{head}.experts", leaf))
        else:
            names = super().hf_names(param_name)
        return [self.hf_rename(n) for n in names]

    def _expert_names(self, prefix: str, leaf: str) -> Iterator[str]:
        gate, up, down = _EXPERT_NAMES[self._mixtral]
        for e in range(self.cfg.moe.num_experts):
            if leaf == "experts_down":
                yield f"{prefix}.{e}.{down}.weight"
            else:
                yield f"{prefix}.{e}.{gate}.weight"
                yield f"{prefix}.{e}.{up}.weight"

    def hf_rename(self, name: str) -> str:
        """A name as Mixtral's checkpoints spell it: ``block_sparse_moe`` for transformers'
        in-memory ``mlp`` (also what ``save_original_format=False`` writes)."""
        return name.replace(".mlp.", ".block_sparse_moe.") if self._mixtral else name

    def hf_weights(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """(name, tensor) pairs in this model's per-expert HF names: transformers' stacked
        in-memory form (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I],
        ``save_original_format=False``, a v5 model's ``named_parameters``) split per expert,
        Mixtral's ``mlp`` spelled ``block_sparse_moe``; per-expert tensors as they are. Loading
        and ``update_weights`` both take names through it (``weights.hf_spelled``)."""
        for name, t in _unstacked(weights, self._mixtral):
            yield self.hf_rename(name), t


_EXPERT_NAMES = {False: ("gate_proj", "up_proj", "down_proj"), True: ("w1", "w3", "w2")}


def _unstacked(weights: Iterable[tuple[str, Any]], mixtral: bool
               ) -> Iterator[tuple[str, Any]]:
    """Each stacked expert tensor (or safetensors slice) as its per-expert HF tensors (of a
    slice: ``_ExpertPart``s, read only where a rank holds the expert); others unchanged."""
    gate, up, down = _EXPERT_NAMES[mixtral]
    for name, t in weights:
        stem, _, leaf = name.rpartition(".experts.")
        shape = tensor_shape(t)
        if leaf not in ("gate_up_proj", "down_proj") or len(shape) != 3:
            yield name, t
            continue
        rows = shape[1] // 2
        for e in range(shape[0]):
            if leaf == "down_proj":
                yield f"{stem}.experts.{e}.{down}.weight", _part(t, e, 0, shape[1])
            else:
                yield f"{stem}.experts.{e}.{gate}.weight", _part(t, e, 0, rows)
                yield f"{stem}.experts.{e}.{up}.weight", _part(t, e, rows, 2 * rows)


def _part(stacked: Any, e: int, lo: int, hi: int) -> Any:
    """Rows [lo, hi) of expert ``e``: a view of a tensor, else an ``_ExpertPart``."""
    if isinstance(stacked, torch.Tensor):
        return stacked[e, lo:hi]
    return _ExpertPart(stacked, e, lo, hi)


class _ExpertPart:
    """Rows [lo, hi) of expert ``e`` of a stacked safetensors slice, read when indexed (as the
    weight loader reads a slice: ``get_shape``, ``part[index]``)."""

    def __init__(self, stacked: Any, e: int, lo: int, hi: int) -> None:
        self.stacked, self.e, self.lo, self.hi = stacked, e, lo, hi

    def get_shape(self) -> list[int]:
        return [self.hi - self.lo, *self.stacked.get_shape()[2:]]

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.stacked[self.e:self.e + 1, self.lo:self.hi][0][index]
