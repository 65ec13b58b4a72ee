"""Incremental detokenization for stop strings: the same text and the same cut as decoding the
whole output every token, while each token decodes only a short window."""

from __future__ import annotations

import pytest

from samebits.loader import resolve_model_dir
from samebits.text.detokenizer import MAX_WINDOW, IncrementalDetokenizer
from samebits.text.tokenizer import Tokenizer

TEXT = ("héllo wörld 日本語 🙂🙂 done. Les chats dorment; def f(x):\n    return x * 2\n"
        "Ünïcödé ✓✓ and “quotes” — STOP here, then more text after the stop string. ")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model_dir(None))


class Counting:
    """A decoder that records how many ids each call decodes."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.sizes = tok, []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens)


def test_incremental_text_equals_the_full_decode_at_every_complete_character(tokenizer):
    ids = tokenizer.encode(TEXT * 3)
    d = IncrementalDetokenizer(tokenizer, ["zzz"])
    for i, t in enumerate(ids):
        d.push(t)
        full = tokenizer.decode(ids[:i + 1])
        assert full.startswith(d.text)
        if not full.endswith("\ufffd"):
            assert d.text == full, i
    assert d.text == tokenizer.decode(ids)


def test_each_token_decodes_a_bounded_window(tokenizer):
    ids = tokenizer.encode(TEXT * 6)
    counting = Counting(tokenizer)
    d = IncrementalDetokenizer(counting, ["STOP"])
    for t in ids:
        d.push(t)
    assert len(ids) > 300 and max(counting.sizes) <= MAX_WINDOW


@pytest.mark.parametrize("stops", [["STOP"], [" then", "STOP"], ["🙂🙂"], ["x):\n "], ["本語"]])
def test_first_stop_found_where_a_full_search_finds_it(tokenizer, stops):
    ids = tokenizer.encode(TEXT)
    d = IncrementalDetokenizer(tokenizer, stops)
    cut, n = None, 0
    while cut is None:
        cut, n = d.find_stop(len(d.push(ids[n]))), n + 1
    full = tokenizer.decode(ids[:n])
    want = min(full.find(s) for s in stops if s in full)
    assert cut == want and d.text[:cut] == full[:want]
    assert not any(s in tokenizer.decode(ids[:n - 1]) for s in stops), "stopped at the first match"


@pytest.mark.smoke
def test_a_stop_string_completed_by_a_later_token_is_found_once_and_not_before(tokenizer):
    d = IncrementalDetokenizer(tokenizer, ["ab"])
    a, b = tokenizer.encode("a"), tokenizer.encode("b")
    assert d.find_stop(len(d.push(a[0]))) is None
    assert d.find_stop(len(d.push(b[0]))) == 0
