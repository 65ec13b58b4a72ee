"""Prometheus metrics, in a registry of the app's own (two apps in one process never collide).

The HTTP side counts requests by status; the engine loop reports tokens, queue lengths, batch
sizes, KV blocks in use and latencies; the embedding engine's loop reports embedded inputs and tokens.
prometheus_client is thread-safe, so all may write.

vLLM's names are exported beside samebits' own, with vLLM's ``model_name`` label (the served
model's name), so a vLLM dashboard or alert reads a samebits server unchanged:
``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (a
fraction, as vLLM's), ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
``vllm:e2e_request_latency_seconds`` and ``vllm:request_success_total`` (by
``finished_reason``: stop, length, abort); vLLM-only: ``vllm:num_preemptions_total``,
``vllm:iteration_tokens_total`` (tokens each engine step ran) and each request's phases,
``vllm:request_queue_time_seconds`` (arrival to the step that took it in),
``vllm:request_prefill_time_seconds`` (to its first token), ``vllm:request_decode_time_seconds``
(first token to finish) and ``vllm:request_inference_time_seconds`` (scheduled to finish). The
engine loop writes each pair through one name
(``prompt_tokens.inc``, ``ttft.observe``, ...): the two never disagree. The serving layer adds,
per finished engine request (one per choice), ``vllm:request_prompt_tokens``,
``vllm:request_generation_tokens``, ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``
(prompt tokens looked up / read from the prefix cache) and, once per prompt,
``vllm:request_params_n`` / ``vllm:request_params_max_tokens``; ``vllm:cache_config_info``
carries the KV cache's block size and block count.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's request_params_n buckets


def _token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return tuple(out)
            out.append(step * scale)
        scale *= 10


class _Both:
    """samebits' metric and vLLM's twin, written together (``inc``, ``set``, ``observe``)."""

    def __init__(self, own: Any, vllm: Any) -> None:
        self.own, self.vllm = own, vllm

    def inc(self, amount: float = 1) -> None:
        self.own.inc(amount)
        self.vllm.inc(amount)

    def set(self, value: float) -> None:
        self.own.set(value)
        self.vllm.set(value)

    def observe(self, value: float) -> None:
        self.own.observe(value)
        self.vllm.observe(value)


class _Remembered:
    """A gauge that remembers the value it was set to (``value``)."""

    def __init__(self, gauge: Gauge) -> None:
        self.gauge, self.value = gauge, 0.0

    def set(self, value: float) -> None:
        self.gauge.set(value)
        self.value = value


class _Finished:
    """``finished.labels(reason=...).inc()``: samebits' count by reason, and vLLM's
    ``request_success`` for the reasons vLLM counts (an engine error is no success)."""

    def __init__(self, own: Counter, vllm: Counter, model: str) -> None:
        self.own, self.vllm, self.model = own, vllm, model

    def labels(self, reason: str) -> _Both | Counter:
        if reason not in ("stop", "length", "abort"):
            return self.own.labels(reason=reason)
        return _Both(self.own.labels(reason=reason),
                     self.vllm.labels(model_name=self.model, finished_reason=reason))


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model: str, fingerprint: str, batch_invariant: bool,
                 max_model_len: int = 8192) -> None:
        self.registry = r = CollectorRegistry()
        self.vllm = vllm = _VLLM(model, r, max_model_len)
        self.requests = Counter("samebits_requests", "HTTP requests to /v1/*, by status code",
                                ["status"], registry=r)
        self.finished = _Finished(Counter(
            "samebits_engine_requests_finished",
            "Engine requests (one per choice) finished, by reason", ["reason"], registry=r),
            vllm.request_success, model)
        self.prompt_tokens = _Both(Counter("samebits_prompt_tokens", "Prompt tokens admitted",
                                           registry=r), vllm.prompt_tokens)
        self.generation_tokens = _Both(Counter("samebits_generation_tokens", "Tokens generated",
                                               registry=r), vllm.generation_tokens)
        self.running = _Both(Gauge("samebits_num_requests_running", "Engine requests running",
                                   registry=r), vllm.running)
        self.waiting = _Both(Gauge("samebits_num_requests_waiting", "Engine requests waiting",
                                   registry=r), vllm.waiting)
        self.kv_usage = vllm.kv_usage
        self.kv_blocks = Gauge("samebits_kv_blocks_in_use", "KV cache blocks referenced by "
                               "requests (free prefix-cache blocks not counted)", registry=r)
        self.kv_blocks_total = _Remembered(Gauge("samebits_kv_blocks_total", "KV cache blocks",
                                                 registry=r))
        self.batch_size = Histogram("samebits_batch_size", "Sequences that made progress in an "
                                    "engine step", buckets=_BATCH_BUCKETS, registry=r)
        self.canary_checks = Counter("samebits_canary_checks", "Finished requests replayed "
                                     "alone by the determinism canary", registry=r)
        self.canary_mismatches = Counter("samebits_canary_mismatches", "Canary replays whose "
                                         "output hash differed from what was served", registry=r)
        self.canary_dropped = Counter("samebits_canary_dropped", "Sampled requests not replayed "
                                      "(the canary's queue was full)", registry=r)
        self.ttft = _Both(Histogram("samebits_time_to_first_token_seconds", "Arrival to first "
                                    "token", buckets=_LATENCY_BUCKETS, registry=r), vllm.ttft)
        self.itl = _Both(Histogram("samebits_inter_token_latency_seconds", "Time between two "
                                   "tokens of one request", buckets=_LATENCY_BUCKETS, registry=r),
                         vllm.itl)
        self.e2e = vllm.e2e  # arrival to finish, per engine request
        # per engine request: arrival -> first scheduled -> first token -> finish (vLLM's phases)
        self.queue_time, self.prefill_time = vllm.queue_time, vllm.prefill_time
        self.decode_time, self.inference_time = vllm.decode_time, vllm.inference_time
        self.iteration_tokens = vllm.iteration_tokens  # tokens each engine step ran
        self.preemptions = vllm.num_preemptions
        self.invariant = Gauge("samebits_batch_invariant", "1 when the batch-invariant numerics "
                               "are on, 0 in standard mode", registry=r)
        self.invariant.set(1 if batch_invariant else 0)
        self.embedding_requests = Counter("samebits_embedding_requests", "HTTP requests to "
                                          "/v1/embeddings, by status code", ["status"],
                                          registry=r)
        self.embedding_inputs = Counter("samebits_embedding_inputs", "Inputs embedded",
                                        registry=r)
        self.embedding_tokens = Counter("samebits_embedding_tokens", "Tokens embedded",
                                        registry=r)
        self.embedding_batch_size = Histogram("samebits_embedding_batch_size", "Inputs per "
                                              "embedding engine step (requests together)",
                                              buckets=_BATCH_BUCKETS + (1024, 2048), registry=r)
        self.embedding_latency = Histogram("samebits_embedding_seconds", "Arrival to vectors, "
                                           "per embedding request", buckets=_LATENCY_BUCKETS,
                                           registry=r)
        self._info = Gauge("samebits_model_info", "Each served model and its numerics "
                           "fingerprint", ["model", "system_fingerprint"], registry=r)
        self.add_model(model, fingerprint)

    def add_model(self, model: str, fingerprint: str) -> None:
        self._info.labels(model=model, system_fingerprint=fingerprint).set(1)

    def set_engine_state(self, running: int, waiting: int, kv_blocks: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_blocks.set(kv_blocks)
        total = self.kv_blocks_total.value
        self.kv_usage.set(kv_blocks / total if total else 0.0)

    def request_finished(self, prompt_tokens: int, generation_tokens: int,
                         cached_tokens: int) -> None:
        """One engine request (one choice) finished with these token counts."""
        v = self.vllm
        v.request_prompt_tokens.observe(prompt_tokens)
        v.request_generation_tokens.observe(generation_tokens)
        v.prefix_cache_queries.inc(prompt_tokens)
        v.prefix_cache_hits.inc(cached_tokens)

    def request_params(self, n: int, max_tokens: int | None) -> None:
        """A finished prompt's ``n`` and ``max_tokens`` (once per prompt, as vLLM)."""
        self.vllm.request_params_n.observe(n)
        if max_tokens is not None:
            self.vllm.request_params_max_tokens.observe(max_tokens)

    def cache_config(self, block_size: int, num_blocks: int) -> None:
        """``vllm:cache_config_info``: the KV cache's shape as labels (value 1)."""
        self.vllm.cache_config.labels(block_size=str(block_size),
                                      num_gpu_blocks=str(num_blocks)).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _VLLM:
    """vLLM's metrics (its names, help and ``model_name`` label), for the served model."""

    def __init__(self, model: str, r: CollectorRegistry, max_model_len: int) -> None:
        label = {"model_name": model}

        def one(kind: type, name: str, doc: str, **kw: Any) -> Any:
            return kind(name, doc, ["model_name"], registry=r, **kw).labels(**label)

        self.running = one(Gauge, "vllm:num_requests_running", "Number of requests in model "
                           "execution batches.")
        self.waiting = one(Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be "
                           "processed.")
        self.kv_usage = one(Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 "
                            "percent usage.")
        self.prompt_tokens = one(Counter, "vllm:prompt_tokens", "Number of prefill tokens "
                                 "processed.")
        self.generation_tokens = one(Counter, "vllm:generation_tokens", "Number of generation "
                                     "tokens processed.")
        self.ttft = one(Histogram, "vllm:time_to_first_token_seconds", "Histogram of time to "
                        "first token in seconds.", buckets=_LATENCY_BUCKETS)
        self.itl = one(Histogram, "vllm:inter_token_latency_seconds", "Histogram of inter-token "
                       "latency in seconds.", buckets=_LATENCY_BUCKETS)
        self.e2e = one(Histogram, "vllm:e2e_request_latency_seconds", "Histogram of e2e request "
                       "latency in seconds.", buckets=_LATENCY_BUCKETS)
        self.request_success = Counter("vllm:request_success", "Count of successfully "
                                       "processed requests.", ["model_name", "finished_reason"],
                                       registry=r)
        tokens = _token_buckets(max_model_len)
        self.request_prompt_tokens = one(Histogram, "vllm:request_prompt_tokens", "Number of "
                                         "prefill tokens processed.", buckets=tokens)
        self.request_generation_tokens = one(Histogram, "vllm:request_generation_tokens",
                                             "Number of generation tokens processed.",
                                             buckets=tokens)
        self.request_params_n = one(Histogram, "vllm:request_params_n", "Histogram of the n "
                                    "request parameter.", buckets=_N_BUCKETS)
        self.request_params_max_tokens = one(Histogram, "vllm:request_params_max_tokens",
                                             "Histogram of the max_tokens request parameter.",
                                             buckets=tokens)
        self.prefix_cache_queries = one(Counter, "vllm:prefix_cache_queries", "Prefix cache "
                                        "queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = one(Counter, "vllm:prefix_cache_hits", "Prefix cache hits, in "
                                     "terms of number of cached tokens.")
        self.num_preemptions = one(Counter, "vllm:num_preemptions", "Cumulative number of "
                                   "preemption from the engine.")
        self.iteration_tokens = one(Histogram, "vllm:iteration_tokens_total", "Histogram of "
                                    "number of tokens per engine_step.", buckets=tokens)

        def phase(name: str, what: str) -> Any:
            return one(Histogram, f"vllm:request_{name}_time_seconds", f"Histogram of time spent "
                       f"{what} phase for request.", buckets=_LATENCY_BUCKETS)

        self.queue_time = phase("queue", "in WAITING")
        self.inference_time = phase("inference", "in RUNNING")
        self.prefill_time = phase("prefill", "in PREFILL")
        self.decode_time = phase("decode", "in DECODE")
        self.cache_config = Gauge("vllm:cache_config_info", "Information of the LLMEngine "
                                  "CacheConfig", ["block_size", "num_gpu_blocks"], registry=r)
