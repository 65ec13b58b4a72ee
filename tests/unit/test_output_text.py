"""The output text, detokenized once: what a stream sends adds up to the final text, never holds a
partial character or what a stop string will cut, and the final text is cut as vLLM cuts it
(with or without the stop string)."""

from __future__ import annotations

import pytest

from samebits.sampling_params import SamplingParams
from samebits.text.output_text import OutputText


class CharTokenizer:
    """Token i is the byte i (so multi-byte characters span tokens), like byte-level BPE."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def _run(text: str, **params) -> tuple[list[str], str, str | None]:
    """Push ``text`` byte by byte until a stop string ends it: (streamed pieces, final text,
    the stop string)."""
    out = OutputText(CharTokenizer(), SamplingParams(**params))
    sent, stop = [], None
    for b in text.encode():
        out.push(b)
        stop = out.find_stop(out.drain())
        if stop is not None:
            break
        sent.append(out.stream(finished=False))
    sent.append(out.stream(finished=True))
    return sent, out.finish(), stop


def test_stream_never_sends_a_partial_character_and_adds_up_to_the_text():
    sent, final, stop = _run("aé日b🙂")
    assert "\ufffd" not in "".join(sent) and "".join(sent) == final == "aé日b🙂" and stop is None


@pytest.mark.smoke
def test_stream_holds_back_what_a_stop_string_could_claim():
    sent, final, stop = _run("abSTOP and more", stop=["STOP"])
    assert stop == "STOP" and final == "ab" and "".join(sent) == "ab"
    assert all("S" not in piece for piece in sent)


def test_include_stop_str_in_output_keeps_the_stop_string_and_streams_without_holding_back():
    sent, final, stop = _run("abSTOP and more", stop=["STOP"], include_stop_str_in_output=True)
    assert stop == "STOP" and final == "abSTOP" and "".join(sent) == "abSTOP"
    assert sent[:2] == ["a", "b"]  # nothing held back


@pytest.mark.parametrize("stops", [["xy", "x"], ["x", "xy"]])
def test_the_earliest_stop_wins_and_names_the_stop_reason(stops):
    _, final, stop = _run("abxyz", stop=stops)
    assert final == "ab" and stop == "x"  # "x" completes first, at the same place as "xy"


def test_finish_flushes_an_incomplete_character_as_the_full_decode_shows_it():
    out = OutputText(CharTokenizer(), SamplingParams())
    for b in "ok日".encode()[:-1]:  # the last byte of 日 never comes
        out.push(b)
    out.drain()
    assert out.detokenizer.text == "ok"
    assert out.finish() == CharTokenizer().decode(list("ok日".encode()[:-1]))


def test_text_read_at_the_end_equals_text_detokenized_token_by_token():
    text = "naïve 日本 text, 🙂 ok"
    lazy, eager = (OutputText(CharTokenizer(), SamplingParams()) for _ in range(2))
    for b in text.encode():
        lazy.push(b)
        eager.push(b)
        eager.drain()
    assert lazy.finish() == eager.finish() == text
