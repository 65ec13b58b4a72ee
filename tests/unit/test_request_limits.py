"""Per-token work is bounded by range checks in SamplingParams: the number and length of stop
strings, the number of stop token ids and of logit_bias entries; and every number is finite
(``1e400`` parses to infinity). Each is a ValueError naming the field, at the limit accepted."""

from __future__ import annotations

import pytest

from samebits.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)

AT_LIMIT = [dict(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)]),
            dict(stop="x" * MAX_STOP_STRING_CHARS),
            dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS))),
            dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS)})]
OVER = [(dict(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), "stop has 65 strings"),
        (dict(stop="x" * (MAX_STOP_STRING_CHARS + 1)), "at most 1024 characters"),
        (dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids has 1025"),
        (dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias has 1025"),
        (dict(temperature=float("inf")), "temperature must be a finite number"),
        (dict(top_p=float("-inf")), "top_p must be a finite number"),
        (dict(presence_penalty=float("inf")), "presence_penalty must be a finite number"),
        (dict(logit_bias={1: float("inf")}), "logit_bias must be a finite number")]


@pytest.mark.parametrize("kwargs", AT_LIMIT, ids=lambda k: next(iter(k)))
def test_at_the_limit_is_accepted(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,message", OVER, ids=[m for _, m in OVER])
def test_past_a_limit_or_non_finite_is_a_value_error_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
