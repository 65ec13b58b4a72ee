"""The offline API in vLLM's shape: RequestOutput.outputs (n CompletionOutputs, each with its own
seed and replayable alone), best_of, prompts as dicts, get_tokenizer, score's token-id contract,
min_tokens holding back EOS and stop strings, vLLM's logprob dicts (the sampled token with its
rank, then the top k: bitwise the prompt logprobs of the same tokens), stop_reason, metrics, the
text options, truncate_prompt_tokens, chat with parts and continue_final_message."""

from __future__ import annotations

import pytest

from samebits import LLM, CompletionOutput, Logprob, RequestOutput, SamplingParams

PROMPT = "The cat sat on the mat. The cat was happy because the cat"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=8)


def _bits(o: CompletionOutput) -> tuple:
    return o.token_ids, o.token_logprobs, o.text, o.finish_reason


@pytest.mark.smoke
def test_n2_gives_two_outputs_each_replayable_alone_bitwise(llm):
    top = 2**63 - 1  # choice 1's seed wraps to 0
    out = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=top, n=2))
    assert len(out) == 1 and isinstance(out[0], RequestOutput)
    r = out[0]
    assert r.prompt == PROMPT and r.prompt_token_ids == llm.get_tokenizer().encode(PROMPT)
    assert r.finished and r.prompt_logprobs is None and r.system_fingerprint == llm.fingerprint
    assert [o.index for o in r.outputs] == [0, 1]
    assert [o.seed for o in r.outputs] == [top, 0]
    assert r.outputs[0].token_ids != r.outputs[1].token_ids
    for o in r.outputs:
        assert len(o.token_ids) == len(o.token_logprobs) == 6 and o.finish_reason == "length"
        assert o.cumulative_logprob == sum(o.token_logprobs) and o.logprobs is None
    replays = llm.generate([PROMPT] * 2, [SamplingParams(max_tokens=6, temperature=1.0,
                                                         seed=o.seed) for o in r.outputs])
    assert [len(x.outputs) for x in replays] == [1, 1]
    assert [_bits(x.outputs[0]) for x in replays] == [_bits(o) for o in r.outputs]


def test_unseeded_choices_report_one_drawn_seed_plus_i(llm):
    outs = llm.generate([PROMPT, [1, 2, 3]], SamplingParams(max_tokens=2, n=3))
    for r in outs:
        s = r.outputs[0].seed
        assert [o.seed for o in r.outputs] == [s, s + 1, s + 2] and 0 <= s < 2**63
    assert outs[1].prompt is None


def test_best_of_returns_the_n_most_likely_candidates(llm):
    params = dict(max_tokens=5, temperature=1.0, seed=40)
    every, best = (r.outputs for r in llm.generate(
        [PROMPT] * 2, [SamplingParams(**params, n=4), SamplingParams(**params, n=2, best_of=4)]))
    ranked = sorted(every, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.index for o in best] == [0, 1]
    assert [(o.seed, *_bits(o)) for o in best] == [(o.seed, *_bits(o)) for o in ranked]
    assert best[0].cumulative_logprob >= best[1].cumulative_logprob


def test_prompts_as_strings_token_ids_and_dicts_are_the_same_request(llm):
    ids = llm.get_tokenizer().encode(PROMPT)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    outs = llm.generate([PROMPT, ids, {"prompt": PROMPT}, {"prompt_token_ids": ids}], params)
    assert len({tuple(r.outputs[0].token_ids) for r in outs}) == 1
    assert [r.prompt for r in outs] == [PROMPT, None, PROMPT, None]
    assert len(llm.generate({"prompt_token_ids": ids}, params)) == 1
    for bad in ({"prompt": PROMPT, "prompt_token_ids": ids}, {"text": PROMPT}, {"prompt": ids}):
        with pytest.raises(ValueError, match="prompt"):
            llm.generate(bad, params)


def test_score_refuses_text_with_a_type_error_naming_the_difference_from_vllm(llm):
    for bad in ("some text", ["a", "b"]):
        with pytest.raises(TypeError, match="token id lists.*vLLM"):
            llm.score(bad)


def test_min_tokens_holds_back_eos(llm):
    eos = llm.tokenizer.eos_token_ids
    forced = dict(max_tokens=8, temperature=0.0, logit_bias={t: 100.0 for t in eos})
    now, held = (r.outputs[0] for r in llm.generate(
        [PROMPT] * 2, [SamplingParams(**forced), SamplingParams(**forced, min_tokens=3)]))
    assert len(now.token_ids) == 1 and now.token_ids[0] in eos and now.finish_reason == "stop"
    assert len(held.token_ids) == 4 and held.finish_reason == "stop"
    assert held.token_ids[3] in eos and not set(held.token_ids[:3]) & set(eos)


def test_min_tokens_holds_back_stop_strings(llm):
    greedy = dict(max_tokens=10, temperature=0.0, stop=["happy"])
    full, first, later = (r.outputs[0] for r in llm.generate([PROMPT] * 3, [
        SamplingParams(max_tokens=10, temperature=0.0), SamplingParams(**greedy),
        SamplingParams(**greedy, min_tokens=4)]))
    assert full.text.count("happy") >= 2, full.text  # " was happy. The cat was happy ..."
    assert first.finish_reason == later.finish_reason == "stop"
    assert first.text == full.text.split("happy")[0]
    second = full.text.index("happy", len(first.text) + 1)
    assert later.text == full.text[:second] and len(later.token_ids) >= 4


def test_logprobs_are_vllms_dicts_equal_to_the_prompt_logprobs_of_the_same_tokens(llm):
    r = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=5, logprobs=2))[0]
    out, n = r.outputs[0], len(r.prompt_token_ids)
    assert all(isinstance(v, Logprob) for entry in out.logprobs for v in entry.values())
    assert [next(iter(entry)) for entry in out.logprobs] == out.token_ids  # sampled token first
    assert [entry[t].logprob for entry, t in zip(out.logprobs, out.token_ids, strict=True)] == \
        out.token_logprobs
    assert all(len(entry) in (2, 3) for entry in out.logprobs)
    scored = llm.generate([r.prompt_token_ids + out.token_ids],
                          SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert out.logprobs == scored.prompt_logprobs[n:]  # values, ranks and texts, bit for bit
    zero = llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=1.0, seed=5,
                                               logprobs=0))[0].outputs[0]
    assert [list(e) for e in zero.logprobs] == [[t] for t in zero.token_ids]
    assert zero.logprobs == [{t: e[t]} for t, e in zip(zero.token_ids, out.logprobs[:3],
                                                       strict=True)]


def test_stop_reason_names_the_stop_string_or_token_and_metrics_are_in_order(llm):
    eos = llm.tokenizer.eos_token_ids[0]
    greedy = dict(max_tokens=10, temperature=0.0)
    full = llm.generate(PROMPT, SamplingParams(**greedy))[0].outputs[0]
    stop_id = full.token_ids[2]
    outs = llm.generate([PROMPT] * 5, [
        SamplingParams(**greedy, stop="happy"),
        SamplingParams(**greedy, stop="happy", include_stop_str_in_output=True),
        SamplingParams(**greedy, stop_token_ids=[stop_id]),
        SamplingParams(**greedy, logit_bias={eos: 100.0}),
        SamplingParams(**greedy, detokenize=False)])
    cut, kept, by_id, by_eos, no_text = (r.outputs[0] for r in outs)
    assert (cut.stop_reason, cut.text) == ("happy", full.text.split("happy")[0])
    assert (kept.stop_reason, kept.text) == ("happy", cut.text + "happy")
    assert (by_id.stop_reason, by_id.token_ids) == (stop_id, full.token_ids[:3])
    assert (by_eos.finish_reason, by_eos.stop_reason, by_eos.token_ids) == ("stop", None, [eos])
    assert (no_text.text, no_text.token_ids, no_text.stop_reason) == ("", full.token_ids, None)
    m = outs[0].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time \
        <= m.finished_time


def test_special_tokens_enter_the_text_only_when_not_skipped(llm):
    im_end = llm.get_tokenizer().convert_tokens_to_ids("<|im_end|>")
    forced = dict(max_tokens=2, temperature=0.0, ignore_eos=True, logit_bias={im_end: 100.0})
    skipped, shown, spaced = (r.outputs[0] for r in llm.generate([PROMPT] * 3, [
        SamplingParams(**forced), SamplingParams(**forced, skip_special_tokens=False),
        SamplingParams(**forced, skip_special_tokens=False,
                       spaces_between_special_tokens=False)]))
    assert skipped.token_ids == shown.token_ids == [im_end, im_end] and skipped.text == ""
    assert shown.text == spaced.text == "<|im_end|><|im_end|>"  # a fast tokenizer, as vLLM's


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    cut, tail = llm.generate([ids, ids[-4:]], [SamplingParams(max_tokens=3, temperature=0.0,
                                                              truncate_prompt_tokens=4), params])
    assert cut.prompt_token_ids == tail.prompt_token_ids == ids[-4:]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids


def test_chat_takes_content_parts_and_continues_a_final_message(llm):
    params = SamplingParams(max_tokens=4, temperature=0.0)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three"},
                                          {"type": "text", "text": "colors."}]}]
    joined = [{"role": "user", "content": "Name three\ncolors."}]
    a, b = llm.chat([parts, joined], params)
    assert a.prompt_token_ids == b.prompt_token_ids and a.outputs[0].token_ids == \
        b.outputs[0].token_ids
    open_turn = joined + [{"role": "assistant", "content": "Red, green and"}]
    cont = llm.chat(open_turn, params, add_generation_prompt=False, continue_final_message=True)[0]
    assert cont.prompt_token_ids == llm.get_tokenizer().apply_chat_template(
        open_turn, continue_final_message=True)
    assert llm.tokenizer.decode(cont.prompt_token_ids).endswith("Red, green and")
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        llm.chat(open_turn, params, continue_final_message=True)
