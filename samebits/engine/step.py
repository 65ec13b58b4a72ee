"""A step's inputs and results as the model runner sees them: the eager forward's inputs (plain
Python, what rank 0 sends the other tensor-parallel ranks), the sampled and scored rows, the
result handed back to the engine, the decode step launched ahead (async scheduling), and the
handle rank 0 holds on the other ranks (``Peers``)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from samebits.engine.cuda_graph import DecodeBatch, DecodeGraphs
from samebits.engine.piecewise_graph import PiecewiseGraphs
from samebits.engine.request_error import RequestError
from samebits.engine.sequence import Sequence


class Peers(Protocol):
    """Rank 0's handle on ranks 1..N-1 (``samebits.engine.executor.Ranks``)."""

    def call(self, op: str, *args: Any) -> contextlib.AbstractContextManager[None]: ...

    def guard(self) -> contextlib.AbstractContextManager[None]: ...

    def check(self) -> None: ...

    def close(self) -> None: ...

    def hold_graphs(self, graphs: DecodeGraphs | PiecewiseGraphs) -> None: ...


@dataclass
class ForwardInputs:
    """One eager forward's inputs as plain Python (what rank 0 sends the other ranks)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    query_start_loc: list[int]
    block_tables: list[list[int]]


@dataclass
class StepInputs:
    forward: ForwardInputs
    sample_rows: list[int]  # flat token row of each sequence that gets a new token
    sample_seqs: list[Sequence]
    score_rows: list[int]  # flat token rows of prompt positions whose next token is scored
    score_spans: list[tuple[Sequence, int, int]]  # (seq, first position, count), score_rows order


@dataclass
class ScoredSpan:
    """Prompt logprobs of one span of positions: the next token's logprob at each, and for
    requests asking for prompt logprobs its rank and the top-k (empty lists otherwise)."""

    logprobs: list[float]
    ranks: list[int]
    top: list[dict[int, float]]


@dataclass
class StepResult:
    sampled: list[Sequence]  # the sequences that got a new token, in order
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    scored: list[ScoredSpan]  # one per score span, in StepInputs.score_spans order
    # per sampled row asking for logprobs, its token's rank in the raw distribution (else None)
    ranks: list[int | None] = field(default_factory=list)
    failed: dict[str, RequestError] = field(default_factory=dict)  # by request id: why it failed


@dataclass
class AheadStep:
    """A decode step launched before its predecessor's tokens were read (async scheduling): the
    predecessor's sequences at their next positions, input ids taken on the device from its
    sampled tokens. It stands for the next step only if that step is these sequences at these
    positions and slots and every token it read was final (``valid``); otherwise its work is
    dropped, and the KV it wrote at those slots is rewritten before anything reads it (the next
    step that computes those positions writes them again)."""

    seqs: list[Sequence]
    batch: DecodeBatch
    hidden: torch.Tensor
    valid: bool = True

    def serves(self, seqs: list[Sequence], batch: DecodeBatch) -> bool:
        return (self.valid and len(seqs) == len(self.seqs)
                and all(a is b for a, b in zip(seqs, self.seqs, strict=True))
                and batch.positions == self.batch.positions and batch.slots == self.batch.slots)
