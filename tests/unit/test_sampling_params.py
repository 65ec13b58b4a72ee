"""SamplingParams: every invalid field is refused at construction with a ValueError naming it."""

from __future__ import annotations

import pytest

from samebits import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from samebits.engine.fanout import choice_seed
from samebits.sampling_params import GREEDY_BELOW

INVALID = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 2.0),
    ("max_tokens", True),
    ("temperature", -0.1),
    ("temperature", -1e-30),
    ("temperature", float("nan")),
    ("temperature", "0.7"),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.0000001),
    ("top_p", 2),
    ("top_p", float("nan")),
    ("top_k", -2),
    ("top_k", -100),
    ("top_k", 3.5),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("min_p", float("nan")),
    ("seed", -1),
    ("seed", 1.5),
    ("seed", "7"),
    ("logprobs", 21),
    ("logprobs", 1000),
    ("logprobs", -1),
    ("n", 0),
    ("seed", 2**63),
    ("best_of", 0),
    ("best_of", 1.5),
    ("logit_bias", {"5": 1.0}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {5: 100.5}),
    ("logit_bias", {5: float("nan")}),
    ("logit_bias", [5, 1.0]),
    ("presence_penalty", 2.01),
    ("presence_penalty", -2.5),
    ("frequency_penalty", float("nan")),
    ("frequency_penalty", 3),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")),
    ("min_tokens", -1),
    ("min_tokens", 17),  # > max_tokens (16)
    ("min_tokens", 1.0),
    ("stop_token_ids", [-1]),
    ("ignore_eos", 1),
    ("include_stop_str_in_output", 1),
    ("skip_special_tokens", None),
    ("spaces_between_special_tokens", "yes"),
    ("detokenize", 0),
    ("truncate_prompt_tokens", 0),
    ("truncate_prompt_tokens", -2),
    ("truncate_prompt_tokens", 2.0),
    ("guided_decoding", {"json": {}}),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_field_raises_value_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


VALID = [
    {},
    {"max_tokens": 1},
    {"temperature": 0.0},
    {"temperature": 2.5},
    {"top_p": 1.0},
    {"top_p": 1e-6},
    {"top_k": -1},
    {"top_k": 0},
    {"top_k": 50},
    {"min_p": 0.0},
    {"min_p": 1.0},
    {"seed": 0},
    {"seed": 2**63 - 1},
    {"logprobs": 0},
    {"logprobs": 20},
    {"seed": 2**63 - 1, "n": 3},
    {"n": 2, "best_of": 2},
    {"n": 2, "best_of": 5},
    {"logit_bias": {0: -100.0, 7: 100, 9: 0.5}},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"repetition_penalty": 1e-3},
    {"min_tokens": 16},
    {"max_tokens": None},
    {"max_tokens": None, "min_tokens": 10**6},
    {"include_stop_str_in_output": True, "skip_special_tokens": False,
     "spaces_between_special_tokens": False},
    {"detokenize": False},
    {"truncate_prompt_tokens": -1},
    {"truncate_prompt_tokens": 1},
]


@pytest.mark.parametrize("kwargs", VALID, ids=[repr(k) for k in VALID])
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    params = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(params, key) == value


def test_greedy_means_temperature_below_greedy_below() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy and SamplingParams(temperature=1e-45).greedy
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy


def test_stop_strings_normalises_str_list_and_none() -> None:
    assert SamplingParams(stop=None).stop_strings == []
    assert SamplingParams(stop="x").stop_strings == ["x"]
    assert SamplingParams(stop=["a", "b"]).stop_strings == ["a", "b"]


def test_non_integer_logprobs_raises_value_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=2.5)


def test_string_logprobs_raises_value_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs="3")


@pytest.mark.parametrize(("field", "value"), [("stop", 5), ("stop", [1, 2]),
                                              ("stop_token_ids", 5)])
def test_malformed_stop_fields_raise_value_error_naming_the_field(field: str,
                                                                  value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field", ["seed", "top_k", "logprobs", "n"])
def test_bool_is_not_accepted_as_an_integer_field(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: True})


@pytest.mark.smoke
def test_best_of_below_n_names_best_of() -> None:
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)


def test_choice_seeds_are_seed_plus_i_wrapped_into_63_bits() -> None:
    assert [choice_seed(10, i) for i in range(3)] == [10, 11, 12]
    assert [choice_seed(2**63 - 2, i) for i in range(3)] == [2**63 - 2, 2**63 - 1, 0]
    assert choice_seed(choice_seed(2**63 - 1, 1), -1) == 2**63 - 1


def test_has_penalties_only_when_a_penalty_is_not_neutral() -> None:
    assert not SamplingParams(presence_penalty=0, frequency_penalty=0.0,
                              repetition_penalty=1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties
    assert SamplingParams(repetition_penalty=1.01).has_penalties


def test_guided_decoding_is_structured_outputs_under_vllms_older_name() -> None:
    spec = GuidedDecodingParams(regex="[ab]+")
    assert GuidedDecodingParams is StructuredOutputsParams
    for params in (SamplingParams(guided_decoding=spec), SamplingParams(structured_outputs=spec)):
        assert params.structured_outputs is params.guided_decoding is spec
    assert SamplingParams(guided_decoding=spec, structured_outputs=spec).structured_outputs is spec
    with pytest.raises(ValueError, match="guided_decoding"):
        SamplingParams(guided_decoding=spec, structured_outputs=StructuredOutputsParams(regex="a"))


def test_clone_is_an_equal_independent_copy() -> None:
    params = SamplingParams(stop=["x"], logit_bias={3: 1.0}, seed=4)
    copy = params.clone()
    assert copy == params and copy.logit_bias is not params.logit_bias


def test_stop_strings_need_the_text() -> None:
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["x"])
