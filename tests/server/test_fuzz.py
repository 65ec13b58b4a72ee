"""Every bad input is a 4xx, never a 5xx: hypothesis sends mutated requests to the app in this
process (its engine loop live) -- raw bytes, arbitrary JSON, and valid requests with fields set to
wrong types, huge and non-finite numbers (``1e400``), unicode edge cases (lone surrogates, NUL,
RTL marks, long runs), deep nesting, reserved ``chat_template_kwargs`` keys and hostile output
constraints -- on every body endpoint (completions, chat, embeddings, /tokenize, /detokenize).
No response (nor any stream event) is a server error, and a fixed request returns the same bits
after the fuzzing as before it. The default suite runs a fixed, derandomised sample; ``-m slow``
runs a larger random one."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from samebits.llm import LLM
from samebits.server.app import build_app
from samebits.server.limits import ServerLimits
from samebits.server.output_hash import HEADER
from tests.server.inprocess import MODEL, tiny_engine

CMPL, CHAT, EMBED = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
TOKENIZE, DETOKENIZE = "/tokenize", "/detokenize"
BASE = {
    CMPL: {"model": MODEL, "prompt": "Hello there", "max_tokens": 2, "seed": 1},
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
           "seed": 1},
    EMBED: {"input": "Hello there"},
    TOKENIZE: {"prompt": "Hello there"},
    DETOKENIZE: {"tokens": [1, 2, 3]},
}
FIELDS = {
    CMPL: ["prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
           "stop_token_ids", "n", "best_of", "logit_bias", "presence_penalty", "logprobs",
           "frequency_penalty", "repetition_penalty", "min_tokens", "stream", "echo",
           "prompt_logprobs", "ignore_eos", "response_format", "structured_outputs",
           "guided_json", "guided_regex", "guided_choice", "guided_grammar", "cache_salt",
           "stream_options", "user", "metadata", "model", "unknown_field"],
    CHAT: ["messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
           "stop", "n", "logit_bias", "logprobs", "top_logprobs", "tools", "tool_choice",
           "chat_template_kwargs", "response_format", "structured_outputs", "guided_json",
           "stream", "min_tokens", "repetition_penalty", "parallel_tool_calls", "model"],
    EMBED: ["input", "model", "encoding_format", "dimensions", "user", "truncate",
            "truncate_prompt_tokens"],
    TOKENIZE: ["prompt", "messages", "add_special_tokens", "add_generation_prompt",
               "return_token_strs", "model"],
    DETOKENIZE: ["tokens", "model"],
}


class Raw:
    """JSON text put into a body as is (what json.dumps cannot write: 1e400, 500-digit
    integers, lone surrogates, 1,000-deep nesting)."""

    def __init__(self, text: str) -> None:
        self.text = text


def dumps(value: Any) -> bytes:
    raws: list[str] = []

    def swap(v: Any) -> Any:
        if isinstance(v, Raw):
            raws.append(v.text)
            return f"@@RAW{len(raws) - 1}@@"
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list):
            return [swap(x) for x in v]
        return v

    text = json.dumps(swap(value), ensure_ascii=False)
    text = re.sub(r'"@@RAW(\d+)@@"', lambda m: raws[int(m.group(1))], text)
    return text.encode("utf-8", "surrogatepass")


NUMBERS = st.sampled_from([0, -1, 1, 2, 3, 64, 65, 1024, 2**31, 2**53 + 1, 2**63 - 1, 2**63,
                           2**64, -2**63, 1e308, -1e308, 1e-45, 5e-324, -0.0, 0.5, 1e-5,
                           Raw("1e400"), Raw("-1e400"), Raw("1e-400"), Raw("1" + "0" * 500),
                           Raw("-" + "9" * 400)])
STRINGS = st.sampled_from(["", " ", "\x00", "a\x00b", "\uffff", "\u202eevil", "🙂" * 300,
                           "é" * 5000, "<|im_end|>", "<|im_start|>system", "{{ 7 * 7 }}",
                           "{% for x in range(10**9) %}", "\\", "\"", "x" * 20000,
                           Raw('"\\ud800"'), Raw('"\\udfff a"'), Raw('"\\u0000"'), "NaN",
                           "Infinity", "1e400", "null"])
DEEP = st.sampled_from([Raw("[" * 1000 + "]" * 1000), Raw('{"a":' * 1000 + "1" + "}" * 1000),
                        Raw("[" * 100 + "1" + "]" * 100),
                        Raw('{"type":"object","properties":{"a":' * 100 + '{}' + "}}" * 100)])
SCHEMAS = st.sampled_from([
    {"$ref": "#"}, {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"type": "nonsense"}, {"enum": []}, {"enum": list(range(5000))},
    {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}},
    {"type": "string", "minLength": 10, "maxLength": 1}, {"type": "integer", "minimum": 10**30},
    {"type": "string", "pattern": "[^\\s\\S]"}, {"anyOf": []}, {"allOf": [{"type": "string"},
                                                                        {"type": "integer"}]},
    {"type": "array", "items": {"type": "array", "items": {"type": "array"}}, "minItems": 10**9},
    {}, {"type": "object"}, {"not": {}}])
TEMPLATE_KWARGS = st.dictionaries(
    st.sampled_from(["template", "self", "messages", "tools", "add_generation_prompt",
                     "raise_exception", "bos_token", "eos_token", "range", "namespace",
                     "enable_thinking", "x"]),
    st.one_of(STRINGS, NUMBERS, st.none(), st.just({"a": 1}), st.just([1])), max_size=3)
LEAF = st.one_of(st.none(), st.booleans(), NUMBERS, STRINGS, st.integers(), st.floats(
    allow_nan=False, allow_infinity=False), st.text(max_size=8))
JSON = st.recursive(LEAF, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)


def _special(field: str) -> st.SearchStrategy:
    """Values aimed at one field (beside the generic ones)."""
    if field in ("structured_outputs",):
        return st.one_of(st.fixed_dictionaries({"json": SCHEMAS}),
                         st.fixed_dictionaries({"regex": st.one_of(STRINGS, st.sampled_from(
                             ["[^\\s\\S]", "((", "a{99999}", ".{0,30000}", "()", "\\b"]))}),
                         st.fixed_dictionaries({"choice": st.lists(STRINGS, max_size=3)}),
                         st.fixed_dictionaries({"grammar": STRINGS}), JSON)
    if field in ("guided_json",):
        return st.one_of(SCHEMAS, STRINGS, DEEP)
    if field == "response_format":
        return st.one_of(st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema":
                         st.fixed_dictionaries({"name": st.just("x"), "schema": SCHEMAS})}),
                         st.fixed_dictionaries({"type": st.sampled_from(["json_object", "text",
                                                                         "yaml"])}), JSON)
    if field == "chat_template_kwargs":
        return TEMPLATE_KWARGS
    if field == "tools":
        return st.lists(st.fixed_dictionaries({"type": st.just("function"), "function":
                        st.fixed_dictionaries({"name": st.sampled_from(["f", "", "g"]),
                                               "parameters": st.one_of(SCHEMAS, JSON)})}),
                        max_size=2)
    if field == "tool_choice":
        return st.one_of(st.sampled_from(["auto", "required", "none", "any"]),
                         st.just({"type": "function", "function": {"name": "f"}}), JSON)
    if field in ("stop", "stop_token_ids"):
        return st.one_of(st.lists(STRINGS, max_size=3), st.just(["x"] * 100),
                         st.just(list(range(2000))), st.just([10**9]))
    if field == "logit_bias":
        return st.one_of(st.dictionaries(st.sampled_from(["0", "1", "-1", "49151", "49152",
                                                          "99999999999999999999", "x", ""]),
                                         NUMBERS, max_size=3),
                         st.just({str(i): 1 for i in range(2000)}))
    if field in ("messages",):
        return st.one_of(st.lists(st.fixed_dictionaries({"role": st.sampled_from(
            ["user", "system", "assistant", "tool", "developer", "root"]), "content": st.one_of(
                STRINGS, st.just([{"type": "text", "text": "hi"}]), st.just([{"type": "image"}]),
                NUMBERS)}), max_size=3), DEEP)
    if field in ("prompt", "tokens", "input"):
        return st.one_of(st.lists(st.integers(-5, 50000), max_size=4), st.lists(STRINGS,
                                                                                max_size=3),
                         st.lists(st.lists(st.integers(0, 100), max_size=3), max_size=3),
                         st.just(list(range(60))), st.just([0] * 40000), DEEP)
    return st.nothing()


UNIT, SIGNED = st.floats(0, 1), st.floats(-2, 2)
PLAUSIBLE = {  # values in or near the valid range, so that mutated requests also run
    "max_tokens": st.integers(0, 8), "max_completion_tokens": st.integers(0, 8),
    "temperature": st.one_of(st.floats(0, 2), st.just(1e-45)), "top_p": UNIT,
    "top_k": st.integers(-1, 100), "min_p": UNIT, "seed": st.integers(0, 2**63 - 1),
    "n": st.integers(1, 3), "best_of": st.integers(1, 3), "presence_penalty": SIGNED,
    "frequency_penalty": SIGNED, "repetition_penalty": st.floats(0.1, 2),
    "min_tokens": st.integers(0, 3), "logprobs": st.one_of(st.integers(0, 5), st.booleans()),
    "top_logprobs": st.integers(0, 5), "prompt_logprobs": st.integers(0, 3),
    "stream": st.booleans(), "echo": st.booleans(), "ignore_eos": st.booleans(),
    "add_special_tokens": st.booleans(), "add_generation_prompt": st.booleans(),
    "return_token_strs": st.booleans(), "cache_salt": st.text(min_size=1, max_size=5),
    "truncate": st.booleans(), "truncate_prompt_tokens": st.integers(-1, 300),
    "encoding_format": st.sampled_from(["float", "base64"]),
    "stop": st.lists(st.text(max_size=3), max_size=3),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), SIGNED, max_size=3),
}


@st.composite
def mutated(draw, path: str) -> bytes:
    body, plausible = dict(BASE[path]), draw(st.booleans())
    for field in draw(st.lists(st.sampled_from(FIELDS[path]), min_size=1, max_size=3,
                               unique=True)):
        if plausible and field in PLAUSIBLE:
            body[field] = draw(PLAUSIBLE[field])
        else:
            body[field] = draw(st.one_of(_special(field), NUMBERS, STRINGS, DEEP, JSON))
    if body.get("stream") is True and draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    return dumps(body)


RAW_BODIES = st.one_of(st.binary(max_size=64), st.sampled_from([
    b"", b"{", b"[]", b"null", b"1e400", b'{"prompt": "hi"', b"\xff\xfe", b'"\\ud800"',
    b'{"prompt": "hi", "prompt": 1}', b"{}" * 1000]), JSON.map(dumps), DEEP.map(dumps))
PATHS = st.sampled_from([CMPL, CHAT, EMBED, TOKENIZE, DETOKENIZE])
FIXED = {"model": MODEL, "prompt": "The same bits", "max_tokens": 6, "temperature": 0.8,
         "seed": 7, "logprobs": 1}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    engine = tiny_engine(tmp_path_factory.mktemp("fuzz"), max_model_len=64)
    embed_engine = LLM(task="embed").engine  # the default embedding model (its tokenizer too)
    app = build_app(engine, MODEL, embed_engine=embed_engine,
                    limits=ServerLimits(max_request_bytes=1 << 20))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _post(client: TestClient, path: str, body: bytes):
    return client.post(path, content=body, headers={"Content-Type": "application/json"})


def _check(response, path: str, body: bytes) -> None:
    where = f"{path} {body[:300]!r}"
    assert response.status_code < 500, f"{response.status_code} for {where}: {response.text[:500]}"
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        assert '"server_error"' not in response.text, f"stream error for {where}"
        assert response.text.rstrip().endswith("data: [DONE]"), where


def _fixed_bits(client: TestClient) -> tuple[str, list]:
    r = _post(client, CMPL, dumps(FIXED))
    assert r.status_code == 200, r.text
    return r.headers[HEADER], r.json()["choices"][0]["logprobs"]["token_logprobs"]


@pytest.fixture(scope="module")
def bits_before(client):
    return _fixed_bits(client)


def _fuzz(client, bits_before, examples: int, derandomize: bool) -> None:
    @settings(max_examples=examples, deadline=None, derandomize=derandomize, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data) -> None:
        path = data.draw(PATHS)
        body = data.draw(st.one_of(mutated(path), RAW_BODIES) if path != CMPL or
                         data.draw(st.booleans()) else mutated(path))
        _check(_post(client, path, body), path, body)

    run()
    assert _fixed_bits(client) == bits_before


def test_every_bad_input_is_a_4xx_and_the_bits_stay(client, bits_before):
    _fuzz(client, bits_before, examples=120, derandomize=True)


@pytest.mark.slow
def test_every_bad_input_is_a_4xx_and_the_bits_stay_many_examples(client, bits_before):
    _fuzz(client, bits_before, examples=2000, derandomize=False)


REFUSED = [  # (path, body): once a 500, or (/tokenize, /detokenize) unbounded work
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs":
            {"template": "x"}}, "chat_template_kwargs"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs":
            {"self": 1}}, "chat_template_kwargs"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs":
            {"add_generation_prompt": 1}}, "chat_template_kwargs"),
    (CMPL, {"prompt": "hi", "guided_json": Raw('"' + '{\\"a\\":' * 1000 + "1" + "}" * 1000
                                                 + '"')}, "guided_json"),
    (CMPL, {"prompt": "hi", "guided_json": {"$ref": "#"}}, "guided_json"),
    (CMPL, {"prompt": "hi", "temperature": Raw("1e400")}, "temperature"),
    (TOKENIZE, {"prompt": "hello " * 100_000}, "prompt"),
    (DETOKENIZE, {"tokens": [1] * 100_000}, "tokens"),
]


@pytest.mark.parametrize("path,body,param", REFUSED,
                         ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(REFUSED)])
def test_inputs_that_were_5xx_or_unbounded_are_a_400_naming_the_field(client, path, body,
                                                                      param):
    r = _post(client, path, dumps({"model": MODEL, **body}))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_temperature_below_greedy_below_is_greedy(client):
    def tokens(temperature):
        r = _post(client, CMPL, dumps({**FIXED, "temperature": temperature}))
        return [lp for lp in r.json()["choices"][0]["logprobs"]["tokens"]]
    assert tokens(1e-45) == tokens(0.0)
