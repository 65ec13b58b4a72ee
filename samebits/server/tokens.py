"""Token ids as OpenAI shows them: each token's text and its exact bytes. (A stream's text is the
engine's own output text: samebits.engine.output_processor.)"""

from __future__ import annotations

from functools import lru_cache

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


class TokenIds:
    """id -> ("token_id:<id>", its bytes): vLLM's ``return_tokens_as_token_ids``, which names
    each logprob's token by its id (texts that do not decode alone stay unambiguous)."""

    @staticmethod
    def get(token_id: int) -> tuple[str, bytes]:
        text = f"token_id:{token_id}"
        return text, text.encode()
