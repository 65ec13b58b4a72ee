"""The runners of an embedding engine (``EngineConfig(task="embed")``), picked by the model's kind:
a step's scheduled pooling sequences -> the model -> the pooler -> each finished sequence's
``embedding``. Nothing is sampled, so a step's ``StepResult`` is empty.

- ``EncoderRunner`` (BERT-style): no KV cache. Attention is bidirectional over a sequence's own
  tokens, so a sequence runs whole in one step (the scheduler does not chunk its prompt,
  ``chunked_prefill = False``) and the forward packs the step's sequences back to back
  (``OpBackend.plan_encoder``).
- ``DecoderPoolingRunner`` (a decoder embedding model): the normal ``ModelRunner`` prefill, eager
  (no decode step to capture), chunked as any prompt; the pooler reads the final hidden state of
  the sequence's pooled token (its last, or first for ``cls``) in the step that computes it.

Invariance is the backend's: a vector depends only on its own sequence, whatever the step holds.
"""

from __future__ import annotations

import dataclasses

import torch

from samebits.config import EngineConfig
from samebits.engine.pooling import PoolingSequence
from samebits.engine.runner import ModelRunner
from samebits.engine.scheduler import ScheduledBatch
from samebits.engine.step import StepResult
from samebits.loader.pooling import LoadedPoolingModel, load_pooling_model
from samebits.models.pooler import Pooler
from samebits.models.registry import architecture
from samebits.ops.encoder import SeqLayout


def pooling_runner(config: EngineConfig, loaded: LoadedPoolingModel | None = None
                   ) -> EncoderRunner | DecoderPoolingRunner:
    """The runner for the embedding model's kind (loaded here unless given); one device."""
    if config.tensor_parallel_size > 1:
        raise ValueError("tensor_parallel_size > 1 is not supported for embedding models")
    loaded = loaded or load_pooling_model(config)
    if architecture(loaded.model_config.architecture).kind == "encoder":
        return EncoderRunner(loaded, config)
    return DecoderPoolingRunner(loaded, config)


def _empty_result() -> StepResult:
    return StepResult(sampled=[], tokens=[], logprobs=[], top_logprobs=[], scored=[])


class EncoderRunner:
    """Runs whole sequences through an encoder and pools them (module docstring)."""

    chunked_prefill = False  # a sequence's tokens attend to each other: never split across steps

    def __init__(self, loaded: LoadedPoolingModel, config: EngineConfig) -> None:
        self.model, self.config, self.loaded = loaded.model, config, loaded
        self.max_model_len = loaded.max_model_len
        self.device = next(self.model.parameters()).device
        self.pooler = Pooler(loaded.pooler, self.model.ops)
        self.pad_token_id = loaded.model_config.pad_token_id
        # Block bookkeeping only (the scheduler admits by blocks): as many as one step can use;
        # no memory stands behind them.
        self.num_blocks = -(-config.max_num_batched_tokens // config.block_size) + config.max_num_seqs

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepResult:
        seqs: list[PoolingSequence] = batch.seqs
        for seq, n in zip(seqs, batch.num_new_tokens, strict=True):
            if seq.num_computed_tokens != 0 or n != seq.num_tokens:
                raise RuntimeError(f"{seq.request_id}: an encoder runs a sequence whole")
        layout = self.model.ops.plan_encoder([s.num_tokens for s in seqs], self.device)
        input_ids, positions = self._inputs(seqs, layout)
        hidden = self.model(input_ids, positions, layout)
        vectors = self.pooler(hidden, layout).float().cpu().tolist()
        for seq, vector in zip(seqs, vectors, strict=True):
            seq.embedding = vector
        return _empty_result()

    def _inputs(self, seqs: list[PoolingSequence], layout: SeqLayout
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and positions of the layout's rows; a padded layout's padding rows hold the
        pad token at the positions that follow their sequence (as a tokenizer pads a batch)."""
        ids = [self.pad_token_id] * layout.num_rows
        width = layout.padded_len
        pos = list(range(width)) * len(seqs) if width is not None else [0] * layout.num_rows
        for seq, start in zip(seqs, layout.starts, strict=True):
            ids[start:start + seq.num_tokens] = seq.prompt_token_ids
            pos[start:start + seq.num_tokens] = range(seq.num_tokens)
        return (torch.tensor(ids, dtype=torch.long, device=self.device),
                torch.tensor(pos, dtype=torch.long, device=self.device))

    def discard_ahead(self) -> None:
        """Nothing runs ahead of a step here."""

    def check_health(self) -> None:
        """One process, no tensor-parallel ranks: nothing can have died."""

    def weights_updated(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """One device: ``update_weights`` already wrote every weight."""


class DecoderPoolingRunner:
    """A decoder's prefill with the pooler on its final hidden states (module docstring)."""

    chunked_prefill = True

    def __init__(self, loaded: LoadedPoolingModel, config: EngineConfig) -> None:
        self.runner = ModelRunner(loaded, dataclasses.replace(config, enforce_eager=True))
        self.model, self.device, self.loaded = self.runner.model, self.runner.device, loaded
        self.num_blocks, self.max_model_len = self.runner.num_blocks, self.runner.max_model_len
        self.pooler = Pooler(loaded.pooler, self.model.ops)
        self.first = loaded.pooler.mode == "cls"  # else the last token is pooled

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepResult:
        hidden = self.runner.all_hidden(batch)
        pooled, starts, lens, row = [], [], [], 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            if (start == 0) if self.first else (start + n == seq.num_tokens):
                pooled.append(seq)
                starts.append(row)
                lens.append(n)
            row += n
        if pooled:
            layout = SeqLayout(tuple(starts), tuple(lens), hidden.shape[0])
            for seq, vector in zip(pooled, self.pooler(hidden, layout).float().cpu().tolist(),
                                   strict=True):
                seq.embedding = vector
        return _empty_result()

    def all_hidden(self, batch: ScheduledBatch) -> torch.Tensor:
        return self.runner.all_hidden(batch)

    def discard_ahead(self) -> None:
        self.runner.discard_ahead()

    def check_health(self) -> None:
        self.runner.check_health()

    def weights_updated(self, items: list[tuple[str, torch.Tensor]]) -> None:
        self.runner.weights_updated(items)
