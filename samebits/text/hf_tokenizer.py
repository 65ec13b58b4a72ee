"""``LLM.get_tokenizer()``: transformers' tokenizer interface over samebits' own ``Tokenizer``.

Code written for vLLM gets a Hugging Face tokenizer from ``get_tokenizer()``; this object answers
the same calls with the same results as transformers' ``PreTrainedTokenizerFast`` over the same
tokenizer.json (``tests/unit/test_hf_tokenizer.py`` compares them): ``__call__``, ``encode``,
``decode``, ``batch_decode``, ``tokenize``, ``convert_ids_to_tokens``,
``convert_tokens_to_ids``, ``convert_tokens_to_string``, ``apply_chat_template``, the special
tokens and their ids, ``len()``, ``get_vocab``. Its ids are the engine's (one ``Tokenizer``
encodes for both), and its chat template renders exactly what ``LLM.chat`` sends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from samebits.text.chat_template import render_chat
from samebits.text.tokenizer import Tokenizer

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                "mask_token")


class BatchEncoding(dict):
    """transformers' ``BatchEncoding``: a dict whose keys are also attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class HFTokenizer:
    is_fast = True

    def __init__(self, tokenizer: Tokenizer, name_or_path: str = "") -> None:
        self.tokenizer = tokenizer
        self.name_or_path = name_or_path
        self.padding_side = tokenizer.config.get("padding_side", "right")
        self.truncation_side = tokenizer.config.get("truncation_side", "right")
        self.model_max_length = tokenizer.config.get("model_max_length", int(1e30))
        self.chat_template = tokenizer.chat_template
        for key in SPECIAL_KEYS:
            setattr(self, key, tokenizer.special_token(key))

    # ---- vocabulary ------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (transformers' meaning)."""
        return self.tokenizer.backend.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self.tokenizer.backend.get_vocab(with_added_tokens=True)

    def __getattr__(self, name: str) -> Any:
        """``<key>_id`` of each special token (``eos_token_id``, ``pad_token_id``...)."""
        if name.endswith("_token_id") and name[:-3] in SPECIAL_KEYS:
            token = getattr(self, name[:-3])
            return None if token is None else self.convert_tokens_to_ids(token)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def all_special_tokens(self) -> list[str]:
        extra = self.tokenizer.config.get("additional_special_tokens") or []
        named = [getattr(self, k) for k in SPECIAL_KEYS if getattr(self, k) is not None]
        return list(dict.fromkeys(named + [t if isinstance(t, str) else t["content"]
                                           for t in extra]))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    # ---- text -> ids -----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, truncation: bool = False,
               max_length: int | None = None, return_tensors: str | None = None) -> Any:
        ids = self._truncate(self.tokenizer.encode(text, add_special_tokens), truncation,
                             max_length)
        return _tensor([ids], return_tensors) if return_tensors else ids

    def __call__(self, text: str | list[str], add_special_tokens: bool = True,
                 padding: bool | str = False, truncation: bool = False,
                 max_length: int | None = None, return_tensors: str | None = None,
                 return_attention_mask: bool = True, padding_side: str | None = None
                 ) -> BatchEncoding:
        """``input_ids`` and ``attention_mask`` of one text or a batch, padded (``True`` or
        ``"longest"``: to the longest; ``"max_length"``: to ``max_length``) on
        ``padding_side`` with ``pad_token_id``; ``return_tensors="pt"`` gives tensors."""
        batch = [text] if isinstance(text, str) else list(text)
        ids = [self.encode(t, add_special_tokens, truncation, max_length) for t in batch]
        masks = [[1] * len(i) for i in ids]
        if padding:
            ids, masks = self._pad(ids, masks, padding, max_length, padding_side)
        if isinstance(text, str):
            ids, masks = ids[0], masks[0]
        out = BatchEncoding(input_ids=ids)
        if return_attention_mask:
            out["attention_mask"] = masks
        if return_tensors:
            out = BatchEncoding({k: _tensor(v if not isinstance(text, str) else [v],
                                            return_tensors) for k, v in out.items()})
        return out

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return self.convert_ids_to_tokens(self.tokenizer.encode(text, add_special_tokens))

    # ---- ids -> text -----------------------------------------------------------------------
    def decode(self, token_ids: int | Sequence[int] | torch.Tensor,
               skip_special_tokens: bool = False, **kwargs: Any) -> str:
        """The text of ``token_ids`` (transformers' default ``skip_special_tokens=False``;
        ``clean_up_tokenization_spaces`` defaults to the tokenizer config's, as there)."""
        ids = _ids(token_ids)
        text = self.tokenizer.decode([ids] if isinstance(ids, int) else ids, skip_special_tokens)
        clean = kwargs.get("clean_up_tokenization_spaces")
        if clean is None:
            clean = self.tokenizer.config.get("clean_up_tokenization_spaces", False)
        return _clean_up(text) if clean else text

    def batch_decode(self, sequences: Sequence[Sequence[int]] | torch.Tensor,
                     skip_special_tokens: bool = False, **kwargs: Any) -> list[str]:
        return [self.decode(s, skip_special_tokens, **kwargs) for s in _ids(sequences)]

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False
                              ) -> str | list[str]:
        ids = _ids(ids)
        if isinstance(ids, int):
            return self.tokenizer.id_to_piece(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.tokenizer.id_to_piece(i) for i in ids if i not in special]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int] | None:
        if isinstance(tokens, str):
            return self.tokenizer.backend.token_to_id(tokens)
        return [self.tokenizer.backend.token_to_id(t) for t in tokens]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.tokenizer.backend.decoder.decode(tokens)

    # ---- chat ------------------------------------------------------------------------------
    def apply_chat_template(self, conversation: list[dict[str, Any]] | list[list[dict[str, Any]]],
                            tools: list[dict[str, Any]] | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True,
                            return_tensors: str | None = None, return_dict: bool = False,
                            **kwargs: Any) -> Any:
        """transformers' signature and defaults (``tokenize=True``, no generation prompt); the
        text is what ``LLM.chat`` renders (samebits.text.chat_template); ``kwargs`` are extra
        template variables."""
        batched = bool(conversation) and isinstance(conversation[0], list | tuple)
        texts = [render_chat(self.tokenizer, list(c), tools, chat_template, kwargs,
                             add_generation_prompt, continue_final_message)
                 for c in (conversation if batched else [conversation])]
        if not tokenize:
            return texts if batched else texts[0]
        if return_dict:
            return self(texts if batched else texts[0], add_special_tokens=False,
                        padding=bool(return_tensors) and batched, return_tensors=return_tensors)
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        if return_tensors:
            return _tensor(ids, return_tensors)
        return ids if batched else ids[0]

    # ---- helpers ---------------------------------------------------------------------------
    def _truncate(self, ids: list[int], truncation: bool | str, max_length: int | None
                  ) -> list[int]:
        if not truncation or truncation == "do_not_truncate":
            return ids
        limit = max_length if max_length is not None else self.model_max_length
        if len(ids) <= limit:
            return ids
        return ids[:limit] if self.truncation_side == "right" else ids[len(ids) - limit:]

    def _pad(self, ids: list[list[int]], masks: list[list[int]], padding: bool | str,
             max_length: int | None, side: str | None) -> tuple[list[list[int]], list[list[int]]]:
        if padding == "do_not_pad":
            return ids, masks
        if self.pad_token is None:
            raise ValueError("padding needs a pad token; this tokenizer has none")
        width = max_length if padding == "max_length" and max_length else max(map(len, ids))
        pad, left = self.pad_token_id, (side or self.padding_side) == "left"
        out_ids, out_masks = [], []
        for seq, mask in zip(ids, masks, strict=True):
            n = max(width - len(seq), 0)
            out_ids.append([pad] * n + seq if left else seq + [pad] * n)
            out_masks.append([0] * n + mask if left else mask + [0] * n)
        return out_ids, out_masks


def _clean_up(text: str) -> str:
    """transformers' ``clean_up_tokenization``: no space before punctuation and contractions."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                 (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def _ids(value: Any) -> Any:
    """Token ids as Python ints (a tensor or numpy array becomes lists)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def _tensor(rows: list[list[int]], kind: str) -> torch.Tensor:
    if kind != "pt":
        raise ValueError(f"return_tensors={kind!r} is not supported; samebits returns 'pt' "
                         "(torch) tensors or lists")
    if len({len(r) for r in rows}) > 1:
        raise ValueError("sequences of different lengths cannot form one tensor: pass "
                         "padding=True")
    return torch.tensor(rows, dtype=torch.long)
