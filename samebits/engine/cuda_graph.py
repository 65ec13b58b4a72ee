"""CUDA graphs for decode steps: capture the model's forward once per (batch bucket, length
bucket), all of them when the engine starts, then replay with the step's inputs copied into the
graph's own tensors.

An eager decode step launches ~15 kernels per layer, and Triton's launcher costs tens of
microseconds of host time per launch, so an eager step is bound by the CPU, not the GPU. A replay
costs a graph launch per few layers (``_Captured``), about a microsecond of host time per kernel.

Buckets. A batch of B decode tokens runs in the graph captured for the smallest bucket >= B (1, 2,
4, 8, then multiples of 8); rows B.. are padding: token 0 at position 0, its KV written to a
scratch block no sequence owns, never sampled. The longest context of the batch picks a length
bucket (a power of two of attention splits), which fixes the attention grid and the block-table
width. Neither changes a real row's bits in the invariant backend: its kernels' outputs do not
depend on the number of rows or on the other rows (ops/backend.py), which tests/gpu checks
against the eager engine bit for bit.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from tqdm import tqdm

from samebits.ops.backend import AttentionMetadata
from samebits.ops.pending_rank_sum import resolved

log = logging.getLogger("samebits.engine")


def rounded_up(n: int, smallest: int, step: int) -> int:
    """``n`` rounded up to a captured size: a power of two (at least ``smallest``) up to
    ``step``, then a multiple of ``step``."""
    if n <= step:
        return max(smallest, 1 << (n - 1).bit_length())
    return -(-n // step) * step


def batch_bucket(n: int) -> int:
    """The captured batch size that serves ``n`` decode tokens: 1, 2, 4, 8, 16, 24, 32, ..."""
    return rounded_up(n, 1, 8)


def batch_buckets(max_batch: int) -> list[int]:
    """Every batch bucket a step of up to ``max_batch`` sequences can use, ascending."""
    return sorted({batch_bucket(n) for n in range(1, max_batch + 1)})


def len_bucket(max_len: int, split_size: int) -> int:
    """Keys the graph is captured for: a power-of-two number of splits covering ``max_len``."""
    splits = -(-max_len // split_size)
    return (1 << (splits - 1).bit_length()) * split_size


@dataclass
class DecodeBatch:
    """One decode step's inputs as plain Python (the runner's bookkeeping), one entry a sequence."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    block_tables: list[list[int]]


class HostInputs:
    """The host side of a graph's int inputs, one int64 array: input ids, positions, slots and
    seq_lens (``size`` each), then the block tables row by row, ``width`` entries each. Padding
    rows hold token 0 at position 0, written to the scratch block's first slot.

    Block-table rows are rewritten only when their list changed. A sequence's table list only
    grows while its blocks are held (the KV manager gives it a new list when it frees them), and
    each row keeps a reference to the list it copied, so the same list at the same length means
    the same blocks. (Rewriting 64 rows of long contexts from Python lists every step cost the
    device ~1 ms of idle time per step.)"""

    def __init__(self, size: int, width: int, scratch_block: int, block_size: int) -> None:
        self.size, self.width, self.scratch_block = size, width, scratch_block
        self.array = np.empty(size * (4 + width), dtype=np.int64)
        self.head = self.array[:4 * size].reshape(4, size)
        self.tables = self.array[4 * size:].reshape(size, width)
        self.tables.fill(scratch_block)
        self.pad = np.array([0, 0, scratch_block * block_size, 1], dtype=np.int64)[:, None]
        self.head[:] = self.pad
        self.copied: list[tuple[list[int] | None, int]] = [(None, 0)] * size

    def fill(self, batch: DecodeBatch) -> np.ndarray:
        n = len(batch.input_ids)
        self.head[:, n:] = self.pad
        self.head[0, :n] = batch.input_ids
        self.head[1, :n] = batch.positions
        self.head[2, :n] = batch.slots
        self.head[3, :n] = self.head[1, :n] + 1
        for i in range(self.size):
            table = batch.block_tables[i] if i < n else None
            old, copied = self.copied[i]
            if old is not table or copied != self._used(table):
                self._copy_row(i, table)
        return self.array

    def _used(self, table: list[int] | None) -> int:
        """The entries of ``table`` a row takes: a graph of this width reads only the blocks of
        positions below its length bucket, and a table may hold one more (the scheduler's
        lookahead block, for the step launched after this one)."""
        return min(len(table or ()), self.width)

    def _copy_row(self, i: int, table: list[int] | None) -> None:
        old, copied = self.copied[i]
        row, used = self.tables[i], self._used(table)
        if table is None:
            row.fill(self.scratch_block)
        elif old is table:  # the same list, grown: only the new entries
            row[copied:used] = table[copied:used]
        else:
            row[:used] = table[:used]
            row[used:] = self.scratch_block
        self.copied[i] = (table, used)


LAYERS_PER_GRAPH = 9  # the largest piece of a decode step's chain of graphs (see _Captured)


def layer_pieces(num_layers: int) -> list[range]:
    """Consecutive layer ranges covering the model: 1, 2, 4, 8 layers, then LAYERS_PER_GRAPH
    each (the last may be shorter)."""
    pieces, start, size = [], 0, 1
    while start < max(num_layers, 1):
        pieces.append(range(start, min(start + size, num_layers)))
        start += size
        size = min(2 * size, LAYERS_PER_GRAPH)
    return pieces


class Staging:
    """The graphs' int inputs on their way to the device, one set for all graphs (they run one
    at a time, in stream order): page-locked ``host`` memory, the ``device`` buffer it is copied
    to, and the event after the last copy (the host waits for it before writing ``host`` again)."""

    def __init__(self, numel: int, device: torch.device) -> None:
        self.host = torch.empty(numel, dtype=torch.int64, pin_memory=True)
        self.host_array = self.host.numpy()
        self.device = torch.empty(numel, dtype=torch.int64, device=device)
        self.copied = torch.cuda.Event()

    def send(self, values: np.ndarray) -> None:
        """``device[:len(values)] = values``, queued on the current stream."""
        self.copied.synchronize()
        n = len(values)
        self.host_array[:n] = values
        self.device[:n].copy_(self.host[:n], non_blocking=True)
        self.copied.record()


class _Captured:
    """One decode step's graphs and the tensors they read and write.

    The step is captured as a chain of graphs (``layer_pieces``), handing (h, residual) over
    through ``carry`` buffers: launching a graph costs the host about a microsecond per kernel,
    and the device idles until the launch returns; with pieces, only the first (one layer)
    piece's launch is waited for and the others are launched while the device runs. The
    hand-over copies are exact (a pending tensor-parallel rank sum is resolved into the carry with
    ``sum_tree``'s bits), so the pieces compute the one-graph forward bit for bit. A model
    without ``run_layers`` is captured as one graph.

    A step's int inputs (``HostInputs``) go to the device in one copy (``Staging``), and the
    first graph begins by copying them into the inputs the kernels read."""

    def __init__(self, model, kv_caches: list, size: int, max_len: int, block_size: int,
                 split_size: int, scratch_block: int, pool,
                 carry: tuple[torch.Tensor, torch.Tensor] | None, staging: Staging) -> None:
        dev = kv_caches[0][0].device
        width = -(-max_len // block_size)
        self.size, self.max_len, self.width = size, max_len, width
        self.host = HostInputs(size, width, scratch_block, block_size)
        self.staging, self.staged = staging, staging.device[:size * (4 + width)]
        ints = dict(dtype=torch.int64, device=dev)
        self.input_ids = torch.zeros(size, **ints)
        self.positions = torch.zeros(size, **ints)
        self.slots = torch.full((size,), scratch_block * block_size, **ints)
        self.dec_pos = torch.zeros(size, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((size, width), scratch_block, dtype=torch.int32, device=dev)
        meta = AttentionMetadata(
            block_tables=self.block_tables, seq_lens=self.seq_lens,
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=dev),
            slot_mapping=self.slots, seq_lens_list=(max_len,) * size,
            query_start_loc_list=tuple(range(size + 1)), block_size=block_size,
            split_size=split_size)
        # kept alive with the graph: it reads the plan's index tensors on every replay
        self.meta = model.ops.plan_decode(meta, self.dec_pos, max_len)
        with model.ops.as_captured():  # compiles what the capture launches; writes scratch
            for piece in self._pieces(model, kv_caches, carry, unstage=False):
                piece()
        torch.cuda.synchronize(dev)
        self.graphs = self._capture(model.ops, pool,
                                    self._pieces(model, kv_caches, carry, unstage=True))
        self.staging.send(self.host.array)  # padding rows
        self.launch()  # the first replay uploads the graphs: not in a request's time

    @staticmethod
    def _capture(ops, pool, pieces: list[Callable[[], None]]) -> list[torch.cuda.CUDAGraph]:
        graphs = []
        for piece in pieces:
            graphs.append(torch.cuda.CUDAGraph())
            with _capture_into(graphs[-1], pool, ops):
                piece()
        return graphs

    def _pieces(self, model, kv_caches: list, carry: tuple[torch.Tensor, torch.Tensor] | None,
                unstage: bool) -> list[Callable[[], None]]:
        """The step as its chain of pieces, one per graph (the whole forward without a
        ``carry``), run eagerly by the warm-up (so it compiles the hand-overs' kernels too) and
        then captured; ``unstage``: the first piece begins by copying the staged inputs in."""
        if carry is None:
            def whole() -> None:
                if unstage:
                    self._unstage()
                self.hidden = model(self.input_ids, self.positions, kv_caches, self.meta)
            return [whole]
        pieces = layer_pieces(len(model.layers))
        carry_h, carry_r = carry[0][:self.size], carry[1][:self.size]

        def piece(j: int, layers: range) -> None:
            if j == 0:
                if unstage:
                    self._unstage()
                h, r = model.embed(self.input_ids), None
            else:
                h, r = carry_h, carry_r
            h, r = model.run_layers(h, r, self.positions, kv_caches, self.meta, layers)
            if j == len(pieces) - 1:
                self.hidden = model.final_norm(h, r)  # [size, H]
            else:
                carry_h.copy_(resolved(model.ops, h))
                carry_r.copy_(r)
        return [partial(piece, j, layers) for j, layers in enumerate(pieces)]

    def launch(self) -> None:
        """Replay the step's graphs, in order, on the current stream."""
        for graph in self.graphs:
            graph.replay()

    def _unstage(self) -> None:
        """Captured first: the staged int inputs into the tensors the kernels read."""
        s, st = self.size, self.staged
        self.input_ids.copy_(st[:s])
        self.positions.copy_(st[s:2 * s])
        self.dec_pos.copy_(st[s:2 * s])
        self.slots.copy_(st[2 * s:3 * s])
        self.seq_lens.copy_(st[3 * s:4 * s])
        self.block_tables.copy_(st[4 * s:].view(s, self.width))

    def replay(self, batch: DecodeBatch, device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The graphs on ``batch``; with ``device_ids`` [B] the input ids are read from that
        device tensor (negative entries become 0) instead of ``batch.input_ids``."""
        self.staging.send(self.host.fill(batch))
        if device_ids is not None:
            n = device_ids.shape[0]
            self.staged[:n].copy_(device_ids.clamp(min=0))
        self.launch()
        return self.hidden


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The garbage collector paused (around a capture): a collection mid-capture runs
    finalizers whose CUDA calls (freeing events, pinned buffers) can invalidate the capture."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def _capture_into(graph: torch.cuda.CUDAGraph, pool, ops) -> Iterator[None]:
    """``torch.cuda.graph`` under ``ops.as_captured()`` (the variants the warm-up compiled),
    with the garbage collector paused."""
    with gc_paused(), torch.cuda.graph(graph, pool=pool), ops.as_captured():
        yield


class DecodeGraphs:
    """Captures, at construction, a graph for every (batch bucket, length bucket) a decode step can
    need -- contexts up to ``max_len`` tokens -- so no request ever waits for a capture."""

    def __init__(self, model, kv_caches: list, max_batch: int, max_len: int, block_size: int,
                 split_size: int, scratch_block: int) -> None:
        """``model.ops`` must be a ``GraphableBackend`` (ops/backend.py)."""
        self.model, self.kv_caches, self.max_batch = model, kv_caches, max_batch
        self.block_size, self.split_size, self.scratch_block = block_size, split_size, scratch_block
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.carry = None  # h, residual handed from one piece to the next
        if hasattr(model, "run_layers"):
            p, rows = model.embed_tokens.weight, batch_bucket(max_batch)
            self.carry = (p.new_empty(rows, p.shape[1]), p.new_empty(rows, p.shape[1]))
        sizes, lens = self.buckets(max_batch, max_len, split_size)
        self.staging = Staging(max(sizes) * (4 + -(-max(lens) // block_size)),
                               kv_caches[0][0].device)
        self.capture_seconds = self._capture(max_len)

    @staticmethod
    def buckets(max_batch: int, max_len: int, split_size: int) -> tuple[list[int], list[int]]:
        """(batch buckets, length buckets), largest first: the graphs a decode step can need."""
        sizes = batch_buckets(max_batch)[::-1]
        lens, top = [], len_bucket(max_len, split_size)
        while top >= split_size:
            lens.append(top)
            top //= 2
        return sizes, lens

    @classmethod
    def count(cls, max_batch: int, max_len: int, split_size: int) -> int:
        sizes, lens = cls.buckets(max_batch, max_len, split_size)
        return len(sizes) * len(lens)

    def _capture(self, max_len: int) -> float:
        sizes, lens = self.buckets(self.max_batch, max_len, self.split_size)
        start = time.perf_counter()
        before = torch.cuda.memory_allocated()
        keys = [(size, n) for n in lens for size in sizes]  # largest first: the pool is sized once
        for size, n in tqdm(keys, desc="capturing CUDA graphs", unit="graph", leave=False):
            self.graphs[(size, n)] = _Captured(self.model, self.kv_caches, size, n, self.block_size,
                                               self.split_size, self.scratch_block, self.pool,
                                               self.carry, self.staging)
        seconds = time.perf_counter() - start
        self.memory_bytes = torch.cuda.memory_allocated() - before
        log.info("captured %d decode CUDA graphs (batch buckets %s, contexts up to %d) in %.1f s, "
                 "%.0f MiB", len(keys), sizes[::-1], lens[0], seconds, self.memory_bytes / 2**20)
        return seconds

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_batch

    def covers(self, batch: DecodeBatch) -> bool:
        return self._key(batch) in self.graphs

    def run(self, batch: DecodeBatch, device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [B, H] of the batch's decode tokens, via the graph of its buckets
        (``device_ids``: ``_Captured.replay``)."""
        return self.graphs[self._key(batch)].replay(batch, device_ids)[:len(batch.positions)]

    def _key(self, batch: DecodeBatch) -> tuple[int, int]:
        n = len(batch.positions)
        return batch_bucket(n), len_bucket(max(batch.positions) + 1, self.split_size)

    def release(self) -> None:
        """Destroy every captured graph now, whoever still holds this object (a replay in flight
        completes first, on the device); none is left to run. A graph that captured a
        collective keeps its NCCL communicator from being aborted or destroyed until then."""
        for captured in self.graphs.values():
            for graph in captured.graphs:
                graph.reset()
            captured.graphs = []
        self.graphs.clear()
