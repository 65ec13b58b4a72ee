"""Two-batch overlap: one eager forward of a decoder (``LlamaForCausalLM`` and its subclasses) as
two micro-batches (``samebits.engine.micro_batch``) interleaved layer by layer, each issued on a
CUDA stream of its own, so that under tensor parallel each one's gathers (o_proj's and
down_proj's ``TPGroup.all_gather``, and the embedding's) run while the other one computes.

Per layer i the parts of ``DecoderLayer.forward`` are issued in this order (A the first
micro-batch, B the second):

    A.qkv(i)  [A's K/V of layer i stored: event]  A.attention(i) -> gather
    B waits for the event;  B.qkv(i)  B.attention(i) -> gather
    A.mlp(i) -> gather      B.mlp(i) -> gather

so A's o_proj gather runs beside B's q/k/v and attention, B's beside A's MLP, A's down_proj
gather beside B's MLP and B's beside A's next layer. B's attention may read A's keys and values
(a sequence cut in two: B holds its later tokens), hence the event after A's K/V store; nothing
of A reads B's. NCCL issues on the caller's current stream (ProcessGroupNCCL makes its own
stream wait for it, then the caller's for the collective), so a gather issued inside
``torch.cuda.stream(s)`` holds back only ``s``. Every rank splits the same announced inputs the
same way and issues the same collectives in the same order, which NCCL runs in that order.

Streams and memory: both streams first wait for the current stream (where every input tensor
was made), and the current stream waits for both before the micro-batches' hidden states are
concatenated on it. Inputs stay referenced until then; what a stream allocates is freed back to
that stream's pool, and reused only by its later work, which (after the next fork) comes after
everything the current stream did with it. On CPU there are no streams: the same order runs
sequentially (the bits are tested there).

Bits: each micro-batch is a forward of its own (row-invariant ops, attention per sequence, a cut
sequence a chunked prefill), so the concatenation is the whole forward's, row for row.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from samebits.models.llama import Hidden, LlamaForCausalLM
from samebits.ops.backend import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass
class MicroBatch:
    """One micro-batch's device inputs: ``meta`` planned (``ops.plan_attention``)."""

    input_ids: torch.Tensor  # [T_i]
    positions: torch.Tensor  # [T_i]
    meta: AttentionMetadata


class _Lane:
    """One micro-batch's forward, its parts issued on ``stream`` (None: the current one)."""

    def __init__(self, model: LlamaForCausalLM, batch: MicroBatch,
                 stream: torch.cuda.Stream | None) -> None:
        self.model, self.ops, self.batch, self.stream = model, model.ops, batch, stream
        self.h: Hidden | None = None  # the last part's output (the embeddings before layer 0)
        self.residual: torch.Tensor | None = None  # the residual stream before ``h``
        self.q: torch.Tensor | None = None  # between ``qkv`` and ``attention``
        self.cos = self.sin = None  # RoPE of the micro-batch's positions, from ``embed``

    @contextlib.contextmanager
    def issuing(self) -> Iterator[None]:
        with torch.cuda.stream(self.stream) if self.stream is not None else \
                contextlib.nullcontext():
            yield

    def embed(self) -> None:
        with self.issuing():
            self.h = self.model.embed(self.batch.input_ids)  # [T_i, H]
            self.cos, self.sin = self.model.rope(self.batch.positions, self.h.dtype)

    def qkv(self, i: int, kv_cache: KVCache) -> torch.cuda.Event | None:
        """Layer i's norm and q/k/v, its K/V stored; returns an event recorded right after."""
        with self.issuing():
            self.q, self.residual = self.model.layers[i].forward_qkv(
                self.ops, self.h, self.residual, self.cos, self.sin, kv_cache, self.batch.meta)
            return None if self.stream is None else self.stream.record_event()

    def attention(self, i: int, kv_cache: KVCache) -> None:
        with self.issuing():
            self.h = self.model.layers[i].forward_attention(self.ops, self.q, kv_cache,
                                                            self.batch.meta)
            self.q = None

    def mlp(self, i: int) -> None:
        with self.issuing():
            self.h, self.residual = self.model.layers[i].forward_mlp(self.ops, self.h,
                                                                     self.residual)

    def final_norm(self) -> torch.Tensor:
        with self.issuing():
            return self.model.final_norm(self.h, self.residual)

    def wait(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            self.stream.wait_event(event)


def forward_two_batch(model: LlamaForCausalLM, batches: tuple[MicroBatch, MicroBatch],
                      kv_caches: list[KVCache]) -> torch.Tensor:
    """The final-norm hidden states [T, H] of the two micro-batches' tokens, in order: the bits
    of ``model`` on the whole batch."""
    device = batches[0].input_ids.device
    first, second = (_Lane(model, b, s) for b, s in zip(batches, _streams(device), strict=True))
    with _forked(first, second):
        first.embed()
        second.embed()
        for i, kv_cache in enumerate(kv_caches):
            stored = first.qkv(i, kv_cache)
            first.attention(i, kv_cache)
            second.wait(stored)
            second.qkv(i, kv_cache)
            second.attention(i, kv_cache)
            first.mlp(i)
            second.mlp(i)
        hidden = [first.final_norm(), second.final_norm()]
    return torch.cat(hidden)


@contextlib.contextmanager
def _forked(*lanes: _Lane) -> Iterator[None]:
    """The lanes' streams start after the current stream's work, which resumes after theirs."""
    if lanes[0].stream is None:
        yield
        return
    current = torch.cuda.current_stream(lanes[0].stream.device)
    for lane in lanes:
        lane.stream.wait_stream(current)
    try:
        yield
    finally:
        for lane in lanes:
            current.wait_stream(lane.stream)


def _streams(device: torch.device) -> tuple[torch.cuda.Stream | None, torch.cuda.Stream | None]:
    if device.type != "cuda":
        return None, None
    return _cuda_streams(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _cuda_streams(index: int) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """The two side streams of device ``index``, made once per process."""
    return torch.cuda.Stream(index), torch.cuda.Stream(index)
