"""HF checkpoint names -> the decoder's (fused) parameters.

q/k/v projections land in row slices of ``qkv_proj`` (in that order), gate/up in ``gate_up_proj``.
Loading checks every shape and that every parameter slice was written exactly once, so a
checkpoint with a missing or misshapen tensor fails with a message that names it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from samebits.config import ModelFormatError

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FUSED = {  # HF suffix -> (our attribute path, slice index)
    "self_attn.q_proj.weight": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj", 2),
    "self_attn.q_proj.bias": ("self_attn.qkv_bias", 0),
    "self_attn.k_proj.bias": ("self_attn.qkv_bias", 1),
    "self_attn.v_proj.bias": ("self_attn.qkv_bias", 2),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj", 1),
    "mlp.gate_proj.bias": ("mlp.gate_up_bias", 0),
    "mlp.up_proj.bias": ("mlp.gate_up_bias", 1),
}
_PLAIN = {
    "self_attn.o_proj.weight": "self_attn.o_proj",
    "self_attn.q_norm.weight": "self_attn.q_norm",
    "self_attn.k_norm.weight": "self_attn.k_norm",
    "mlp.down_proj.weight": "mlp.down_proj",
    "mlp.down_proj.bias": "mlp.down_bias",
    "input_layernorm.weight": "input_layernorm",
    "post_attention_layernorm.weight": "post_attention_layernorm",
}
_TOP = {"model.embed_tokens.weight": "embed_tokens", "model.norm.weight": "norm",
        "lm_head.weight": "lm_head"}


def _slices(model: nn.Module, attr: str) -> list[int]:
    """Row counts of the parts fused into ``attr``."""
    cfg = model.cfg
    if attr.endswith(("qkv_proj", "qkv_bias")):
        return [cfg.num_attention_heads * cfg.head_dim] + [cfg.num_key_value_heads * cfg.head_dim] * 2
    return [cfg.intermediate_size] * 2


def _target(model: nn.Module, name: str) -> tuple[str, int | None] | None:
    if name in _TOP:
        if name == "lm_head.weight" and model.lm_head is None:
            return None  # tied: some checkpoints still carry a copy
        return _TOP[name], None
    m = _LAYER.match(name)
    if not m or "rotary_emb" in name:
        return None
    prefix, suffix = f"layers.{m.group(1)}.", m.group(2)
    if suffix in _FUSED:
        attr, part = _FUSED[suffix]
        return prefix + attr, part
    if suffix in _PLAIN:
        return prefix + _PLAIN[suffix], None
    raise ModelFormatError(f"checkpoint: unexpected tensor {name!r}")


def load_llama_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())
    written: set[tuple[str, int | None]] = set()
    for name, tensor in weights:
        target = _target(model, name)
        if target is None:
            continue
        attr, part = target
        if attr not in params:
            raise ModelFormatError(f"checkpoint: tensor {name!r} does not fit this architecture")
        dest = params[attr].data
        if part is not None:
            sizes = _slices(model, attr)
            dest = dest.narrow(0, sum(sizes[:part]), sizes[part])
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelFormatError(f"checkpoint: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                   f"expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        written.add(target)
    _check_complete(model, params, written)


def _check_complete(model: nn.Module, params: dict[str, nn.Parameter],
                    written: set[tuple[str, int | None]]) -> None:
    for attr in params:
        fused = attr.endswith(("qkv_proj", "qkv_bias", "gate_up_proj", "gate_up_bias"))
        parts = range(len(_slices(model, attr))) if fused else [None]
        for part in parts:
            if (attr, part) not in written:
                raise ModelFormatError(f"checkpoint: no tensor for parameter {attr!r}"
                                       + (f" (part {part})" if part is not None else ""))
