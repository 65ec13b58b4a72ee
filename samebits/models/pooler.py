"""The pooler of an embedding model: final hidden states -> one vector per sequence.

How a model pools is its sentence-transformers files': ``modules.json`` (a Normalize module
switches on L2 normalisation) and the Pooling module's ``config.json`` (mean, CLS or last token).
A directory without them pools by the mean, unnormalised.

Invariance: the pooler is ``OpBackend.pool`` then ``OpBackend.l2_normalize``; with an invariant
backend a vector depends only on its own sequence's hidden states (``samebits.ops.encoder``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from samebits.config import ModelFormatError, read_json
from samebits.ops.backend import OpBackend
from samebits.ops.encoder import POOLING_MODES, SeqLayout


@dataclass(frozen=True)
class PoolerConfig:
    mode: str  # one of POOLING_MODES
    normalize: bool  # L2-normalise the pooled vector

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling mode must be one of {', '.join(POOLING_MODES)}, "
                             f"got {self.mode!r}")

    @property
    def name(self) -> str:
        """What enters the pooled model's fingerprint."""
        return f"pool={self.mode}|normalize={self.normalize}"

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> PoolerConfig:
        """From modules.json and the Pooling module's config.json (mean, unnormalised without)."""
        modules_file = model_dir / "modules.json"
        if not modules_file.is_file():
            return cls("mean", False)
        modules = _read_json_list(modules_file)
        types = [str(m.get("type", "")) for m in modules]
        normalize = any(t.endswith(".Normalize") for t in types)
        pooling = [m for m, t in zip(modules, types, strict=True) if t.endswith(".Pooling")]
        if not pooling:
            return cls("mean", normalize)
        cfg_file = model_dir / pooling[0].get("path", "") / "config.json"
        return cls(_pooling_mode(read_json(cfg_file), cfg_file), normalize)


def _read_json_list(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
        raise ModelFormatError(f"{path}: expected a JSON list of modules")
    return data


def _pooling_mode(cfg: dict[str, Any], source: Path) -> str:
    if isinstance(cfg.get("pooling_mode"), str):  # sentence-transformers >= 5
        modes = [cfg["pooling_mode"]]
    else:
        modes = [k.removeprefix("pooling_mode_").removesuffix("_tokens").removesuffix("_token")
                 for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise ModelFormatError(f"{source}: pooling {modes} is not supported; samebits supports "
                               f"exactly one of {', '.join(POOLING_MODES)}")
    return modes[0]


class Pooler:
    """``pooler(hidden, layout)``: [T, H] -> [B, H], each sequence's rows of ``layout`` pooled
    and, when the model says so, L2-normalised."""

    def __init__(self, config: PoolerConfig, ops: OpBackend) -> None:
        self.config, self.ops = config, ops

    def __call__(self, hidden: torch.Tensor, layout: SeqLayout) -> torch.Tensor:
        pooled = self.ops.pool(hidden, layout, self.config.mode)
        return self.ops.l2_normalize(pooled) if self.config.normalize else pooled
