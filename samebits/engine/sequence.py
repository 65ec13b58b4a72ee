"""A request's state as the engine sees it (plain Python), and what it hands back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from samebits.sampling_params import SamplingParams

if TYPE_CHECKING:
    from samebits.engine.grammar import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    score_only: bool = False  # teacher-forced: logprob of every prompt token, nothing generated
    cache_salt: str | None = None  # enters the first block's hash: no sharing across salts
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)  # score_only: t_1 .. t_{n-1}
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in this sequence's blocks
    num_cached_tokens: int = 0  # of those, taken from the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks, in order
    num_committed_blocks: int = 0  # leading blocks already registered in the prefix cache
    num_preemptions: int = 0
    finish_reason: str | None = None
    text: str | None = None  # set when a stop string cut the text
    grammar: GrammarState | None = None  # structured output: this request's matcher

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass
class RequestOutput:
    """One request's result, as ``LLM.generate`` returns it (design.md section 4)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float]  # raw-distribution logprob of each generated token, exact fp32 values
    seed: int
    system_fingerprint: str
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
