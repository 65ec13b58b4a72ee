"""``LLM.get_tokenizer()`` answers transformers' tokenizer calls as transformers'
``PreTrainedTokenizerFast`` does over the same tokenizer files, and its chat template renders what
``LLM.chat`` sends (list-of-parts content, ``add_generation_prompt``,
``continue_final_message``)."""

from __future__ import annotations

import pytest
import torch

from samebits.loader import resolve_model_dir
from samebits.text.chat_template import render_chat
from samebits.text.hf_tokenizer import HFTokenizer
from samebits.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = ["Hello, my name is", "héllo wörld 日本語 🙂 <|im_end|> done.", "a"]
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name three colors."},
        {"role": "assistant", "content": "Red, green"}]


@pytest.fixture(scope="module")
def pair() -> tuple[HFTokenizer, object]:
    path = resolve_model_dir(None)
    return (HFTokenizer(Tokenizer.from_dir(path), str(path)),
            transformers.AutoTokenizer.from_pretrained(str(path)))


def test_special_tokens_length_and_vocabulary_equal_transformers(pair):
    ours, hf = pair
    for name in ("eos_token", "eos_token_id", "bos_token", "bos_token_id", "pad_token",
                 "pad_token_id", "unk_token", "unk_token_id", "vocab_size"):
        assert getattr(ours, name) == getattr(hf, name), name
    assert len(ours) == len(hf) and ours.get_vocab() == hf.get_vocab()
    assert set(ours.all_special_ids) == set(hf.all_special_ids)


def test_encode_call_and_tokens_equal_transformers(pair):
    ours, hf = pair
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(
                text, add_special_tokens=special)
        assert dict(ours(text)) == dict(hf(text))
        assert ours.tokenize(text) == hf.tokenize(text)
        ids = hf.encode(text)
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
        assert ours.convert_ids_to_tokens(ids[0]) == hf.convert_ids_to_tokens(ids[0])
        assert ours.convert_tokens_to_ids(hf.convert_ids_to_tokens(ids)) == ids
        assert ours.convert_tokens_to_string(ours.tokenize(text)) == hf.convert_tokens_to_string(
            hf.tokenize(text))
    for side in ("left", "right"):
        got = ours(TEXTS, padding=True, return_tensors="pt", padding_side=side)
        want = hf(TEXTS, padding=True, return_tensors="pt", padding_side=side)
        assert all(torch.equal(got[k], want[k]) for k in ("input_ids", "attention_mask"))
        assert torch.equal(got.input_ids, want.input_ids)


@pytest.mark.smoke
def test_decode_and_batch_decode_equal_transformers(pair):
    ours, hf = pair
    batch = [hf.encode(t) for t in TEXTS]
    for skip in (False, True):
        assert ours.batch_decode(batch, skip_special_tokens=skip) == hf.batch_decode(
            batch, skip_special_tokens=skip)
        for ids in batch:
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip)
            assert ours.decode(torch.tensor(ids)) == hf.decode(torch.tensor(ids))
    assert ours.decode(batch[0][0]) == hf.decode(batch[0][0])


@pytest.mark.parametrize("options", [dict(add_generation_prompt=True),
                                     dict(add_generation_prompt=False),
                                     dict(continue_final_message=True)])
def test_apply_chat_template_equals_transformers(pair, options):
    ours, hf = pair
    conversation = CHAT if options.get("continue_final_message") else CHAT[:2]
    text = hf.apply_chat_template(conversation, tokenize=False, **options)
    assert ours.apply_chat_template(conversation, tokenize=False, **options) == text
    assert ours.apply_chat_template(conversation, **options) == hf.apply_chat_template(
        conversation, return_dict=False, **options)
    assert ours.apply_chat_template([conversation, conversation], tokenize=False,
                                    **options) == [text, text]
    assert text == render_chat(ours.tokenizer, conversation,
                               add_generation_prompt=options.get("add_generation_prompt", False),
                               continue_final_message=options.get("continue_final_message", False))


def test_content_parts_render_as_their_joined_text_and_other_parts_are_refused(pair):
    ours, _ = pair
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three"},
                                          {"type": "text", "text": "colors."}]}]
    joined = [{"role": "user", "content": "Name three\ncolors."}]
    assert ours.apply_chat_template(parts, tokenize=False) == ours.apply_chat_template(
        joined, tokenize=False)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="image_url"):
        ours.apply_chat_template(image)
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        ours.apply_chat_template(CHAT, add_generation_prompt=True, continue_final_message=True)
