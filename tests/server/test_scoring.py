"""Scoring through /v1/completions, with the real openai SDK: ``echo`` + ``logprobs`` with
``max_tokens`` 0 (the prompt's logprobs, the first null) and 1 (lm-eval 0.4's request: the prompt's
logprobs followed by exactly the generated token's), and vLLM's ``prompt_logprobs``. Every prompt
logprob equals ``LLM.score`` of the same token ids bitwise (exact float equality through JSON)."""

from __future__ import annotations

from samebits import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
TEXT = "The owl is a bird of prey. It hunts at night and sees well in the dark."


def _ids(offline_llm) -> list[int]:
    return offline_llm.tokenizer.encode(TEXT)


def test_echo_max_tokens_0_gives_prompt_logprobs_equal_to_score(server, offline_llm):
    ids = _ids(offline_llm)
    choice = server.client().completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1,
                                                max_tokens=0).choices[0]
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == offline_llm.score([ids])[0]
    assert len(lp.tokens) == len(ids) and choice.text == offline_llm.tokenizer.decode(ids)
    assert all(len(top) in (1, 2) and top[tok] == v for tok, top, v in
               zip(lp.tokens[1:], lp.top_logprobs[1:], lp.token_logprobs[1:], strict=True))


def test_echo_max_tokens_1_is_prompt_then_exactly_the_generated_token(server, offline_llm):
    """lm-eval sums token_logprobs[ctxlen:-1]: anything but one trailing entry corrupts it."""
    ids = _ids(offline_llm)
    body = dict(model=MODEL, prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0,
                seed=1234)
    choice = server.client().completions.create(**body).choices[0]
    lp = choice.logprobs
    want = offline_llm.generate(ids, SamplingParams(max_tokens=1, temperature=0))[0].outputs[0]
    assert len(lp.token_logprobs) == len(ids) + 1
    assert lp.token_logprobs[1:-1] == offline_llm.score([ids])[0]
    assert lp.token_logprobs[-1] == want.token_logprobs[0]
    assert choice.text == TEXT + want.text and lp.text_offset == sorted(lp.text_offset)


def test_echo_without_logprobs_repeats_the_prompt_string(server):
    choice = server.client().completions.create(model=MODEL, prompt=TEXT, echo=True,
                                                max_tokens=3, temperature=0).choices[0]
    assert choice.text.startswith(TEXT) and choice.logprobs is None


def test_prompt_logprobs_in_vllm_shape_with_ranks(server, offline_llm):
    ids = _ids(offline_llm)
    choice = server.client().completions.create(
        model=MODEL, prompt=ids, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3}
    ).choices[0]
    plp = choice.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert [e[str(t)]["logprob"] for e, t in zip(plp[1:], ids[1:], strict=True)] == \
        offline_llm.score([ids])[0]
    engine = offline_llm.engine  # the raw distribution at each position, as the engine has it
    rows = engine.runner.model.ops.log_softmax(engine.prompt_logits(ids))
    for pos, entry in enumerate(plp[1:]):
        row, token = rows[pos], ids[pos + 1]
        assert next(iter(entry)) == str(token)  # the prompt token first
        assert entry[str(token)]["rank"] == int((row >= row[token]).sum())
        values, top_ids = row.topk(3)
        for r, (v, t) in enumerate(zip(values.tolist(), top_ids.tolist(), strict=True), 1):
            assert (entry[str(t)]["rank"], entry[str(t)]["logprob"]) == (r, v)
        assert set(entry) == {str(token), *map(str, top_ids.tolist())}
        assert all(e["decoded_token"] == offline_llm.tokenizer.decode(
            [int(k)], skip_special_tokens=False) for k, e in entry.items())


def test_prompt_logprobs_are_the_same_alone_and_beside_a_cached_neighbour(server, offline_llm):
    """A request that asks for prompt logprobs computes every position, even when its prefix is
    in the cache (the first request put it there)."""
    ids = _ids(offline_llm)
    client = server.client()
    client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=[ids, ids[:9]], max_tokens=0,
                                      echo=True, logprobs=0)
    assert again.choices[0].logprobs.token_logprobs[1:] == offline_llm.score([ids])[0]
    assert again.choices[1].logprobs.token_logprobs[1:] == offline_llm.score([ids[:9]])[0]
    assert again.usage.completion_tokens == 0
