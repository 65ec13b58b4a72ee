"""Prometheus metrics, in a registry of the app's own (two apps in one process never collide).

The HTTP side counts requests by status; the engine loop reports tokens, queue lengths, batch
sizes, KV blocks in use and latencies; the embedding engine's loop reports embedded inputs and tokens.
prometheus_client is thread-safe, so all may write.
"""

from __future__ import annotations

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


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model: str, fingerprint: str, batch_invariant: bool) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("samebits_requests", "HTTP requests to /v1/*, by status code",
                                ["status"], registry=r)
        self.finished = Counter("samebits_engine_requests_finished",
                                "Engine requests (one per choice) finished, by reason",
                                ["reason"], registry=r)
        self.prompt_tokens = Counter("samebits_prompt_tokens", "Prompt tokens admitted",
                                     registry=r)
        self.generation_tokens = Counter("samebits_generation_tokens", "Tokens generated",
                                         registry=r)
        self.running = Gauge("samebits_num_requests_running", "Engine requests running",
                             registry=r)
        self.waiting = Gauge("samebits_num_requests_waiting", "Engine requests waiting",
                             registry=r)
        self.kv_blocks = Gauge("samebits_kv_blocks_in_use", "KV cache blocks referenced by "
                               "requests (free prefix-cache blocks not counted)", registry=r)
        self.kv_blocks_total = Gauge("samebits_kv_blocks_total", "KV cache blocks", registry=r)
        self.batch_size = Histogram("samebits_batch_size", "Sequences that made progress in an "
                                    "engine step", buckets=_BATCH_BUCKETS, registry=r)
        self.canary_checks = Counter("samebits_canary_checks", "Finished requests replayed "
                                     "alone by the determinism canary", registry=r)
        self.canary_mismatches = Counter("samebits_canary_mismatches", "Canary replays whose "
                                         "output hash differed from what was served", registry=r)
        self.canary_dropped = Counter("samebits_canary_dropped", "Sampled requests not replayed "
                                      "(the canary's queue was full)", registry=r)
        self.ttft = Histogram("samebits_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("samebits_inter_token_latency_seconds", "Time between two tokens "
                             "of one request", buckets=_LATENCY_BUCKETS, registry=r)
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

    def render(self) -> bytes:
        return generate_latest(self.registry)
