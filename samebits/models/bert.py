"""BertModel as all-MiniLM-L6-v2 uses it: word + absolute position + token-type embeddings,
post-LayerNorm blocks, GELU (erf), bidirectional self-attention within each sequence.

Every op goes through the ``OpBackend`` the model was built with (linear, LayerNorm, GELU, the
bidirectional ``encoder_attention`` over each sequence's own rows); the rest is elementwise, with
the same casts in the same order on every path. With an invariant backend, a token's hidden state
depends only on its own sequence's tokens. No KV cache: a sequence runs whole, in one forward.
Shapes: T = token rows of the flat batch, H = hidden size.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from samebits.config import ModelFormatError
from samebits.distributed.group import TPGroup
from samebits.models.registry import ENCODER_ARCHITECTURES
from samebits.models.weights import fused_param, packed_hf_names
from samebits.ops.backend import OpBackend
from samebits.ops.encoder import SeqLayout


@dataclass(frozen=True)
class BertConfig:
    """The encoder's shape, read from an HF ``config.json``."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    eos_token_ids: tuple[int, ...] = ()  # an encoder stops nothing

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> BertConfig:
        archs = cfg.get("architectures") or []
        if not archs or archs[0] not in ENCODER_ARCHITECTURES:
            raise ModelFormatError(f"{source}: architecture {archs[:1]} is not an embedding model "
                                   f"samebits supports ({', '.join(ENCODER_ARCHITECTURES)})")
        act = cfg.get("hidden_act", "gelu")
        if act != "gelu":
            raise ModelFormatError(f"{source}: hidden_act {act!r} is not supported (only 'gelu')")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ModelFormatError(f"{source}: only absolute position embeddings are supported")
        try:
            out = cls(archs[0], **{f: cfg[f] for f in ("vocab_size", "hidden_size", "intermediate_size",
                                              "num_hidden_layers", "num_attention_heads",
                                              "max_position_embeddings")},
                      type_vocab_size=cfg.get("type_vocab_size", 2),
                      layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
                      pad_token_id=cfg.get("pad_token_id") or 0)
        except KeyError as e:
            raise ModelFormatError(f"{source}: missing field {e.args[0]!r}") from None
        if out.hidden_size % out.num_attention_heads:
            raise ModelFormatError(f"{source}: hidden_size is not a multiple of num_attention_heads")
        return out


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class BertLayer(nn.Module):
    """Post-LN block: h = LN(h + attn(h)); h = LN(h + ffn(h)). q/k/v fused into one projection."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.heads, self.d, self.eps = cfg.num_attention_heads, cfg.head_dim, cfg.layer_norm_eps
        self.qkv_proj, self.qkv_bias = fused_param([h] * 3, h), fused_param([h] * 3)
        self.o_proj, self.o_bias = _param(h, h), _param(h)
        self.attn_ln_w, self.attn_ln_b = _param(h), _param(h)
        self.up_proj, self.up_bias = _param(i, h), _param(i)
        self.down_proj, self.down_bias = _param(h, i), _param(h)
        self.out_ln_w, self.out_ln_b = _param(h), _param(h)

    def forward(self, ops: OpBackend, h: torch.Tensor, layout: SeqLayout) -> torch.Tensor:
        t = h.shape[0]
        q, k, v = ops.linear(h, self.qkv_proj, self.qkv_bias).view(t, 3, self.heads, self.d).unbind(1)
        ctx = ops.encoder_attention(q.contiguous(), k.contiguous(), v.contiguous(), layout,
                                    self.d ** -0.5)
        a = ops.linear(ctx.reshape(t, -1), self.o_proj, self.o_bias)
        h = ops.layer_norm(a + h, self.attn_ln_w, self.attn_ln_b, self.eps)
        m = ops.linear(ops.gelu(ops.linear(h, self.up_proj, self.up_bias)), self.down_proj,
                       self.down_bias)
        return ops.layer_norm(m + h, self.out_ln_w, self.out_ln_b, self.eps)


class BertModel(nn.Module):
    """``forward`` returns the last hidden states [T, H] (what sentence-transformers pools)."""

    def __init__(self, cfg: BertConfig, ops: OpBackend, max_model_len: int | None = None,
                 group: TPGroup | None = None) -> None:
        """The registry's constructor shape; the position table bounds a sequence's length, and
        an encoder runs whole on one device (``group``: one rank)."""
        super().__init__()
        if group is not None and group.world_size > 1:
            raise ValueError("an encoder runs on one device: tensor_parallel_size must be 1")
        self.cfg, self.ops = cfg, ops
        self.word_embeddings = _param(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = _param(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = _param(cfg.type_vocab_size, cfg.hidden_size)
        self.emb_ln_w, self.emb_ln_b = _param(cfg.hidden_size), _param(cfg.hidden_size)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: SeqLayout
                ) -> torch.Tensor:
        """input_ids, positions [T] (positions restart at 0 in every sequence; every token of
        segment 0, as sentence-transformers encodes one text); ``layout`` from
        ``ops.plan_encoder``."""
        h = F.embedding(input_ids, self.word_embeddings)
        token_types = torch.zeros_like(input_ids)
        h = h + F.embedding(token_types, self.token_type_embeddings)  # HF's order of the adds
        h = h + F.embedding(positions, self.position_embeddings)
        h = self.ops.layer_norm(h, self.emb_ln_w, self.emb_ln_b, self.cfg.layer_norm_eps)
        for layer in self.layers:
            h = layer(self.ops, h, layout)
        return h

    # ---- HF names (samebits.models.weights) ----------------------------------------------
    packed_modules_mapping = {"attention.self.query": ("qkv", 0), "attention.self.key": ("qkv", 1),
                              "attention.self.value": ("qkv", 2)}

    def hf_names(self, param_name: str) -> list[str]:
        """HF tensor name of each shard of parameter ``param_name`` (no ``bert.`` prefix)."""
        if param_name in _TOP:
            return [_TOP[param_name]]
        _, i, leaf = param_name.split(".")
        prefix = f"encoder.layer.{i}."
        if leaf in ("qkv_proj", "qkv_bias"):
            return packed_hf_names(self, prefix, "qkv", "weight" if leaf == "qkv_proj" else "bias")
        return [prefix + _LAYER_NAMES[leaf]]

    def hf_rename(self, name: str) -> str:
        return name.removeprefix("bert.")

    def hf_ignored(self, name: str) -> bool:
        """The pooler, the MLM head and the position-id buffer fill no parameter."""
        return name.startswith(("pooler.", "cls.")) or name == "embeddings.position_ids"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (``bert.`` prefix optional), fusing q/k/v; every parameter
        must be written exactly once, with its exact shape."""
        from samebits.models.weights import load_weights
        load_weights(self, weights)


_LAYER_NAMES = {  # our per-layer attribute -> HF suffix (q/k/v come from packed_modules_mapping)
    "o_proj": "attention.output.dense.weight", "o_bias": "attention.output.dense.bias",
    "attn_ln_w": "attention.output.LayerNorm.weight", "attn_ln_b": "attention.output.LayerNorm.bias",
    "up_proj": "intermediate.dense.weight", "up_bias": "intermediate.dense.bias",
    "down_proj": "output.dense.weight", "down_bias": "output.dense.bias",
    "out_ln_w": "output.LayerNorm.weight", "out_ln_b": "output.LayerNorm.bias",
}
_TOP = {"word_embeddings": "embeddings.word_embeddings.weight",
        "position_embeddings": "embeddings.position_embeddings.weight",
        "token_type_embeddings": "embeddings.token_type_embeddings.weight",
        "emb_ln_w": "embeddings.LayerNorm.weight", "emb_ln_b": "embeddings.LayerNorm.bias"}
