"""The mixture-of-experts part of a decoder's shape, read from an HF ``config.json``.

Each MoE architecture's config names and conventions (``_ARCHS``):

- Qwen3-MoE: ``num_experts`` (transformers 5 writes ``num_local_experts``) experts of
  ``moe_intermediate_size``, ``norm_topk_prob``, ``decoder_sparse_step`` / ``mlp_only_layers``
  (the other layers are dense MLPs of ``intermediate_size``); routing weights rounded to the
  model dtype, as transformers does.
- Qwen2-MoE: the same, plus a shared expert of ``shared_expert_intermediate_size`` whose output
  is scaled by ``sigmoid(shared_expert_gate(x))``.
- Mixtral: ``num_local_experts`` experts of ``intermediate_size``, every layer sparse, the top-k
  probabilities always renormalized and kept in fp32.

``MoeModelConfig`` (the architecture table's config class for these entries) is the decoder's
``ModelConfig`` plus ``moe``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from samebits.config import ModelConfig, ModelFormatError


@dataclass(frozen=True)
class _Arch:
    size_key: str  # the config field holding the routed experts' intermediate size
    renormalize: bool | None  # None: the config's ``norm_topk_prob``
    round_weights: bool  # routing weights rounded to the model dtype (else kept in fp32)
    shared_expert: bool
    sparse_layers: bool  # honours decoder_sparse_step / mlp_only_layers


_ARCHS = {
    "Qwen3MoeForCausalLM": _Arch("moe_intermediate_size", None, True, False, True),
    "Qwen2MoeForCausalLM": _Arch("moe_intermediate_size", None, True, True, True),
    "MixtralForCausalLM": _Arch("intermediate_size", True, False, False, False),
}
MOE_ARCHITECTURES = tuple(_ARCHS)


@dataclass(frozen=True)
class MoeConfig:
    """Sparse layers route each token to ``top_k`` of ``num_experts`` SwiGLU experts."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    renormalize: bool  # the top-k probabilities divided by their sum
    round_weights: bool  # routing weights rounded to the model dtype before the combine
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # 0: no shared expert

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "moe_intermediate_size", "decoder_sparse_step"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise _error(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.top_k > self.num_experts:
            raise _error(f"num_experts_per_tok={self.top_k} exceeds the {self.num_experts} "
                         "experts")
        if self.num_experts > 1 << 15:
            raise _error(f"{self.num_experts} experts: at most {1 << 15} are supported")
        if self.shared_expert_intermediate_size < 0:
            raise _error("shared_expert_intermediate_size must not be negative")

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` holds experts (else a dense MLP), as transformers
        decides it."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], arch: str | None) -> MoeConfig | None:
        """The MoE shape of an HF config of architecture ``arch``; None for a dense one."""
        spec = _ARCHS.get(arch)
        if spec is None:
            return None
        _check_supported(cfg, arch)
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        if experts is None:
            raise KeyError("num_experts")
        renormalize = spec.renormalize
        if renormalize is None:
            renormalize = bool(cfg.get("norm_topk_prob", False))
        return cls(
            num_experts=experts, top_k=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg[spec.size_key], renormalize=renormalize,
            round_weights=spec.round_weights,
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1) if spec.sparse_layers else 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()) if spec.sparse_layers else (),
            shared_expert_intermediate_size=(cfg["shared_expert_intermediate_size"]
                                             if spec.shared_expert else 0))


def _check_supported(cfg: dict[str, Any], arch: str) -> None:
    """Refuse what the engine would silently compute otherwise: another activation, a sliding
    attention window."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _error(f"hidden_act={act!r}: {arch} experts are supported with 'silu' only")
    window = cfg.get("sliding_window")
    in_effect = (cfg.get("use_sliding_window", False) if "use_sliding_window" in cfg
                 else bool(window))
    if in_effect and window and window < cfg.get("max_position_embeddings", 0):
        raise _error(f"sliding_window={window}: sliding-window attention is not supported")


def _error(message: str) -> ValueError:
    return ModelFormatError(f"config.json: {message}")


@dataclass(frozen=True)
class MoeModelConfig(ModelConfig):
    """A mixture-of-experts decoder's config.json: the decoder's shape and its experts."""

    moe: MoeConfig | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.moe is None:
            raise _error(f"{self.architecture} needs its experts' fields")

    @classmethod
    def _fields(cls, cfg: dict[str, Any], arch: str) -> dict[str, Any]:
        fields = super()._fields(cfg, arch)
        if fields["attention_bias"] is None and "qkv_bias" in cfg:  # Qwen2-MoE's name for it
            fields["attention_bias"] = bool(cfg["qkv_bias"])
        return {**fields, "moe": MoeConfig.from_hf(cfg, arch)}
