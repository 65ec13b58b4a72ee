"""Incremental detokenization and stop-string search: the text of a generated output, built once.

Each new token decodes only a short tail window of the output (the tokens since the last emitted
character, plus one token of context so that decoders which treat a leading piece specially, such
as SentencePiece's leading space, see the same neighbour as in the full decode), and the
stop strings are searched only where a new match could start: a stop string ``s`` not found before
the new characters can only match from ``len(old text) - len(s) + 1`` on. The work per token is
therefore bounded by the window and the longest stop string, not by the length of the output.
"""

from __future__ import annotations

from typing import Protocol

MAX_WINDOW = 8  # tokens a window may hold before its text is taken as it is (invalid UTF-8)


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """The text of one growing token sequence, built a window at a time.

    ``text`` equals ``decode(all ids)`` for prefix-stable decoders (byte-level BPE, SentencePiece),
    except that an incomplete UTF-8 character at the end is held back until it completes.
    """

    def __init__(self, decoder: Decoder, stops: list[str], skip_special_tokens: bool = True
                 ) -> None:
        self.decoder = decoder
        self.stops = [s for s in stops if s]
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = 0  # ids[_prefix:_read]: context already turned into text

    def push(self, token_id: int) -> str:
        """Append one token; returns the characters it completed (possibly none)."""
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """The characters still held back (an incomplete UTF-8 character at the end, as the full
        decode shows it); afterwards ``text`` equals ``decode(all ids)``."""
        return self._advance(final=True) if self._read < len(self.ids) else ""

    def _advance(self, final: bool) -> str:
        skip = self.skip_special_tokens
        before = self.decoder.decode(self.ids[self._prefix:self._read], skip)
        after = self.decoder.decode(self.ids[self._prefix:], skip)
        window = len(self.ids) - self._prefix
        if not final and after.endswith("\ufffd") and window < MAX_WINDOW:
            return ""  # an incomplete character: wait for its remaining bytes
        new = after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += new
        return new

    def find_stop(self, num_new: int) -> int | None:
        """Where the first stop string starts, searching only matches that end within the last
        ``num_new`` characters (earlier ones were searched before); None if there is none."""
        if not num_new:
            return None
        old = len(self.text) - num_new
        hits = [self.text.find(s, max(0, old - len(s) + 1)) for s in self.stops]
        hits = [h for h in hits if h >= 0]
        return min(hits) if hits else None

    def stop_at(self, cut: int) -> str:
        """The stop string ``find_stop`` found at ``cut`` (the first listed, if several start
        there)."""
        return next(s for s in self.stops if self.text.startswith(s, cut))
