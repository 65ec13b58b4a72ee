"""The engine: requests in, one step at a time, outputs out.

A step reads like prose: schedule -> run -> postprocess. Nothing in a step may change a request's
bits; that is the ops' job (samebits.ops.backend) and the sampler's (counter-based streams). The
engine keeps token ids and fp32 logprobs; ``output`` (samebits.engine.output_processor) turns
sequences into what callers read.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from samebits.config import EngineConfig
from samebits.engine.context_length import check_context_length
from samebits.engine.executor import start_runner
from samebits.engine.fanout import request_seed
from samebits.engine.grammar import GrammarCompiler, GrammarState
from samebits.engine.isolation import cause, token_cause
from samebits.engine.kv_cache import KVCacheManager
from samebits.engine.logits_processor import with_bad_words_token_ids
from samebits.engine.output_processor import OutputProcessor
from samebits.engine.pooling import PoolingSequence, pooling_sequence
from samebits.engine.pooling_runner import pooling_runner
from samebits.engine.request_error import RequestError
from samebits.engine.scheduler import ScheduledBatch, Scheduler
from samebits.engine.sequence import Sequence
from samebits.engine.step import ScoredSpan, StepResult
from samebits.loader import LoadedModel, numerics_fingerprint, updated_digest
from samebits.log import get_logger
from samebits.models.weights import update_weights
from samebits.outputs import RequestMetrics
from samebits.pooling_params import PoolingParams
from samebits.sampling_params import SamplingParams

log = get_logger("engine")


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load, for metrics and admission decisions."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    num_preemptions: int  # since start
    num_scheduled_tokens: int  # since start: the tokens every step ran


class LLMEngine:
    """The engine's interface: ``add_request``, ``abort``, ``step`` (the sequences that made
    progress; finished ones are forgotten by the engine once returned), ``output`` (the
    ``OutputProcessor`` that turns a sequence into a ``CompletionOutput`` and its prompt
    logprobs), ``has_unfinished``, ``stats``, ``update_weights``, ``sleep`` / ``wake_up``, and for
    pausing a request mid-way ``park`` / ``unpark`` / ``parked_blocks_needed``. Not thread-safe:
    one thread drives it.

    An embedding model's engine (``EngineConfig(task="embed")``) takes pooling requests only
    (``PoolingParams``): the same scheduler, a pooling runner (``samebits.engine.pooling_runner``)
    and the model's pooler; a finished ``PoolingSequence`` carries its ``embedding``."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        pooling = config.task == "embed"  # an embedding model: pooling requests only
        self.runner = (pooling_runner(config, loaded) if pooling
                       else start_runner(config, loaded))  # and ranks 1..N-1 under TP
        self.loaded = self.runner.loaded
        self.tokenizer = self.loaded.tokenizer
        self.fingerprint = self.loaded.fingerprint  # the same for every tensor_parallel_size
        self.max_model_len = self.loaded.max_model_len
        self.output = OutputProcessor(self.tokenizer)
        self.asleep: set[str] = set()  # what sleep() released: "kv_cache", "weights"
        if self.runner.device.type == "cpu" and config.batch_invariant:
            prepare_cpu_kernels()  # before the first request, so it runs at warm speed
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size,
                                 config.enable_prefix_caching, self.fingerprint)
        chunked = not pooling or self.runner.chunked_prefill  # an encoder's prompt runs whole
        ahead = not pooling and config.async_scheduling and self.runner.graphs is not None
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, self.kv,
                                   None if pooling else config.prefill_chunk_tokens, chunked,
                                   self.max_model_len if ahead else 0)
        self.requests: dict[str, Sequence] = {}
        self._seed_rng = random.Random(config.seed)
        self._eos = set(self.tokenizer.eos_token_ids if self.tokenizer else
                        self.loaded.model_config.eos_token_ids)
        self.grammars = (GrammarCompiler(self.tokenizer, self.loaded.model_config.vocab_size,
                                         self._eos) if self.tokenizer is not None else None)
        if self.runner.device.type == "cuda" and not pooling:
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
                    score_only: bool = False, index: int = 0, cache_salt: str | None = None,
                    bypass_prefix_cache: bool = False) -> Sequence:
        """Validate and queue a request (choice ``index`` of its prompt); a bad one raises
        ``ValueError`` and changes nothing. Without a seed, one is drawn (``draw_seed``).
        ``cache_salt``: prefix-cache blocks are shared only between requests with the same salt
        (None is a salt of its own); it never changes the bits, only what may be reused.
        ``bypass_prefix_cache``: the request neither reads nor fills the prefix cache."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._check_awake()
        if isinstance(params, PoolingParams) or self.config.task == "embed":
            return self._add_pooling_request(request_id, prompt_token_ids, params)
        prompt_token_ids = self._truncated(prompt_token_ids, params)
        self._check_prompt(prompt_token_ids, 0 if score_only else params.max_tokens)
        if params.max_tokens is None:  # up to the end of the context
            params = replace(params, max_tokens=self.max_model_len - len(prompt_token_ids))
        params = with_bad_words_token_ids(params, self.tokenizer)
        self._check_token_params(params)
        grammar = self._grammar(params) if not score_only else None
        seq = Sequence(request_id, list(prompt_token_ids), params,
                       request_seed(params, self.draw_seed), score_only=score_only, index=index,
                       stop_ids=self._stop_ids(params), grammar=grammar, cache_salt=cache_salt,
                       bypass_prefix_cache=bypass_prefix_cache,
                       metrics=RequestMetrics(arrival_time=time.time()))
        if not score_only:
            seq.detokenizer = self.output.text_for(params)
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

    def _check_awake(self) -> None:
        if self.asleep:
            raise RuntimeError(f"the engine is asleep ({', '.join(sorted(self.asleep))} "
                               "released): call wake_up() first")

    def _truncated(self, ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt's last ``truncate_prompt_tokens`` tokens (-1: ``max_model_len``)."""
        k = params.truncate_prompt_tokens
        if k is None:
            return ids
        return list(ids[-(self.max_model_len if k == -1 else k):])

    def draw_seed(self) -> int:
        """A seed for a request that gave none (from the engine's ``seed``), in [0, 2**63)."""
        return self._seed_rng.getrandbits(63)

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        eos = frozenset() if params.ignore_eos else frozenset(self._eos)
        return eos | frozenset(params.stop_token_ids or ())

    def _check_token_params(self, params: SamplingParams) -> None:
        vocab = self.loaded.model_config.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or {}),
                          ("stop_token_ids", params.stop_token_ids or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("bad_words", [t for w in params.bad_words_token_ids or () for t in w])):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name} has token id {bad[0]}, outside the vocabulary "
                                 f"[0, {vocab})")

    def _check_prompt(self, ids: list[int], max_tokens: int | None) -> None:
        if not ids:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab = self.loaded.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        check_context_length(len(ids), max_tokens, self.max_model_len)
        wanted = self.max_model_len if max_tokens is None else len(ids) + max_tokens
        total = min(wanted, self.max_model_len)
        capacity = self.runner.num_blocks * self.config.block_size
        if total > capacity:
            raise ValueError(f"prompt + max_tokens needs {total} KV slots; the KV cache holds "
                             f"{capacity} (num_kv_blocks x block_size)")

    def abort(self, request_id: str) -> None:
        """Finish the request (parked or not) and free its KV blocks; unknown ids are ignored."""
        seq = self.requests.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")
            _mark_finished(seq)

    # ---- parked requests (the server's determinism canary pauses its replays) ---------------
    def park(self, request_id: str) -> None:
        """Take an unfinished request out of scheduling, keeping its progress and KV blocks:
        steps skip it and ``has_unfinished`` no longer counts it, until ``unpark`` or ``abort``."""
        self.scheduler.pause(self.requests[request_id])

    def unpark(self, request_id: str) -> None:
        self.scheduler.resume(self.requests[request_id])

    def parked_blocks_needed(self) -> bool:
        """Whether parked requests hold KV blocks the queue waits for."""
        return self.scheduler.paused_blocks_needed()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def check_health(self) -> None:
        """Raise ``RankFailedError`` naming a tensor-parallel rank whose process died."""
        self.runner.check_health()

    def stats(self) -> EngineStats:
        sched, pool = self.scheduler, self.kv.pool
        return EngineStats(len(sched.running), len(sched.waiting), pool.num_blocks,
                           pool.num_used, sched.num_preemptions,
                           sched.num_scheduled_tokens)

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
        spans, now = iter(result.scored), time.time()
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.metrics is not None and seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
            if seq.wants_prompt_logprobs:
                _store_prompt_logprobs(seq, next(spans))
            seq.num_computed_tokens += n
            self.kv.commit(seq)
            if seq.score_only and seq.num_computed_tokens == seq.num_tokens:
                self.scheduler.finish(seq, "length")
                _mark_finished(seq, now)
        ranks = result.ranks or [None] * len(result.tokens)
        for seq, token, logprob, top, rank in zip(result.sampled, result.tokens, result.logprobs,
                                                  result.top_logprobs, ranks, strict=True):
            self._advance(seq, token, logprob, top, rank, now,
                          result.failed.get(seq.request_id))
        return [s for s in batch.seqs if s.score_only or s.is_finished] + [
            s for s in result.sampled if not s.is_finished]

    def _advance(self, seq: Sequence, token: int, logprob: float, top: dict[int, float],
                 rank: int | None, now: float, failed: RequestError | None) -> None:
        """Append the sampled token, unless the request's own work failed: in the runner
        (``failed``), in the model (a non-finite row) or here (its grammar, stop strings or
        detokenizer); then it alone finishes with the error."""
        error = failed or token_cause(logprob)
        if error is None:
            try:
                self._append_token(seq, token, logprob, top, rank, now)
                return
            except Exception as e:
                error = cause("its output", e)
        log.warning("request %s failed alone: %s", seq.request_id, error.message)
        seq.error = error
        if not seq.is_finished:
            self.scheduler.finish(seq, "error")
            _mark_finished(seq, now)

    def _append_token(self, seq: Sequence, token: int, logprob: float, top: dict[int, float],
                      rank: int | None = None, now: float | None = None) -> None:
        seq.output_token_ids.append(token)
        seq.logprobs.append(logprob)
        if seq.grammar is not None:
            seq.grammar.accept(token)
        if seq.params.logprobs is not None:
            seq.top_logprobs.append(top)
            seq.ranks.append(rank)
        if seq.metrics is not None:
            now = time.time() if now is None else now
            seq.metrics.first_token_time = seq.metrics.first_token_time or now
            seq.metrics.last_token_time = now
        reason = self._finish_reason(seq, token)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            _mark_finished(seq, now)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Why the sequence ends with ``token`` (None: it goes on); sets ``stop_reason`` and
        feeds the token to the sequence's ``OutputText`` (a stop token only with
        ``include_stop_str_in_output``, as vLLM), searched for stop strings from
        ``min_tokens`` on."""
        p, n, text = seq.params, len(seq.output_token_ids), seq.detokenizer
        if token in seq.stop_ids and n > p.min_tokens:  # sampling masks them before min_tokens
            eos = token in self._eos and not p.ignore_eos
            seq.stop_reason = None if eos else token
            if text is not None and p.include_stop_str_in_output:
                text.push(token)
            return "stop"
        new = 0
        if text is not None:
            text.push(token)
            new = text.drain() if text.has_stops else 0  # else detokenized when read
        if seq.grammar is not None and seq.grammar.terminated:  # a complete output, then a stop token
            return "stop"
        if new and n >= p.min_tokens:
            seq.stop_reason = text.find_stop(new)
            if seq.stop_reason is not None:
                return "stop"
        if n >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def prompt_hidden(self, token_ids: list[int], chunks: list[int] | None = None
                      ) -> torch.Tensor:
        """Final-norm hidden states [n, H] at every position of one prompt, computed in one pass
        or in prefill chunks of the given sizes."""
        self._check_awake()
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
            return self.runner.compute_logits(self.prompt_hidden(token_ids))

    # ---- weights --------------------------------------------------------------------------
    def update_weights(self, named_tensors) -> str:
        """Copy HF-named tensors into the model in place (all or nothing; see
        ``samebits.models.weights.update_weights``) and re-key the numerics; the new fingerprint.

        In place, so captured CUDA graphs keep reading the right memory. Only while idle: a
        request never mixes old and new weights.
        """
        if self.has_unfinished():
            raise RuntimeError("update_weights: requests are in flight; drain the engine first")
        model = self.loaded.model  # this rank's (under tensor parallel: rank 0's shard)
        items = update_weights(model, named_tensors)
        self.loaded.weights_digest = updated_digest(self.loaded.weights_digest, items)
        self.fingerprint = self.loaded.fingerprint = numerics_fingerprint(
            self.config, self.loaded.model_config, model.ops, self.loaded.weights_digest)
        hook = getattr(model.ops, "weights_updated", None)
        if hook is not None and "weights" not in self.asleep:  # else refreshed at wake-up
            hook(model)
        self.runner.weights_updated(items)  # tensor parallel: every other rank loads its part
        self.kv.set_fingerprint(self.fingerprint)
        self.runner.discard_ahead()  # launched with the old weights
        return self.fingerprint

    # ---- sleep mode (colocated RL: the trainer gets the memory between rollouts) -------------
    def sleep(self, level: int = 1) -> None:
        """While idle, free device memory: level 1 the KV cache (and the CUDA graphs that read
        it), level 2 also the weights (moved to host memory). Cached prefixes are forgotten.
        ``wake_up`` brings both back; outputs are then bitwise those of before, and weights
        updated while asleep (``update_weights`` writes the host copy) give what a fresh engine
        with those weights gives."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (KV cache) or 2 (KV cache and weights), "
                             f"got {level!r}")
        if self.has_unfinished():
            raise RuntimeError("sleep: requests are in flight; let them finish first")
        if self.config.tensor_parallel_size > 1:
            raise ValueError("sleep mode needs tensor_parallel_size=1")
        released = {"kv_cache"} | ({"weights"} if level == 2 else set())
        if released <= self.asleep:
            return
        self.runner.sleep(offload_weights="weights" in released - self.asleep)
        self.kv.set_fingerprint(self.fingerprint)  # the blocks' contents are gone
        self.asleep |= released

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` released: ``tags`` "weights" and/or "kv_cache" (None: both;
        vLLM's RL pattern wakes the weights, updates them, then wakes the KV cache). The KV
        cache's CUDA graphs are captured anew, so the weights must be back first."""
        wanted = {"weights", "kv_cache"} if tags is None else set(tags)
        if wanted - {"weights", "kv_cache"}:
            raise ValueError(f"wake_up tags are 'weights' and 'kv_cache', got {sorted(wanted)}")
        weights, kv = "weights" in wanted & self.asleep, "kv_cache" in wanted & self.asleep
        if kv and "weights" in self.asleep and not weights:
            raise ValueError("wake_up(['kv_cache']) needs the weights awake first (the CUDA "
                             "graphs read them): wake_up(['weights']) or wake_up()")
        self.runner.wake_up(weights, kv)
        hook = getattr(self.loaded.model.ops, "weights_updated", None)
        if weights and hook is not None:  # the weights moved: no stale repacked copy is used
            hook(self.loaded.model)
        self.asleep -= {t for t, woke in (("weights", weights), ("kv_cache", kv)) if woke}

    def run_to_completion(self) -> Iterator[Sequence]:
        """Step until idle, yielding each sequence as it finishes."""
        while self.has_unfinished():
            yield from (seq for seq in self.step() if seq.is_finished)

    # ---- pooling requests (embedding models) ----------------------------------------------
    def _add_pooling_request(self, request_id: str, prompt_token_ids: list[int],
                             params: PoolingParams) -> PoolingSequence:
        """Queue a pooling request: prefilled, never sampled; finished with its ``embedding``
        in the step that computes its whole prompt. Only an embedding model takes them."""
        if self.config.task != "embed":
            raise ValueError("pooling requests need an embedding model: "
                             "LLMEngine(EngineConfig(task='embed'))")
        limit = min(self.max_model_len, self.runner.num_blocks * self.config.block_size)
        if not self.scheduler.chunked_prefill:  # a prompt must fit one step
            limit = min(limit, self.config.max_num_batched_tokens)
        seq = pooling_sequence(request_id, prompt_token_ids, params,
                               self.loaded.model_config.vocab_size, limit)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq


def _mark_finished(seq: Sequence, now: float | None = None) -> None:
    if seq.metrics is not None:
        seq.metrics.finished_time = time.time() if now is None else now


def prepare_cpu_kernels() -> None:
    """Build (first run: g++, some 20 s) or load (cached: milliseconds) the invariant CPU kernels,
    once per process, saying so with the time it took."""
    global _cpu_kernels_ready
    if _cpu_kernels_ready:
        return
    from samebits.ops import cpu_kernels
    start = time.perf_counter()
    log.info("loading the invariant CPU kernels (built with g++ on the first run, then cached)")
    cpu_kernels.load()
    log.info("invariant CPU kernels ready in %.1f s", time.perf_counter() - start)
    _cpu_kernels_ready = True


_cpu_kernels_ready = False


def _store_prompt_logprobs(seq: Sequence, span: ScoredSpan) -> None:
    """Write a span's prompt logprobs at their positions (a recompute overwrites, never appends)."""
    start = seq.num_computed_tokens
    for values, new in ((seq.prompt_logprobs, span.logprobs), (seq.prompt_ranks, span.ranks),
                        (seq.prompt_top, span.top)):
        if new or len(values) > start:
            del values[start:]
            values.extend(new)
