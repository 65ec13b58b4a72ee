"""The architecture table is the one place an architecture's quirks live.

What they prove: each decoder entry's quirks reach the model built for it (Qwen3's q/k norm,
Qwen2's default q/k/v bias, which config.json can override) and the loaders and override read
their lists from the entries (GGUF names, the HF RMSNorm classes, decoder-ness by kind, not by
module name); an entry with its own config class (a mixture-of-experts model's extra fields)
parses its config.json through that class; an unknown architecture is an error naming the
supported ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from samebits.config import ModelConfig, ModelFormatError
from samebits.loader import build_model, gguf
from samebits.models import registry
from samebits.models.registry import Architecture
from samebits.ops import get_backend
from tests.tiny_models import MICRO_LLAMA_CONFIG


def _model(arch: str, **fields: Any) -> torch.nn.Module:
    cfg = registry.model_config({**MICRO_LLAMA_CONFIG, "architectures": [arch], **fields})
    return build_model(cfg, get_backend("cpu", True), 64, "cpu", torch.float32)


@pytest.mark.parametrize("arch,qk_norm,bias", [("LlamaForCausalLM", False, False),
                                               ("MistralForCausalLM", False, False),
                                               ("Qwen2ForCausalLM", False, True),
                                               ("Qwen3ForCausalLM", True, False)])
def test_entry_quirks_reach_the_model(arch, qk_norm, bias):
    attn = _model(arch).layers[0].self_attn
    assert (attn.q_norm is not None) is qk_norm and (attn.k_norm is not None) is qk_norm
    assert (attn.qkv_proj.bias is not None) is bias


def test_config_json_overrides_an_entry_default():
    assert _model("Qwen2ForCausalLM", attention_bias=False).layers[0].self_attn.qkv_proj.bias \
        is None
    assert _model("LlamaForCausalLM", tie_word_embeddings=True).lm_head.tied


def test_lists_are_read_from_the_entries():
    assert gguf.ARCHITECTURES == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                  "qwen3": "Qwen3ForCausalLM"}
    assert ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm") in registry.hf_rms_norms()
    assert len(registry.hf_rms_norms()) == 7
    assert registry.DECODER_ARCHITECTURES == ("LlamaForCausalLM", "MistralForCausalLM",
                                              "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                              "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM",
                                              "MixtralForCausalLM")
    assert registry.ENCODER_ARCHITECTURES == ("BertModel", "BertForMaskedLM")


@dataclass(frozen=True)
class ExpertConfig(ModelConfig):
    """A mixture-of-experts config: the decoder's fields plus its own."""

    num_experts: int = 0
    num_experts_per_tok: int = 0

    @classmethod
    def _fields(cls, cfg: dict[str, Any], arch: str) -> dict[str, Any]:
        return {**super()._fields(cfg, arch), "num_experts": cfg["num_experts"],
                "num_experts_per_tok": cfg["num_experts_per_tok"]}


def test_an_entry_with_its_own_config_class_and_kind(monkeypatch):
    entry = Architecture("ToyMoeForCausalLM", "decoder", "samebits.models.llama:LlamaForCausalLM",
                         config=f"{__name__}:ExpertConfig", qk_norm=True)
    monkeypatch.setitem(registry.ARCHITECTURES, entry.name, entry)
    cfg = registry.model_config({**MICRO_LLAMA_CONFIG, "architectures": [entry.name], "num_experts": 8,
                                 "num_experts_per_tok": 2})
    assert isinstance(cfg, ExpertConfig) and (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)
    assert registry.is_decoder(entry.name) and registry.model_class(entry.name) is not None
    pooling = Architecture("ToyEmbedder", "pooling", "samebits.models.llama:LlamaForCausalLM")
    monkeypatch.setitem(registry.ARCHITECTURES, pooling.name, pooling)
    assert not registry.is_decoder(pooling.name)  # the kind decides, not the module
    with pytest.raises(ValueError, match="kind must be"):
        Architecture("X", "generator", "m:C")


def test_unknown_architecture_names_the_supported_ones():
    with pytest.raises(ModelFormatError, match=r"unsupported architecture 'Phi3ForCausalLM'; "
                                               r"samebits supports LlamaForCausalLM, "):
        registry.model_config({**MICRO_LLAMA_CONFIG, "architectures": ["Phi3ForCausalLM"]})
    with pytest.raises(ModelFormatError, match="unsupported architecture 'BertModel'"):
        registry.model_config({**MICRO_LLAMA_CONFIG, "architectures": ["BertModel"]})  # not a decoder
