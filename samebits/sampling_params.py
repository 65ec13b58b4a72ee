"""SamplingParams: what a request asks for, checked at construction (errors name the field).

The sampling controls (``logit_bias``, the three penalties, ``min_tokens``) change which token is
*chosen*, never the reported logprobs: those stay the log_softmax of the model's raw fp32 logits
(see ``samebits.engine.logits_processor``). Fields have vLLM's names, defaults and meaning; the
ranges of every field are checked here and only here (the server maps these errors to 400s).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from functools import cached_property

from samebits.structured_outputs import StructuredOutputsParams

SEED_MODULUS = 2**63  # seeds live in [0, 2**63 - 1]; choice seeds wrap (samebits.engine.fanout)
GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name for the same constraint
GREEDY_BELOW = 1e-5  # a temperature below this is greedy (vLLM's _SAMPLING_EPS)
MAX_STOP_STRINGS = 64  # per-token work bounds: stop strings, their length, logit_bias entries,
MAX_STOP_STRING_CHARS = 1024  # stop token ids (docs/LIMITS.md)
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 1024


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the end of the context (max_model_len)
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW): greedy (ties: the lowest token id)
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None  # None: one is drawn; choice i uses seed + i (engine.fanout)
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
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older name: the same field
    # the text: a stop string (or stop token's text) stays at the end of ``text`` when True
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # special tokens are left out of ``text``
    # as in vLLM with a fast tokenizer (every samebits tokenizer is one): no effect on the text
    spaces_between_special_tokens: bool = True
    detokenize: bool = True  # False: ``text`` stays "" (no stop strings then)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: max_model_len
    # vLLM's per-request masks (samebits.engine.logits_processor): only these token ids may be
    # sampled; no output may complete one of these words (each tokenized as at the start and as
    # in the middle of a text); bad_words_token_ids: their token ids (the engine fills them in)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens <= 0):
            raise ValueError(f"max_tokens must be a positive integer or None, got "
                             f"{self.max_tokens!r}")
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
        self._check_text()
        self._check_masks()
        self._alias_guided_decoding()

    def _check_choices(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
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
        top = math.inf if self.max_tokens is None else self.max_tokens
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= top:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], "
                             f"got {self.min_tokens!r}")

    def _check_text(self) -> None:
        for name in ("include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if not self.detokenize and self.stop_strings:
            raise ValueError("stop strings need the text: detokenize=False cannot be combined "
                             "with stop")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 (the model's context) or a "
                             f"positive integer, got {k!r}")

    def _alias_guided_decoding(self) -> None:
        """``guided_decoding`` and ``structured_outputs`` name one field: either may be given
        (both only if equal), and afterwards both hold it."""
        given = [v for v in (self.structured_outputs, self.guided_decoding) if v is not None]
        if any(not isinstance(v, StructuredOutputsParams) for v in given):
            raise ValueError("structured_outputs (guided_decoding) must be a "
                             "StructuredOutputsParams")
        if len(given) == 2 and given[0] != given[1]:
            raise ValueError("structured_outputs and guided_decoding are one field (vLLM's new "
                             "and old name); give one of them")
        if given:
            object.__setattr__(self, "structured_outputs", given[0])
            object.__setattr__(self, "guided_decoding", given[0])

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's ``clone``)."""
        return copy.deepcopy(self)

    def _check_masks(self) -> None:
        allowed = self.allowed_token_ids
        if allowed is not None and not (isinstance(allowed, list | tuple) and allowed
                                        and all(_is_int(t) and t >= 0 for t in allowed)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids "
                             f"(integers >= 0), got {allowed!r}")
        words = self.bad_words
        if words is not None and not (isinstance(words, list | tuple)
                                      and all(isinstance(w, str) and w.strip() for w in words)):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {words!r}")
        ids = self.bad_words_token_ids
        if ids is not None and not all(isinstance(w, list | tuple) and w
                                       and all(_is_int(t) and t >= 0 for t in w) for w in ids):
            raise ValueError("bad_words_token_ids must be lists of token ids (integers >= 0)")

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


def _number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
