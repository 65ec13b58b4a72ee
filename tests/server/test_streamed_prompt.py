"""What belongs to the prompt, streamed, through the real openai SDK against ``samebits serve``:
``echo`` (the prompt's text and, with ``logprobs``, its tokens' logprobs, the first null) and
``prompt_logprobs`` arrive on each choice's first chunk (chat: the stream's first chunk), and a
choice's chunks add up bit for bit -- text, logprobs, top logprobs, text offsets -- to the same
request's non-streamed choice."""

from __future__ import annotations

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The cat sat on the mat. The cat", "Two plus two is"]
ASK = [{"role": "user", "content": "Name a colour."}]


def _by_choice(chunks) -> dict[int, list]:
    """Each choice's chunk choices, in order."""
    out: dict[int, list] = {}
    for chunk in chunks:
        for c in chunk.choices:
            out.setdefault(c.index, []).append(c)
    return out


def _joined(parts) -> dict:
    """A completion choice's streamed parts put together (the non-streamed choice's fields)."""
    lps = [p.logprobs for p in parts if p.logprobs is not None]
    return {"text": "".join(p.text for p in parts),
            "finish_reason": parts[-1].finish_reason,
            "tokens": [t for lp in lps for t in lp.tokens],
            "token_logprobs": [v for lp in lps for v in lp.token_logprobs],
            "top_logprobs": [v for lp in lps for v in lp.top_logprobs],
            "text_offset": [v for lp in lps for v in lp.text_offset]}


def _whole(c) -> dict:
    lp = c.logprobs
    return {"text": c.text, "finish_reason": c.finish_reason, "tokens": lp.tokens,
            "token_logprobs": lp.token_logprobs, "top_logprobs": lp.top_logprobs,
            "text_offset": lp.text_offset}


def test_streamed_echo_with_logprobs_is_bitwise_the_whole_answer(server):
    client = server.client()
    kw = dict(model=MODEL, prompt=PROMPTS, max_tokens=5, temperature=0.8, seed=3, n=2,
              echo=True, logprobs=2, extra_body={"prompt_logprobs": 1})
    whole = client.completions.create(**kw)
    streamed = _by_choice(client.completions.create(stream=True, **kw))
    assert sorted(streamed) == [c.index for c in whole.choices] == [0, 1, 2, 3]
    for c in whole.choices:
        parts = streamed[c.index]
        assert _joined(parts) == _whole(c)  # floats compared exactly
        first = parts[0]
        assert first.text.startswith(PROMPTS[c.index // 2])
        n_prompt = len(c.model_extra["prompt_logprobs"])
        assert first.logprobs.token_logprobs[0] is None and first.logprobs.top_logprobs[0] is None
        assert len(first.logprobs.tokens) > n_prompt  # the prompt's tokens, then generated ones
        assert first.model_extra["prompt_logprobs"] == c.model_extra["prompt_logprobs"]
        assert all(p.model_extra.get("prompt_logprobs") is None for p in parts[1:])


def test_streamed_echo_of_max_tokens_0_is_the_prompt_scored_alone(server):
    client = server.client()
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=1)
    whole = client.completions.create(**kw).choices[0]
    parts = _by_choice(client.completions.create(stream=True, **kw))[0]
    assert len(parts) == 1 and _joined(parts) == _whole(whole)
    assert whole.text == PROMPTS[0] and whole.logprobs.token_logprobs[0] is None


def test_streamed_chat_prompt_logprobs_come_first_and_logprobs_bitwise(server):
    client = server.client()
    kw = dict(model=MODEL, messages=ASK, max_tokens=5, temperature=0.8, seed=5, n=2,
              logprobs=True, top_logprobs=2, extra_body={"prompt_logprobs": 2})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].model_extra["prompt_logprobs"] == whole.model_extra["prompt_logprobs"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.model_extra.get("prompt_logprobs") is None for c in chunks[1:])
    streamed = _by_choice(chunks)
    for c in whole.choices:
        parts = streamed[c.index]
        assert "".join(p.delta.content or "" for p in parts) == c.message.content
        lps = [t.model_dump() for p in parts if p.logprobs for t in p.logprobs.content]
        assert lps == [t.model_dump() for t in c.logprobs.content]  # floats compared exactly
        assert parts[-1].finish_reason == c.finish_reason
