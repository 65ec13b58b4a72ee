"""Embedding inputs -> token ids: what ``LLM.embed`` and ``POST /v1/embeddings`` both do before
their pooling requests reach the engine.

An input is a text (tokenized with the model's special tokens, as sentence-transformers does) or a
list of token ids (taken as given), checked against the vocabulary and the model's length limit.
An input over the limit is an error unless truncation is asked for: ``True`` cuts it to the limit,
an int k to k tokens (a text keeps its special tokens, ``[CLS] ... [SEP]``; an id list keeps its
first k ids). Every error is a ``ValueError`` naming the input by its position.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from samebits.config import ModelFormatError

EmbedInput = str | Sequence[int]


class EmbeddingInputs:
    """``tokenize(inputs, truncate)`` -> one token id list per input. ``tokenizer``: the model's
    ``tokenizers.Tokenizer`` with padding and truncation off (None: id lists only)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_len: int) -> None:
        self.tokenizer, self.vocab_size, self.max_len = tokenizer, vocab_size, max_len

    @classmethod
    def from_model_dir(cls, model_dir: Path, vocab_size: int, max_len: int) -> EmbeddingInputs:
        """With the directory's tokenizer.json, if it has one. Padding and truncation off: fixed
        padding would enter pooling; truncation is asked for per call."""
        file = model_dir / "tokenizer.json"
        if not file.is_file():
            return cls(None, vocab_size, max_len)
        try:
            tok = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ModelFormatError(f"{file}: cannot parse tokenizer ({e})") from None
        tok.no_padding()
        tok.no_truncation()
        return cls(tok, vocab_size, max_len)

    def tokenize(self, inputs: EmbedInput | Sequence[EmbedInput], truncate: bool | int = False
                 ) -> list[list[int]]:
        """Token ids of every input (module docstring)."""
        limit = self._truncation(truncate)
        out = []
        for n, item in enumerate(_as_items(inputs)):
            ids = self._encode(n, item, limit)
            if len(ids) > self.max_len:
                raise ValueError(f"input {n} has {len(ids)} tokens, over the model's limit of "
                                 f"{self.max_len} tokens; shorten it or pass truncate=True")
            out.append(ids)
        return out

    def _truncation(self, truncate: bool | int) -> int | None:
        if truncate is False:
            return None
        if truncate is True:
            return self.max_len
        if not isinstance(truncate, int) or not 0 < truncate <= self.max_len:
            raise ValueError(f"truncate must be a bool or a token count from 1 to the model's limit "
                             f"of {self.max_len} tokens, got {truncate!r}")
        return truncate

    def _encode(self, n: int, item: EmbedInput, limit: int | None) -> list[int]:
        if isinstance(item, str):
            if item == "":
                raise ValueError(f"input {n} is an empty string")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: pass token id lists")
            if limit is None:  # encode_batch releases the GIL (a server thread never stalls)
                return self.tokenizer.encode_batch([item])[0].ids
            enc = self.tokenizer.encode_batch([item], add_special_tokens=False)[0]
            enc.truncate(max(limit - self.tokenizer.num_special_tokens_to_add(False), 0))
            return self.tokenizer.post_process(enc).ids
        ids = _check_ids(n, item, self.vocab_size)
        return ids if limit is None else ids[:limit]


def _as_items(inputs: Any) -> list[Any]:
    if isinstance(inputs, str):
        return [inputs]
    if not isinstance(inputs, Sequence) or isinstance(inputs, bytes | bytearray):
        raise ValueError(f"expected a string, a list of strings or of token id lists; "
                         f"got {type(inputs).__name__}")
    items = list(inputs)
    if not items:
        raise ValueError("no inputs to embed: got an empty list")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [items]  # one input given as token ids
    return items


def _check_ids(n: int, item: Any, vocab_size: int) -> list[int]:
    if isinstance(item, bytes | bytearray) or not isinstance(item, Sequence):
        raise ValueError(f"input {n} must be a string or a list of token ids, "
                         f"got {type(item).__name__}")
    ids = list(item)
    if not ids:
        raise ValueError(f"input {n} is an empty token id list")
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool):
            raise ValueError(f"input {n}: token ids must be integers, got {type(t).__name__}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"input {n}: token id {t} is outside the vocabulary [0, {vocab_size})")
    return ids
