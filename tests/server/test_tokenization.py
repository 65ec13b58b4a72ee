"""vLLM's tokenizer endpoints on a real server: /tokenize (prompt or messages, add_special_tokens,
special-token text -> its id), /detokenize, /tokenizer_info, /version -- behind the API key, as
every endpoint but /health."""

from __future__ import annotations

import httpx

import samebits

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Hello there"}]


def _post(server, path: str, **body) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=60)


def test_tokenize_prompt_equals_the_engine_tokenizer(server, offline_llm):
    text = "Reproducible bits<|im_end|> at any batch size"
    got = _post(server, "/tokenize", model=MODEL, prompt=text).json()
    ids = offline_llm.tokenizer.encode(text)
    assert got == {"count": len(ids), "max_model_len": 1024, "tokens": ids, "token_strs": None}
    im_end = offline_llm.tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert len(im_end) == 1 and im_end[0] in ids  # special-token text maps to its id
    plain = _post(server, "/tokenize", prompt=text, add_special_tokens=False).json()["tokens"]
    assert plain == offline_llm.tokenizer.encode(text, add_special_tokens=False)


def test_tokenize_messages_applies_the_chat_template(server, offline_llm):
    got = _post(server, "/tokenize", messages=CHAT, return_token_strs=True).json()
    want = offline_llm.tokenizer.encode(offline_llm.tokenizer.apply_chat_template(CHAT),
                                        add_special_tokens=False)
    assert got["tokens"] == want and len(got["token_strs"]) == len(want)
    bare = _post(server, "/tokenize", messages=CHAT, add_generation_prompt=False).json()
    assert len(bare["tokens"]) < len(want)


def test_detokenize_round_trips_and_keeps_special_tokens(server, offline_llm):
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = _post(server, "/tokenize", prompt=text, add_special_tokens=False).json()["tokens"]
    assert _post(server, "/detokenize", model=MODEL, tokens=ids).json() == {"prompt": text}


def test_tokenizer_info_and_version(server, offline_llm):
    info = httpx.get(f"{server.url}/tokenizer_info", headers=server.headers, timeout=60).json()
    tok = offline_llm.tokenizer
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == (
        tok.eos_token, tok.bos_token, tok.pad_token)
    assert info["chat_template"] == tok.chat_template and info["tokenizer_class"]
    assert httpx.get(f"{server.url}/version", headers=server.headers, timeout=60).json() == {
        "version": samebits.__version__}


def test_bad_tokenizer_requests_get_400_or_404(server):
    assert _post(server, "/tokenize", prompt="a", messages=CHAT).status_code == 400
    assert _post(server, "/tokenize").status_code == 400
    assert _post(server, "/detokenize", tokens=[10**9]).json()["error"]["param"] == "tokens"
    assert _post(server, "/tokenize", model="nope", prompt="a").status_code == 404


def test_tokenize_messages_are_the_chat_requests_prompt_ids(server):
    """/tokenize renders messages as /v1/chat/completions does: tools, continue_final_message."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    history = [*CHAT, {"role": "assistant", "content": "Hi! The weather"}]
    for body in (dict(messages=CHAT, tools=tools),
                 dict(messages=history, add_generation_prompt=False,
                      continue_final_message=True)):
        got = _post(server, "/tokenize", **body)
        assert got.status_code == 200, got.text
        chat = _post(server, "/v1/chat/completions", model=MODEL, max_tokens=1,
                     return_token_ids=True, **body).json()
        assert got.json()["tokens"] == chat["prompt_token_ids"]
