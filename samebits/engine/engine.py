"""The engine: requests in, one step at a time, outputs out.

A step reads like prose: schedule -> run -> postprocess. Nothing in a step may change a request's
bits; that is the ops' job (samebits.ops.backend) and the sampler's (counter-based streams).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from samebits.config import EngineConfig
from samebits.engine.kv_cache import KVCacheManager
from samebits.engine.runner import ModelRunner, ScoredSpan, StepResult
from samebits.engine.scheduler import ScheduledBatch, Scheduler
from samebits.engine.sequence import Logprob, PromptLogprobs, RequestOutput, Sequence
from samebits.loader import LoadedModel, load
from samebits.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load, for metrics and admission decisions."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    num_preemptions: int  # since start


class LLMEngine:
    """The engine's interface: ``add_request``, ``abort``, ``step`` (the sequences that made
    progress; finished ones are forgotten by the engine once returned), ``output`` (a sequence's
    ``RequestOutput``), ``has_unfinished`` and ``stats``. Not thread-safe: one thread drives it."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded or load(config)
        self.tokenizer = self.loaded.tokenizer
        self.fingerprint = self.loaded.fingerprint
        self.max_model_len = self.loaded.max_model_len
        self.runner = ModelRunner(self.loaded, config)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size,
                                 config.enable_prefix_caching, self.fingerprint)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, self.kv)
        self.requests: dict[str, Sequence] = {}
        self._seed_rng = random.Random(config.seed)
        self._eos = set(self.tokenizer.eos_token_ids if self.tokenizer else
                        self.loaded.model_config.eos_token_ids)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    score_only: bool = False) -> Sequence:
        """Validate and queue a request; a bad one raises ``ValueError`` and changes nothing."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._check_prompt(prompt_token_ids, 0 if score_only else params.max_tokens)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seq = Sequence(request_id, list(prompt_token_ids), params, seed, score_only=score_only)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def _check_prompt(self, ids: list[int], max_tokens: int) -> None:
        if not ids:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab = self.loaded.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len and max_tokens > 0:
            raise ValueError(f"prompt has {len(ids)} tokens; the context limit is "
                             f"{self.max_model_len} (max_model_len), leaving no room to generate")
        total = min(len(ids) + max_tokens, self.max_model_len)
        capacity = self.runner.num_blocks * self.config.block_size
        if total > capacity:
            raise ValueError(f"prompt + max_tokens needs {total} KV slots; the KV cache holds "
                             f"{capacity} (num_kv_blocks x block_size)")

    def abort(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        sched, pool = self.scheduler, self.kv.pool
        return EngineStats(len(sched.running), len(sched.waiting), pool.num_blocks,
                           pool.num_used, sched.num_preemptions)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one step; return the sequences that made progress (new tokens or finished)."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        progressed = self.postprocess(batch, self.runner.run(batch))
        for seq in progressed:
            if seq.is_finished:
                self.requests.pop(seq.request_id, None)
        return progressed

    def postprocess(self, batch: ScheduledBatch, result: StepResult) -> list[Sequence]:
        spans = iter(result.scored)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.wants_prompt_logprobs:
                _store_prompt_logprobs(seq, next(spans))
            seq.num_computed_tokens += n
            self.kv.commit(seq)
            if seq.score_only and seq.num_computed_tokens == seq.num_tokens:
                self.scheduler.finish(seq, "length")
        for seq, token, logprob, top in zip(result.sampled, result.tokens, result.logprobs,
                                            result.top_logprobs, strict=True):
            self._append_token(seq, token, logprob, top)
        return [s for s in batch.seqs if s.score_only or s.is_finished] + [
            s for s in result.sampled if not s.is_finished]

    def _append_token(self, seq: Sequence, token: int, logprob: float,
                      top: dict[int, float]) -> None:
        seq.output_token_ids.append(token)
        seq.logprobs.append(logprob)
        if seq.params.logprobs is not None:
            seq.top_logprobs.append(top)
        reason = self._finish_reason(seq, token)
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if (token in self._eos and not p.ignore_eos) or token in (p.stop_token_ids or ()):
            return "stop"
        if p.stop_strings and self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_token_ids)
            hits = [text.find(s) for s in p.stop_strings if s and s in text]
            if hits:
                seq.text = text[:min(hits)]
                return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def prompt_hidden(self, token_ids: list[int]) -> torch.Tensor:
        """Final-norm hidden states [n, H] at every position of one prompt, in one pass."""
        self._check_prompt(token_ids, 0)
        seq = Sequence("prompt-hidden", list(token_ids), SamplingParams(), 0, score_only=True)
        if not self.kv.allocate(seq, len(token_ids)):
            raise RuntimeError("not enough free KV blocks for one prompt")
        try:
            return self.runner.all_hidden(ScheduledBatch([seq], [len(token_ids)]))
        finally:
            self.kv.free(seq)

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [n, V] at every position of one prompt, computed in one pass."""
        with torch.inference_mode():
            return self.runner.model.compute_logits(self.prompt_hidden(token_ids))

    # ---- outputs --------------------------------------------------------------------------
    def output(self, seq: Sequence, prompt: str | None = None) -> RequestOutput:
        text = seq.text
        if text is None:
            text = self.tokenizer.decode(seq.output_token_ids) if self.tokenizer else ""
        return RequestOutput(seq.request_id, prompt, seq.prompt_token_ids,
                             list(seq.output_token_ids), text, seq.finish_reason,
                             list(seq.logprobs), seq.seed, self.fingerprint,
                             list(seq.top_logprobs), seq.num_cached_tokens,
                             self._prompt_logprobs(seq))

    def _prompt_logprobs(self, seq: Sequence) -> PromptLogprobs | None:
        """vLLM's shape: None, then per prompt token {token id: Logprob}, the token itself first,
        then the top-k of its position (ranks 1..k; as vLLM, a top-k entry for the token itself
        replaces its own entry, keeping its place first)."""
        if seq.params.prompt_logprobs is None:
            return None
        out: PromptLogprobs = [None]
        for i, (lp, rank) in enumerate(zip(seq.prompt_logprobs, seq.prompt_ranks, strict=True)):
            token = seq.prompt_token_ids[i + 1]
            entry = {token: Logprob(lp, rank, self._token_text(token))}
            for r, (tid, v) in enumerate(seq.prompt_top[i].items(), start=1):
                entry[tid] = Logprob(v, r, self._token_text(tid))
            out.append(entry)
        return out

    def _token_text(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else None

    def run_to_completion(self) -> Iterator[Sequence]:
        """Step until idle, yielding each sequence as it finishes."""
        while self.has_unfinished():
            yield from (seq for seq in self.step() if seq.is_finished)


def _store_prompt_logprobs(seq: Sequence, span: ScoredSpan) -> None:
    """Write a span's prompt logprobs at their positions (a recompute overwrites, never appends)."""
    start = seq.num_computed_tokens
    for values, new in ((seq.prompt_logprobs, span.logprobs), (seq.prompt_ranks, span.ranks),
                        (seq.prompt_top, span.top)):
        if new or len(values) > start:
            del values[start:]
            values.extend(new)
