"""The server's pure pieces, without a model: token bytes, request groups, errors (the streamed
text is the engine's: tests/unit/test_output_processor.py)."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError
from tokenizers import pre_tokenizers

from samebits.engine.fanout import seed_requests
from samebits.sampling_params import SamplingParams
from samebits.server.errors import APIError, from_validation_error, from_value_error
from samebits.server.protocol_chat import ChatCompletionRequest
from samebits.server.protocol_completion import CompletionRequest
from samebits.server.serving import make_group, sampling_params
from samebits.server.tokens import _UNBYTE
from samebits.server.tools import ToolPlan, ToolStream


def test_byte_level_table_inverts_gpt2_alphabet():
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    assert len(alphabet) == 256 and set(alphabet) == set(_UNBYTE)
    assert _UNBYTE["Ġ"] == 0x20 and _UNBYTE["Ċ"] == 0x0A and _UNBYTE["a"] == ord("a")


@pytest.mark.smoke
def test_seeds_are_s_plus_i_per_prompt():
    params = SamplingParams(max_tokens=2, seed=10)
    group = _group([[1], [2]], [params, params], n=3)
    assert group.seed_offsets == [0, 1, 2, 0, 1, 2]
    seed, seeded = seed_requests(group.params, group.seed_offsets, draw=lambda: 1 / 0)
    assert seed == 10 and [p.seed for p in seeded] == [10, 11, 12, 10, 11, 12]
    unseeded = _group([[1]], [SamplingParams(max_tokens=2)], n=2)
    draws = iter([2**63 - 1])
    seed, seeded = seed_requests(unseeded.params, unseeded.seed_offsets, draw=lambda: next(draws))
    assert seed == 2**63 - 1 and [p.seed for p in seeded] == [2**63 - 1, 0]  # drawn once


def _group(prompts, params, n):
    async def build():  # a RequestGroup belongs to the running event loop
        return make_group("x", prompts, params, n, stream=False)
    return asyncio.run(build())


@pytest.mark.parametrize("body,param", [
    ('{"prompt": "a", "max_tokens": "3"}', "max_tokens"),
    ('{"prompt": "a", "n": 65}', "n"),
    ('{"prompt": "a", "logit_bias": {"x": 1}}', "logit_bias"),
    ('{"prompt": "a", "suffix": "b"}', "suffix"),
    ('{"prompt": "a", "stream_options": {"include_usage": true}}', "stream_options"),
    ('{"prompt": "a"', None),
])
def test_wire_errors_name_the_field(body, param):
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate_json(body)
    err = from_validation_error(e.value)
    assert (err.status, err.param) == (400, param)


@pytest.mark.parametrize("body,param", [
    ('{"prompt": "a", "presence_penalty": 2.5}', "presence_penalty"),
    ('{"prompt": "a", "repetition_penalty": 0}', "repetition_penalty"),
    ('{"prompt": "a", "logit_bias": {"5": 101}}', "logit_bias"),
    ('{"prompt": "a", "n": 3, "best_of": 2}', "best_of"),
    ('{"prompt": "a", "min_tokens": -1}', "min_tokens"),
    ('{"prompt": "a", "seed": 9223372036854775808}', "seed"),
    ('{"prompt": "a", "allowed_token_ids": []}', "allowed_token_ids"),
    ('{"prompt": "a", "truncate_prompt_tokens": -2}', "truncate_prompt_tokens"),
])
def test_range_errors_are_sampling_params_and_name_the_field(body, param):
    """Ranges are checked once, by SamplingParams (the request parses)."""
    req = CompletionRequest.model_validate_json(body)
    with pytest.raises(ValueError) as e:
        req.to_sampling_params(16, None)
    err = from_value_error(e.value)
    assert (err.status, err.param) == (400, param)


def test_chat_content_parts_are_joined_with_newlines_as_vllm():
    req = ChatCompletionRequest.model_validate_json(
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},'
        ' {"type": "text", "text": "b"}]}]}')
    assert req.messages[0].text() == "a\nb"


@pytest.mark.parametrize("body,param,words", [
    ('{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}',
     "max_completion_tokens", "max_completion_tokens must be a positive integer"),
    ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": -2}',
     "max_tokens", "max_tokens must be a positive integer"),
    ('{"messages": [{"role": "user", "content": "x"}], "temperature": -1}',
     "temperature", "temperature must be >= 0"),
    ('{"messages": [{"role": "user", "content": "x"}], "top_p": 0}', "top_p", "top_p"),
    ('{"messages": [{"role": "user", "content": "x"}], "n": 0}', "n", "n must be"),
])
def test_chat_ranges_are_sampling_params_and_name_the_wire_field(body, param, words):
    """The request parses (no range of its own); SamplingParams' error names the field the
    request used (max_completion_tokens is SamplingParams.max_tokens)."""
    req = ChatCompletionRequest.model_validate_json(body)
    asked, field = req.requested_max_tokens()
    with pytest.raises(APIError) as e:
        sampling_params(req, asked if asked is not None else 16, None, None, field)
    assert (e.value.status, e.value.param) == (400, param) and words in e.value.message


@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_call_is_held_until_complete_and_is_content_when_cut(choice):
    """A named or required call streams as one whole call when the choice completes, or as its
    raw text when max_tokens cut it: the deltas add up to the whole parse either way."""
    plan = ToolPlan("named", "f") if choice == "named" else ToolPlan("required")
    text = '{"city": "Oslo"}' if choice == "named" else '[{"name": "f", "arguments": {"a": 1}}]'
    for cut, piece in ((True, text[:-3]), (False, text)):
        stream = ToolStream(plan)
        pushed = [stream.push(piece[i:i + 4]) for i in range(0, len(piece), 4)]
        assert all(p == (None, []) for p in pushed)  # nothing leaves before the end
        content, calls = stream.finish(cut)
        whole = ToolStream(plan).parse(piece, cut)
        if cut:
            assert (content, calls) == (piece, []) == whole
        else:
            assert content is None and len(calls) == 1 and calls[0].id is not None
            assert (calls[0].function.name, calls[0].function.arguments) == (
                whole[1][0].function.name, whole[1][0].function.arguments)


def test_engine_value_errors_become_400_naming_the_field():
    for message, param in [("max_tokens must be a positive integer, got 0", "max_tokens"),
                           ("prompt has 2000 tokens; the context limit is 1024", "prompt"),
                           ("request id 'x' is already in use", None)]:
        err = from_value_error(ValueError(message))
        assert (err.status, err.param, err.message) == (400, param, message)
