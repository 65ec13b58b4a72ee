"""The engine: requests in, one step at a time, outputs out.

A step reads like prose: schedule -> run -> postprocess. Nothing in a step may change a request's
bits; that is the ops' job (samebits.ops.backend) and the sampler's (counter-based streams).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from samebits.config import EngineConfig
from samebits.engine.grammar import GrammarCompiler, GrammarState
from samebits.engine.isolation import RequestError, cause, token_cause
from samebits.engine.kv_cache import KVCacheManager
from samebits.engine.runner import ModelRunner, ScoredSpan, StepResult
from samebits.engine.scheduler import ScheduledBatch, Scheduler
from samebits.engine.sequence import CompletionOutput, Logprob, PromptLogprobs, Sequence
from samebits.loader import LoadedModel, load
from samebits.models.weights import update_weights
from samebits.sampling_params import SamplingParams
from samebits.text.detokenizer import IncrementalDetokenizer

log = logging.getLogger("samebits.engine")


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
    progress; finished ones are forgotten by the engine once returned), ``completion`` (a
    sequence's ``CompletionOutput``), ``prompt_logprobs``, ``has_unfinished``, ``stats``,
    ``update_weights``, and for pausing a request mid-way ``park`` / ``unpark`` /
    ``parked_blocks_needed`` / ``prefix_cache_bypassed``. Not thread-safe: one thread drives it."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded or load(config)
        self.tokenizer = self.loaded.tokenizer
        self.fingerprint = self.loaded.fingerprint  # the same for every tensor_parallel_size
        self.max_model_len = self.loaded.max_model_len
        self.runner = ModelRunner(self.loaded, config)
        if config.tensor_parallel_size > 1:
            from samebits.distributed import enable_tensor_parallel
            enable_tensor_parallel(self.runner, self.loaded, config)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size,
                                 config.enable_prefix_caching, self.fingerprint)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, self.kv,
                                   config.prefill_chunk_tokens)
        self.requests: dict[str, Sequence] = {}
        self._parked: dict[str, bool] = {}  # parked request id -> it was running (holds blocks)
        self._seed_rng = random.Random(config.seed)
        self._eos = set(self.tokenizer.eos_token_ids if self.tokenizer else
                        self.loaded.model_config.eos_token_ids)
        self.grammars = (GrammarCompiler(self.tokenizer, self.loaded.model_config.vocab_size,
                                         self._eos) if self.tokenizer is not None else None)
        if self.runner.device.type == "cuda":
            self._warm_up()

    def _warm_up(self) -> None:
        """Run prefills of each row-count class the kernels pick tiles by, alone and after a
        cached context, so every kernel variant a step can launch is compiled before the first
        request (decode kernels were compiled by the CUDA-graph captures), then the sampling
        tail of every decode batch size (``ModelRunner.warm_up_sampling``). Nothing stays behind:
        no request, no cached block, no drawn seed."""
        capacity = self.runner.num_blocks * self.config.block_size
        limit = min(self.config.max_num_batched_tokens, self.max_model_len - 1, capacity) - 16
        for n in sorted({min(n, limit) for n in (1, 8, 16, 32, 64, 128, 256, 1024, limit)}):
            self.prompt_hidden([0] * n)
            self.prompt_hidden([0] * (16 + n), chunks=[16, n])
        self.runner.warm_up_sampling()

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    score_only: bool = False, index: int = 0, cache_salt: str | None = None
                    ) -> Sequence:
        """Validate and queue a request (choice ``index`` of its prompt); a bad one raises
        ``ValueError`` and changes nothing. Without a seed, one is drawn (``draw_seed``).
        ``cache_salt``: prefix-cache blocks are shared only between requests with the same salt
        (None is a salt of its own); it never changes the bits, only what may be reused."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._check_prompt(prompt_token_ids, 0 if score_only else params.max_tokens)
        self._check_token_params(params)
        grammar = self._grammar(params) if not score_only else None
        seed = params.seed if params.seed is not None else self.draw_seed()
        seq = Sequence(request_id, list(prompt_token_ids), params, seed, score_only=score_only,
                       index=index, stop_ids=self._stop_ids(params), grammar=grammar,
                       cache_salt=cache_salt)
        if params.stop_strings and self.tokenizer is not None and not score_only:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop_strings)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def _grammar(self, params: SamplingParams) -> GrammarState | None:
        """The request's own grammar matcher (structured output), or None."""
        if params.structured_outputs is None:
            return None
        if self.grammars is None:
            raise ValueError("structured_outputs needs a tokenizer; this model has none")
        try:
            return self.grammars.state(params.structured_outputs)
        except ValueError as e:
            raise ValueError(f"structured_outputs: {e}") from None

    def draw_seed(self) -> int:
        """A seed for a request that gave none (from the engine's ``seed``), in [0, 2**63)."""
        return self._seed_rng.getrandbits(63)

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        eos = frozenset() if params.ignore_eos else frozenset(self._eos)
        return eos | frozenset(params.stop_token_ids or ())

    def _check_token_params(self, params: SamplingParams) -> None:
        vocab = self.loaded.model_config.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or {}),
                          ("stop_token_ids", params.stop_token_ids or ())):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name} has token id {bad[0]}, outside the vocabulary "
                                 f"[0, {vocab})")

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
        """Finish the request (parked or not) and free its KV blocks; unknown ids are ignored."""
        if request_id in self._parked:
            self.unpark(request_id)
        seq = self.requests.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")

    # ---- parked requests (the server's determinism canary pauses its replays) ---------------
    def park(self, request_id: str) -> None:
        """Take an unfinished request out of scheduling, keeping its progress and KV blocks:
        steps skip it and ``has_unfinished`` no longer counts it, until ``unpark`` (back to the
        queue it left, running or waiting) or ``abort``."""
        seq, sched = self.requests[request_id], self.scheduler
        running = seq in sched.running
        (sched.running if running else sched.waiting).remove(seq)
        self._parked[request_id] = running

    def unpark(self, request_id: str) -> None:
        running = self._parked.pop(request_id)
        (self.scheduler.running if running else self.scheduler.waiting).append(
            self.requests[request_id])

    def parked_blocks_needed(self) -> bool:
        """Whether parked requests hold KV blocks the queue waits for: one was parked running
        (it holds blocks), nothing runs, and requests wait."""
        sched = self.scheduler
        return any(self._parked.values()) and not sched.running and bool(sched.waiting)

    @contextlib.contextmanager
    def prefix_cache_bypassed(self) -> Iterator[None]:
        """Steps inside neither read nor fill the prefix cache (a replay computes everything)."""
        saved = self.kv.enable_prefix_caching
        self.kv.enable_prefix_caching = False
        try:
            yield
        finally:
            self.kv.enable_prefix_caching = saved

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        sched, pool = self.scheduler, self.kv.pool
        return EngineStats(len(sched.running), len(sched.waiting), pool.num_blocks,
                           pool.num_used, sched.num_preemptions)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one step; return the sequences that made progress (new tokens or finished). A
        request whose own work fails in the step (``samebits.engine.isolation``) is among them,
        finished with ``finish_reason="error"`` and ``error`` naming the cause; the others go on
        with their bits unchanged."""
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
            self._advance(seq, token, logprob, top, result.failed.get(seq.request_id))
        return [s for s in batch.seqs if s.score_only or s.is_finished] + [
            s for s in result.sampled if not s.is_finished]

    def _advance(self, seq: Sequence, token: int, logprob: float, top: dict[int, float],
                 failed: RequestError | None) -> None:
        """Append the sampled token, unless the request's own work failed: in the runner
        (``failed``), in the model (a non-finite row) or here (its grammar, stop strings or
        detokenizer); then it alone finishes with the error."""
        error = failed or token_cause(logprob)
        if error is None:
            try:
                self._append_token(seq, token, logprob, top)
                return
            except Exception as e:
                error = cause("its output", e)
        log.warning("request %s failed alone: %s", seq.request_id, error.message)
        seq.error = error
        if not seq.is_finished:
            self.scheduler.finish(seq, "error")

    def _append_token(self, seq: Sequence, token: int, logprob: float,
                      top: dict[int, float]) -> None:
        seq.output_token_ids.append(token)
        seq.logprobs.append(logprob)
        if seq.grammar is not None:
            seq.grammar.accept(token)
        if seq.params.logprobs is not None:
            seq.top_logprobs.append(top)
        reason = self._finish_reason(seq, token)
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p, n = seq.params, len(seq.output_token_ids)
        if token in seq.stop_ids and n > p.min_tokens:  # sampling masks them before min_tokens
            return "stop"
        if seq.grammar is not None and seq.grammar.terminated:  # a complete output, then a stop token
            return "stop"
        if seq.detokenizer is not None:
            new = seq.detokenizer.push(token)
            cut = seq.detokenizer.find_stop(len(new)) if n >= p.min_tokens else None
            if cut is not None:
                seq.text = seq.detokenizer.text[:cut]
                return "stop"
        if n >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def prompt_hidden(self, token_ids: list[int], chunks: list[int] | None = None
                      ) -> torch.Tensor:
        """Final-norm hidden states [n, H] at every position of one prompt, computed in one pass
        or in prefill chunks of the given sizes."""
        self._check_prompt(token_ids, 0)
        seq = Sequence("prompt-hidden", list(token_ids), SamplingParams(), 0, score_only=True)
        hidden = []
        try:
            for n in chunks or [len(token_ids)]:
                if not self.kv.allocate(seq, n):
                    raise RuntimeError("not enough free KV blocks for one prompt")
                hidden.append(self.runner.all_hidden(ScheduledBatch([seq], [n])))
                seq.num_computed_tokens += n
            return torch.cat(hidden)
        finally:
            self.kv.free(seq)

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [n, V] at every position of one prompt, computed in one pass."""
        with torch.inference_mode():
            return self.runner.model.compute_logits(self.prompt_hidden(token_ids))

    # ---- weights --------------------------------------------------------------------------
    def update_weights(self, named_tensors) -> str:
        """Copy HF-named tensors into the model in place (all or nothing; see
        ``samebits.models.weights.update_weights``) and re-key the numerics; the new fingerprint.

        In place, so captured CUDA graphs keep reading the right memory. Only while idle: a
        request never mixes old and new weights.
        """
        if self.has_unfinished():
            raise RuntimeError("update_weights: requests are in flight; drain the engine first")
        model = self.loaded.model  # the full model (under tensor parallel: rank 0's)
        items = update_weights(model, named_tensors)
        h = hashlib.sha256(self.fingerprint.encode())
        for name, tensor in sorted(items, key=lambda it: it[0]):
            h.update(name.encode())
            h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        self.fingerprint = self.loaded.fingerprint = "fp_" + h.hexdigest()[:16]
        hook = getattr(model.ops, "weights_updated", None)
        if hook is not None:  # a backend that keeps repacked weights refreshes them
            hook(model)
        shards = getattr(self.runner.model, "weights_updated", None)
        if shards is not None:  # tensor parallel: every rank updates and re-shards
            shards(items)
        self.kv.set_fingerprint(self.fingerprint)
        self.runner.discard_ahead()  # launched with the old weights
        return self.fingerprint

    # ---- outputs --------------------------------------------------------------------------
    def completion(self, seq: Sequence, index: int | None = None) -> CompletionOutput:
        """One sequence's result: choice ``seq.index``, or ``index`` when given (best_of
        renumbers the chosen candidates)."""
        text = seq.text
        if text is None and self.tokenizer is not None:
            ids = seq.output_token_ids
            if seq.finish_reason == "stop" and ids and ids[-1] in seq.stop_ids:
                ids = ids[:-1]  # as vLLM: the token that stopped it is not in the text
            text = self.tokenizer.decode(ids)
        return CompletionOutput(seq.index if index is None else index, text or "",
                                list(seq.output_token_ids), list(seq.logprobs),
                                list(seq.top_logprobs), float(sum(seq.logprobs)),
                                seq.finish_reason, seq.seed)

    def prompt_logprobs(self, seq: Sequence) -> PromptLogprobs | None:
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
