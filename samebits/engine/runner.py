"""The model runner: owns the KV cache tensors, turns a scheduled batch into device tensors in one
``prepare`` step, runs the forward, and samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from samebits.config import EngineConfig
from samebits.engine import sampler
from samebits.engine.scheduler import ScheduledBatch
from samebits.engine.sequence import Sequence
from samebits.loader import LoadedModel
from samebits.ops.backend import AttentionMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: list[int]  # flat token row of each sequence that gets a new token
    sample_seqs: list[Sequence]
    score_rows: list[int]  # flat token rows of score-only sequences (every position)
    score_spans: list[tuple[Sequence, int, int]]  # (seq, first position, count), score_rows order


@dataclass
class StepResult:
    sampled: list[Sequence]  # the sequences that got a new token, in order
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    score_logprobs: list[list[float]]  # per score span: logprob of each next token it scored


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.model, self.config = loaded.model, config
        cfg = loaded.model_config
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.block_size = config.block_size
        per_block = (2 * cfg.num_hidden_layers * config.block_size * cfg.num_key_value_heads
                     * cfg.head_dim * self.dtype.itemsize)
        self.num_blocks = config.num_kv_blocks or max(1, self._kv_budget() // per_block)
        shape = (self.num_blocks, config.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(cfg.num_hidden_layers)]

    def _kv_budget(self) -> int:
        if self.config.kv_cache_memory_bytes is not None:
            return self.config.kv_cache_memory_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.8)
        return 1 << 30

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        ids, pos, slots, seq_lens, qsl = [], [], [], [], [0]
        sample_rows, sample_seqs, score_rows, score_spans = [], [], [], []
        bs = self.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            ids.extend(seq.all_token_ids[start:start + n])
            pos.extend(range(start, start + n))
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n))
            seq_lens.append(start + n)
            if seq.score_only:
                score_spans.append((seq, start, n))
                score_rows.extend(range(qsl[-1], qsl[-1] + n))
            elif start + n == seq.num_tokens:
                sample_seqs.append(seq)
                sample_rows.append(qsl[-1] + n - 1)
            qsl.append(qsl[-1] + n)
        width = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in batch.seqs]
        dev = self.device
        meta = AttentionMetadata(
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            seq_lens_list=tuple(seq_lens), query_start_loc_list=tuple(qsl),
            block_size=bs, split_size=self.config.attention_split_size)
        return StepInputs(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev),
                          self.model.ops.plan_attention(meta), sample_rows, sample_seqs,
                          score_rows, score_spans)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepResult:
        inputs = self.prepare(batch)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        result = StepResult([], [], [], [], [])
        if inputs.sample_rows:
            self._sample(inputs, hidden, result)
        if inputs.score_rows:
            self._score(inputs, hidden, result)
        return result

    @torch.inference_mode()
    def all_hidden(self, batch: ScheduledBatch) -> torch.Tensor:
        """Final-norm hidden states [T, H] of every scheduled token (embeddings, reference checks)."""
        inputs = self.prepare(batch)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)

    def _sample(self, inputs: StepInputs, hidden: torch.Tensor, result: StepResult) -> None:
        seqs = inputs.sample_seqs
        rows = torch.tensor(inputs.sample_rows, device=self.device)
        logits = self.model.compute_logits(hidden[rows])  # [B, V] fp32
        tokens, logprobs = sampler.sample(
            self.model.ops, logits, [s.params for s in seqs], [s.seed for s in seqs],
            [len(s.output_token_ids) for s in seqs])
        chosen = logprobs.gather(1, torch.tensor(tokens, device=self.device)[:, None])[:, 0]
        result.sampled, result.tokens = seqs, tokens
        result.logprobs = chosen.tolist()
        result.top_logprobs = [_top(logprobs[i], s.params.logprobs) for i, s in enumerate(seqs)]

    def _score(self, inputs: StepInputs, hidden: torch.Tensor, result: StepResult) -> None:
        """Logprob of token p+1 given tokens [0, p], for each scored position p."""
        rows = torch.tensor(inputs.score_rows, device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        logprobs = self.model.ops.log_softmax(logits)
        row = 0
        for seq, start, count in inputs.score_spans:
            tokens = seq.all_token_ids
            n = min(count, len(tokens) - 1 - start)  # the last position has no next token
            nxt = torch.tensor(tokens[start + 1:start + 1 + n], device=self.device)
            picked = logprobs[row:row + n].gather(1, nxt[:, None])[:, 0]
            result.score_logprobs.append(picked.tolist())
            row += count


def _top(row: torch.Tensor, k: int | None) -> dict[int, float]:
    """The k most likely tokens and their logprobs (for OpenAI's top_logprobs)."""
    if not k:
        return {}
    values, ids = row.topk(k)
    return dict(zip(ids.tolist(), values.tolist(), strict=True))
