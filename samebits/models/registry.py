"""The one model registry: HF ``architectures[0]`` -> the class that runs it, imported lazily.

Decoders (``LlamaForCausalLM`` and the shapes it covers) generate and embed; encoders (BERT) only
embed. ``config.py`` reads the architecture tuples from here, so adding a model is one entry.
"""

from __future__ import annotations

import importlib

_MODELS: dict[str, tuple[str, str]] = {  # architecture -> (module, class)
    "LlamaForCausalLM": ("samebits.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("samebits.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("samebits.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("samebits.models.llama", "LlamaForCausalLM"),
    "Qwen3MoeForCausalLM": ("samebits.models.moe", "MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("samebits.models.moe", "MoeForCausalLM"),
    "MixtralForCausalLM": ("samebits.models.moe", "MoeForCausalLM"),
    "BertModel": ("samebits.models.bert", "BertModel"),
    "BertForMaskedLM": ("samebits.models.bert", "BertModel"),
}
DECODER_ARCHITECTURES = tuple(a for a, (m, _) in _MODELS.items() if m.endswith((".llama", ".moe")))
ENCODER_ARCHITECTURES = tuple(a for a, (m, _) in _MODELS.items() if m.endswith(".bert"))


def is_decoder(architecture: str | None) -> bool:
    return architecture in DECODER_ARCHITECTURES


def model_class(architecture: str | None) -> type:
    """The class for ``architecture``; ``ModelFormatError`` naming the supported ones if none."""
    if architecture not in _MODELS:
        from samebits.config import ModelFormatError
        raise ModelFormatError(f"unsupported architecture {architecture!r}; samebits supports "
                               f"{', '.join(_MODELS)}")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
