"""Embeddings from a decoder (Qwen3-Embedding style): the final-norm hidden state of the last
token (or the first, for ``cls`` pooling), optionally L2-normalised.

Invariance: each input runs through the decoder alone, with the batch-invariant ops, so its vector
is a function of its own tokens (and the weights and engine constants in ``fingerprint``); the
normalisation is a row op of the invariant encoder ops. Mean pooling is not offered for decoders.
"""

from __future__ import annotations

import dataclasses

import torch

from samebits.config import EngineConfig, ModelConfig, ModelFormatError, read_json
from samebits.embedder import Embedder, resolve_embed_model_dir
from samebits.engine.engine import LLMEngine
from samebits.models.registry import is_decoder


class DecoderEmbedder(Embedder):
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None) -> None:
        """``engine``: the generation engine of the same model to pool from (else its own)."""
        self.engine = engine
        super().__init__(config)

    def _build(self) -> str:
        """The decoder runs in an engine of its own; the vector is its final-norm hidden state."""
        self.model_config = ModelConfig.from_file(self.model_dir / "config.json")
        if not (self.model_dir / "modules.json").is_file():
            raise ModelFormatError(f"{self.model_dir}: not an embedding model (a decoder without "
                                   "sentence-transformers modules.json and pooling config)")
        if self.pooling not in ("lasttoken", "cls"):
            raise ModelFormatError(f"{self.model_dir}: pooling {self.pooling!r} is not supported "
                                   "for decoder models; use lasttoken (or cls)")
        if self.engine is None:
            self.engine = LLMEngine(dataclasses.replace(self.config, task="generate"))
        self.max_len = self.engine.max_model_len
        return self.engine.fingerprint + f"-{self.pooling}{'-l2' if self.normalize else ''}"

    @torch.inference_mode()
    def _forward(self, ids: list[list[int]]) -> list[list[float]]:
        row = 0 if self.pooling == "cls" else -1
        pooled = torch.stack([self.engine.prompt_hidden(seq)[row] for seq in ids])
        if self.normalize:
            pooled = self.ops.normalize(pooled)
        return pooled.float().cpu().tolist()


def is_decoder_model(config: EngineConfig) -> bool:
    if config.model is None:
        return False
    raw = read_json(resolve_embed_model_dir(config.model) / "config.json")
    return is_decoder((raw.get("architectures") or [None])[0])
