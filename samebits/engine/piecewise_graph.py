"""Piecewise CUDA graphs for prefill and mixed steps: every op of the forward but attention is
captured, once per token bucket, as a chain of graphs cut at each layer's attention; a step
replays its bucket's chain and runs each layer's attention eagerly between two graphs, planned
for the step's own sequences.

Why. An eager forward launches ~11 kernels a layer at tens of microseconds of host time each
(~25 ms a 2048-token step of an 8B model). Under tensor parallel a rank's GPU work per step
halves and the host's does not, so the device idles between launches. A replay costs a graph
launch a layer, plus the attention's own few launches.

Bits. A forward of T tokens runs in the chain of the smallest bucket >= T (``token_bucket``);
rows T.. are padding: token 0 at position 0, its K/V written to the scratch block's first slot,
never attended to or sampled. The captured kernels are the eager forward's at the bucket's row
count, and in the invariant backend a row's bits do not depend on the number of rows or on the
other rows (ops/backend.py); each real row's attention is the eager forward's launch on the same
plan. So a step's hidden states are the eager forward's bit for bit (tests/gpu checks it).

Buffers. Every layer's attention prologue writes q into one buffer (``qkv_rope_store(out=)``)
and every attention its output into another (``attention(out=)``), both shared by the layers and
the buckets: layer i's attention reads q before layer i+1's graph overwrites it, and layer i+1's
graph reads the output before attention i+1 overwrites it (stream order). The chains' graphs
share one memory pool, captured largest first on one stream, so the chains share their
temporaries and the pool is about the largest bucket's forward peak plus each chain's hidden output
[bucket, H], which the chain keeps (``run`` returns a view of it: valid until the chain's next
replay).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch
from tqdm import tqdm

from samebits.engine.cuda_graph import Staging, gc_paused, rounded_up
from samebits.ops.backend import AttentionMetadata, NothingDeferred

log = logging.getLogger("samebits.engine")

SMALLEST_BUCKET = 16
POWER_OF_TWO_UP_TO = 512  # buckets above are multiples of it


def piecewise_tokens(config, model) -> int:
    """The most tokens of a step the piecewise graphs serve (``EngineConfig``): its
    ``max_piecewise_tokens`` capped at ``max_num_batched_tokens``; 0 (none) under
    ``enforce_eager`` or for a model without ``run_layers`` (the decoders whose layers this
    module cuts)."""
    if config.enforce_eager or not hasattr(model, "run_layers"):
        return 0
    return min(config.max_piecewise_tokens, config.max_num_batched_tokens)


def token_bucket(n: int) -> int:
    """The captured token count that serves a forward of ``n`` tokens: 16, 32, ..., 512, then
    multiples of 512."""
    return rounded_up(n, SMALLEST_BUCKET, POWER_OF_TWO_UP_TO)


def token_buckets(max_tokens: int) -> list[int]:
    """Every bucket a forward of 1..``max_tokens`` tokens can use, ascending: ``token_bucket``'s,
    the largest capped at ``max_tokens``."""
    buckets = [token_bucket(1)]
    while buckets[-1] < max_tokens:
        buckets.append(token_bucket(buckets[-1] + 1))
    return buckets[:-1] + [min(buckets[-1], max_tokens)]


class _Splitter(NothingDeferred):
    """Stands in for ``model.ops`` while a bucket's forward is warmed up or captured: every op
    is the backend's, but the attention prologue writes q into the shared buffer, and the
    attention is not run -- it records its layer's operands, calls ``cut`` (the capture ends its
    graph there and begins the next) and returns the shared output buffer."""

    def __init__(self, ops, q: torch.Tensor, o: torch.Tensor, cut: Callable[[], None]) -> None:
        self._ops, self._q, self._o, self._cut = ops, q, o, cut
        self.calls: list[tuple[torch.Tensor, torch.Tensor, float]] = []

    def __getattr__(self, name: str):
        return getattr(self._ops, name)

    def qkv_rope_store(self, qkv: torch.Tensor, *args) -> torch.Tensor:
        return self._ops.qkv_rope_store(qkv, *args, out=self._q[:qkv.shape[0]])

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if q.data_ptr() != self._q.data_ptr() or not q.is_contiguous():
            raise RuntimeError("piecewise CUDA graphs: the attention does not read the q its "
                               "qkv_rope_store wrote")
        self.calls.append((k_cache, v_cache, scale))
        self._cut()
        return self._o[:q.shape[0]]


@contextlib.contextmanager
def split_ops(model, q: torch.Tensor, o: torch.Tensor, cut: Callable[[], None]
              ) -> Iterator[_Splitter]:
    """``model.ops`` replaced by a ``_Splitter`` over the buffers ``q`` and ``o`` while inside
    (a capture, or the CPU stand-in's forward in replay order)."""
    ops = model.ops
    model.ops = splitter = _Splitter(ops, q, o, cut)
    try:
        yield splitter
    finally:
        model.ops = ops


def bucket_of(num_tokens: int, buckets: list[int]) -> int:
    """The bucket a forward of ``num_tokens`` tokens runs in: ``token_bucket``'s, capped at the
    largest of ``buckets`` (``token_buckets``)."""
    return min(token_bucket(num_tokens), buckets[-1])


def fill_inputs(host: np.ndarray, input_ids: list[int], positions: list[int], slots: list[int],
                pad: np.ndarray) -> None:
    """``host`` [3, rows]: the forward's input ids, positions and KV slots, then padding rows
    (``pad`` [3, 1]: token 0 at position 0, written to the scratch block's first slot)."""
    t = len(input_ids)
    host[:, :t] = (input_ids, positions, slots)
    host[:, t:] = pad


class _Chain:
    """One bucket's forward: graph 0, attention 0, graph 1, ..., attention L-1, graph L; the
    placeholder metadata the capture was given is kept alive with the graphs."""

    def __init__(self, graphs: list[torch.cuda.CUDAGraph],
                 calls: list[tuple[torch.Tensor, torch.Tensor, float]], hidden: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        self.graphs, self.calls, self.hidden, self.meta = graphs, calls, hidden, meta


class PiecewiseGraphs:
    """Captures, at construction, the chain of every token bucket up to ``max_tokens`` (so no
    request waits for a capture); ``run`` replays a forward of up to ``max_tokens`` tokens. Its
    result is a view of the chain's output, valid until that chain's next replay: a caller that
    keeps it copies it."""

    def __init__(self, model, kv_caches: list, max_tokens: int, block_size: int,
                 split_size: int, scratch_block: int) -> None:
        """``model.ops`` must be a ``GraphableBackend`` (ops/backend.py) and the model a decoder
        whose layers call ``qkv_rope_store`` then ``attention`` on its q (``run_layers``)."""
        self.model, self.kv_caches, self.max_tokens = model, kv_caches, max_tokens
        self.block_size, self.split_size = block_size, split_size
        self.buckets = token_buckets(max_tokens)
        dev, size = kv_caches[0][0].device, self.buckets[-1]
        attn, dtype = model.layers[0].self_attn, next(model.parameters()).dtype
        self.q = torch.zeros(size, attn.hq, attn.d, dtype=dtype, device=dev)
        self.o = torch.zeros_like(self.q)
        self.staging = Staging(3 * size, dev)
        self.host = np.empty((3, size), dtype=np.int64)
        self.pad = np.array([0, 0, scratch_block * block_size], dtype=np.int64)[:, None]
        fill_inputs(self.host, [], [], [], self.pad)
        ints = self.staging.device.view(3, size)
        self.input_ids, self.positions, self.slots = ints[0], ints[1], ints[2]
        self.staging.send(self.host.reshape(-1))
        # one pool and one capture stream for every chain: the caching allocator reuses a freed
        # block only on the stream it was allocated on, so the chains share their temporaries
        self.pool, self.stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(dev)
        self.chains: dict[int, _Chain] = {}
        self.steps = 0  # forwards replayed, since start
        self._capture_all()

    def _capture_all(self) -> None:
        start, before = time.perf_counter(), torch.cuda.memory_reserved()
        for t in tqdm(self.buckets[::-1], desc="capturing piecewise CUDA graphs", unit="bucket",
                      leave=False):  # largest first: the pool grows once
            self.chains[t] = self._capture(t)
            for graph in self.chains[t].graphs:  # the first replay uploads the graphs
                graph.replay()
        torch.cuda.synchronize(self.q.device)
        log.info("captured piecewise CUDA graphs for steps of up to %d tokens (buckets %s) in "
                 "%.1f s, %.0f MiB", self.max_tokens, self.buckets, time.perf_counter() - start,
                 (torch.cuda.memory_reserved() - before) / 2**20)

    def _capture(self, t: int) -> _Chain:
        """Bucket ``t``'s chain: the forward run once eagerly (compiling every kernel the capture
        launches), then captured, cut at each attention."""
        ops, dev = self.model.ops, self.q.device
        meta = self._placeholder_meta(t)  # built before the capture: a host-to-device copy
        with ops.as_captured(), split_ops(self.model, self.q, self.o, lambda: None):
            self._forward(t, meta)
        torch.cuda.synchronize(dev)
        graphs = [torch.cuda.CUDAGraph()]

        def cut() -> None:
            graphs[-1].capture_end()
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=self.pool)

        self.stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(self.stream), gc_paused(), ops.as_captured(), \
                split_ops(self.model, self.q, self.o, cut) as splitter:
            graphs[0].capture_begin(pool=self.pool)
            try:
                hidden = self._forward(t, meta)
            except BaseException:
                with contextlib.suppress(RuntimeError):  # the capture's own error is the news
                    graphs[-1].capture_end()
                raise
            graphs[-1].capture_end()
        torch.cuda.current_stream(dev).wait_stream(self.stream)
        if len(splitter.calls) != len(self.model.layers):
            raise RuntimeError(f"piecewise CUDA graphs: {len(splitter.calls)} attention calls in "
                               f"a forward of {len(self.model.layers)} layers")
        return _Chain(graphs, splitter.calls, hidden, meta)

    def _placeholder_meta(self, t: int) -> AttentionMetadata:
        """Attention metadata for a capture of ``t`` rows: the graphs' slots; the rest is never
        read (the splitter runs no attention)."""
        dev = self.q.device
        return AttentionMetadata(
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=dev),
            seq_lens=torch.full((1,), t, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=dev),
            slot_mapping=self.slots[:t], seq_lens_list=(t,), query_start_loc_list=(0, t),
            block_size=self.block_size, split_size=self.split_size)

    def _forward(self, t: int, meta: AttentionMetadata) -> torch.Tensor:
        """The model's forward over the first ``t`` rows of the graphs' inputs."""
        return self.model(self.input_ids[:t], self.positions[:t], self.kv_caches, meta)

    def covers(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_tokens

    def run(self, input_ids: list[int], positions: list[int], slots: list[int],
            meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, H] of a forward of these tokens (a view of the chain's output): the
        chain of their bucket, with each layer's attention run on ``meta`` (planned:
        ``ops.plan_attention``) between its graphs."""
        t = len(input_ids)
        chain = self.chains[bucket_of(t, self.buckets)]
        fill_inputs(self.host, input_ids, positions, slots, self.pad)
        self.staging.send(self.host.reshape(-1))
        ops, q, o = self.model.ops, self.q[:t], self.o[:t]
        for graph, (k_cache, v_cache, scale) in zip(chain.graphs[:-1], chain.calls, strict=True):
            graph.replay()
            ops.attention(q, k_cache, v_cache, meta, scale, out=o)
        chain.graphs[-1].replay()
        self.steps += 1
        return chain.hidden[:t]

    def release(self) -> None:
        """Destroy every captured graph now, whoever still holds this object (a replay in flight
        completes first); none is left to run."""
        for chain in self.chains.values():
            for graph in chain.graphs:
                graph.reset()
            chain.graphs = []
        self.chains.clear()

