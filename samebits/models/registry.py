"""The architecture table: HF ``architectures[0]`` -> one ``Architecture`` entry, the one place
an architecture's quirks live.

An entry names the class that runs it (imported on first use), its kind (``decoder``: generates
and embeds; ``encoder``: BERT-style, embeds only; ``pooling``: a decoder-shaped checkpoint served
for embeddings only), the class that parses its config.json (``ModelConfig``, or a subclass that
adds fields: a mixture-of-experts model's expert counts), and the quirks every other module reads
from here: per-head q/k RMSNorm, the default of ``attention_bias`` and ``tie_word_embeddings``
when config.json does not say, the GGUF ``general.architecture`` name (and whether llama.cpp
permuted its q/k rows), and the transformers RMSNorm class the ``batch_invariant()`` override
routes on CUDA. Adding a Llama-family architecture is its model file (or none) and one entry.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal

from samebits.config import ModelConfig, ModelFormatError

Kind = Literal["decoder", "encoder", "pooling"]


@dataclass(frozen=True)
class Architecture:
    name: str  # HF architectures[0]
    kind: Kind
    model: str  # "module:Class" of the class that runs it
    config: str = "samebits.config:ModelConfig"  # "module:Class" that parses its config.json
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE
    attention_bias: bool = False  # q/k/v projections carry a bias, unless config.json says
    tie_word_embeddings: bool = False  # the LM head is the embedding table, unless config says
    gguf: str | None = None  # GGUF general.architecture
    gguf_permuted_qk: bool = False  # llama.cpp interleaved the rows of each q/k head for RoPE
    hf_model_type: str | None = None  # transformers.models.<type>.modeling_<type>
    hf_norm: str | None = None  # the RMSNorm class in that module (HF's formula)

    def __post_init__(self) -> None:
        if self.kind not in ("decoder", "encoder", "pooling"):
            raise ValueError(f"{self.name}: kind must be decoder, encoder or pooling")

    @property
    def model_class(self) -> type:
        return _resolve(self.model)

    @property
    def config_class(self) -> type[ModelConfig]:
        return _resolve(self.config)

    def resolve(self, name: str, value: Any) -> Any:
        """A quirk as config.json states it (``value``), else this entry's default."""
        return getattr(self, name) if value is None else value


def _resolve(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


_LLAMA = "samebits.models.llama:LlamaForCausalLM"
_BERT = "samebits.models.bert:BertModel"
_MOE, _MOE_CONFIG = "samebits.models.moe:MoeForCausalLM", "samebits.models.moe_config:MoeModelConfig"
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("LlamaForCausalLM", "decoder", _LLAMA, gguf="llama", gguf_permuted_qk=True,
                 hf_model_type="llama", hf_norm="LlamaRMSNorm"),
    Architecture("MistralForCausalLM", "decoder", _LLAMA, hf_model_type="mistral",
                 hf_norm="MistralRMSNorm"),
    Architecture("Qwen2ForCausalLM", "decoder", _LLAMA, attention_bias=True, gguf="qwen2",
                 hf_model_type="qwen2", hf_norm="Qwen2RMSNorm"),
    Architecture("Qwen3ForCausalLM", "decoder", _LLAMA, qk_norm=True, gguf="qwen3",
                 hf_model_type="qwen3", hf_norm="Qwen3RMSNorm"),
    Architecture("Qwen3MoeForCausalLM", "decoder", _MOE, config=_MOE_CONFIG, qk_norm=True,
                 hf_model_type="qwen3_moe", hf_norm="Qwen3MoeRMSNorm"),
    Architecture("Qwen2MoeForCausalLM", "decoder", _MOE, config=_MOE_CONFIG, attention_bias=True,
                 hf_model_type="qwen2_moe", hf_norm="Qwen2MoeRMSNorm"),
    Architecture("MixtralForCausalLM", "decoder", _MOE, config=_MOE_CONFIG,
                 hf_model_type="mixtral", hf_norm="MixtralRMSNorm"),
    Architecture("BertModel", "encoder", _BERT),
    Architecture("BertForMaskedLM", "encoder", _BERT),
)}
DECODER_ARCHITECTURES = tuple(n for n, a in ARCHITECTURES.items() if a.kind == "decoder")
ENCODER_ARCHITECTURES = tuple(n for n, a in ARCHITECTURES.items() if a.kind == "encoder")


def architecture(name: str | None, kinds: tuple[Kind, ...] = ("decoder", "encoder", "pooling"),
                 source: str = "config.json") -> Architecture:
    """The entry for ``name`` if it is one of ``kinds``; ``ModelFormatError`` naming the
    supported ones otherwise."""
    entry = ARCHITECTURES.get(name) if name is not None else None
    if entry is None or entry.kind not in kinds:
        supported = [n for n, a in ARCHITECTURES.items() if a.kind in kinds]
        raise ModelFormatError(f"{source}: unsupported architecture {name!r}; samebits supports "
                               f"{', '.join(supported)}")
    return entry


def is_decoder(name: str | None) -> bool:
    entry = ARCHITECTURES.get(name) if name is not None else None
    return entry is not None and entry.kind == "decoder"


def model_class(name: str | None) -> type:
    """The class that runs architecture ``name``."""
    return architecture(name).model_class


def model_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """A decoder's config.json parsed by its entry's config class."""
    entry = architecture((raw.get("architectures") or [None])[0], ("decoder", "pooling"), source)
    return entry.config_class.from_dict(raw, source)


def gguf_architectures() -> dict[str, Architecture]:
    """GGUF ``general.architecture`` -> the entry that runs it."""
    return {a.gguf: a for a in ARCHITECTURES.values() if a.gguf is not None}


def hf_rms_norms() -> list[tuple[str, str]]:
    """(transformers module, RMSNorm class) of every entry that names one, without repeats."""
    out = []
    for a in ARCHITECTURES.values():
        if a.hf_norm is not None:
            pair = (f"transformers.models.{a.hf_model_type}.modeling_{a.hf_model_type}",
                    a.hf_norm)
            if pair not in out:
                out.append(pair)
    return out
