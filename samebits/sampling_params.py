"""SamplingParams: what a request asks for, checked at construction (errors name the field)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy (ties go to the lowest token id)
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None  # None: one is drawn and reported in RequestOutput.seed
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # also return this many top logprobs per generated token
    # logprob (and rank) of every prompt token given the ones before it, plus this many top
    # logprobs per prompt position; bitwise ``LLM.score``'s values. Bypasses the prefix cache.
    prompt_logprobs: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        _number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        _number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer from 0 to 20, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be an integer from 0 to 20, got "
                             f"{self.prompt_logprobs!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        self._check_stops()

    def _check_stops(self) -> None:
        stops = self.stop
        if stops is not None and not isinstance(stops, str) and not (
                isinstance(stops, list | tuple) and all(isinstance(s, str) for s in stops)):
            raise ValueError(f"stop must be a string or a list of strings, got {stops!r}")
        ids = self.stop_token_ids
        if ids is not None and not (isinstance(ids, list | tuple) and all(_is_int(t) for t in ids)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def _number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
