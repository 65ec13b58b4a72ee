"""SamplingParams: what a request asks for, checked at construction (errors name the field).

The sampling controls (``logit_bias``, the three penalties, ``min_tokens``) change which token is
*chosen*, never the reported logprobs: those stay the log_softmax of the model's raw fp32 logits
(see ``samebits.engine.logits_processor``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from samebits.structured_outputs import StructuredOutputsParams

SEED_MODULUS = 2**63  # seeds live in [0, 2**63 - 1]
GREEDY_BELOW = 1e-5  # a temperature below this is greedy (vLLM's _SAMPLING_EPS)
MAX_STOP_STRINGS = 64  # per-token work bounds: stop strings, their length, logit_bias entries,
MAX_STOP_STRING_CHARS = 1024  # stop token ids (docs/LIMITS.md)
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 1024


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW): greedy (ties: the lowest token id)
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None  # None: one is drawn; choice i uses choice_seed(seed, i)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # also return this many top logprobs per generated token
    # logprob (and rank) of every prompt token given the ones before it, plus this many top
    # logprobs per prompt position; bitwise ``LLM.score``'s values. Bypasses the prefix cache.
    prompt_logprobs: int | None = None
    n: int = 1  # outputs per prompt
    best_of: int | None = None  # candidates per prompt (>= n); the n most likely are returned
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    presence_penalty: float = 0.0  # [-2, 2], OpenAI: minus this once per token already generated
    frequency_penalty: float = 0.0  # [-2, 2], OpenAI: minus this times the generated count
    repetition_penalty: float = 1.0  # > 0, HF/vLLM: on prompt + generated tokens
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings cannot end it before this many
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output (grammar.py)

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
        if self.seed is not None and (not _is_int(self.seed)
                                      or not 0 <= self.seed < SEED_MODULUS):
            raise ValueError(f"seed must be an integer in [0, 2**63 - 1], got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer from 0 to 20, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be an integer from 0 to 20, got "
                             f"{self.prompt_logprobs!r}")
        self._check_choices()
        self._check_stops()
        self._check_controls()

    def _check_choices(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        self._check_stops()
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise ValueError(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")

    def _check_stops(self) -> None:
        stops = self.stop
        if stops is not None and not isinstance(stops, str) and not (
                isinstance(stops, list | tuple) and all(isinstance(s, str) for s in stops)):
            raise ValueError(f"stop must be a string or a list of strings, got {stops!r}")
        ids = self.stop_token_ids
        if ids is not None and not (isinstance(ids, list | tuple)
                                    and all(_is_int(t) and t >= 0 for t in ids)):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        self._check_sizes()

    def _check_sizes(self) -> None:
        """Caps on what costs host work at every token (each a 400 over HTTP)."""
        strings = self.stop_strings
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(strings)} strings; the limit is {MAX_STOP_STRINGS}")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in strings):
            raise ValueError(f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(self.stop_token_ids)} ids; the limit is "
                             f"{MAX_STOP_TOKEN_IDS}")
        if isinstance(self.logit_bias, dict) and len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; the limit is "
                             f"{MAX_LOGIT_BIAS}")

    def _check_controls(self) -> None:
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
            for token, value in bias.items():
                if not _is_int(token) or token < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), "
                                     f"got {token!r}")
                _number("logit_bias", value)
                if not -100 <= value <= 100:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _number(name, value)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _number("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be > 0 and finite, "
                             f"got {self.repetition_penalty}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], "
                             f"got {self.min_tokens!r}")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below ``GREEDY_BELOW`` (where logits / T would overflow)."""
        return self.temperature < GREEDY_BELOW

    @property
    def num_candidates(self) -> int:
        """Sequences generated per prompt: ``best_of`` when set, else ``n``."""
        return self.n if self.best_of is None else self.best_of

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @cached_property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded ``seed``: ``seed + index``, wrapped so it
    stays in [0, 2**63 - 1]."""
    return (seed + index) % SEED_MODULUS


def _number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
