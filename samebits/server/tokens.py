"""Token ids as OpenAI shows them: each token's text and exact bytes, and text that streams out
token by token without ever sending what the final answer will not contain."""

from __future__ import annotations

from functools import lru_cache

from samebits.text.detokenizer import IncrementalDetokenizer
from samebits.text.tokenizer import Tokenizer


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte -> printable character table, inverted (byte-level BPE vocabularies)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


_UNBYTE = _byte_decoder()


class TokenText:
    """id -> (text, bytes) of one token, cached."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.get = lru_cache(maxsize=1 << 16)(self._lookup)

    def _lookup(self, token_id: int) -> tuple[str, bytes]:
        tok = self.tokenizer
        if tok is None:
            raw = f"<{token_id}>".encode()
        else:
            piece = tok.id_to_piece(token_id) or ""
            if tok.byte_level and all(c in _UNBYTE for c in piece):
                raw = bytes(_UNBYTE[c] for c in piece)
            else:
                raw = tok.decode([token_id], skip_special_tokens=False).encode()
        return raw.decode("utf-8", errors="replace"), raw


class TextStream:
    """Incremental detokenization of one choice.

    ``push`` returns the text that is now safe to send: not a partial UTF-8 character, and not
    the last ``len(longest stop string) - 1`` characters, which a stop string could still claim
    (the engine cuts the text at a stop string). ``finish`` returns the rest of the final text.
    Each token decodes only a short window (``IncrementalDetokenizer``), not the whole output.
    """

    def __init__(self, tokenizer: Tokenizer | None, stop: list[str]) -> None:
        self.text = IncrementalDetokenizer(tokenizer, []) if tokenizer is not None else None
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = ""

    def push(self, token_ids: list[int]) -> str:
        if self.text is None:
            return ""
        for t in token_ids:
            self.text.push(t)
        text = self.text.text
        safe = text[:len(text) - self.hold] if self.hold else text
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def finish(self, final_text: str) -> str:
        if not final_text.startswith(self.sent):  # cannot happen for prefix-stable decoders
            return ""
        delta, self.sent = final_text[len(self.sent):], final_text
        return delta
