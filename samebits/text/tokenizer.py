"""Tokenizer + chat template from an HF-format directory (tokenizer.json, tokenizer_config.json,
chat_template.jinja, generation_config.json), via the ``tokenizers`` library and a sandboxed jinja2
template. ``samebits.text.hf_tokenizer`` puts transformers' interface over it."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from samebits.config import ModelFormatError, read_json


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, tok: HFTokenizer, config: dict[str, Any], eos_ids: tuple[int, ...]) -> None:
        self._tok = tok
        self.config = config  # tokenizer_config.json as read (GET /tokenizer_info serves it)
        self.pad_token = _token_str(config.get("pad_token"))
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token = _token_str(config.get("eos_token"))
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.chat_template = self._pick_template(config.get("chat_template"))
        ids = set(eos_ids)
        if self.eos_token is not None and tok.token_to_id(self.eos_token) is not None:
            ids.add(tok.token_to_id(self.eos_token))
        self.eos_token_ids = tuple(sorted(ids))
        self.bos_token_id = tok.token_to_id(self.bos_token) if self.bos_token else None

    @staticmethod
    def _pick_template(template: Any) -> str | None:
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            return named.get("default") or next(iter(named.values()), None)
        return template

    @classmethod
    def from_dir(cls, path: Path, eos_ids: tuple[int, ...] = ()) -> Tokenizer | None:
        """None when the directory has no tokenizer.json (dummy-weight configs)."""
        file = path / "tokenizer.json"
        if not file.is_file():
            return None
        try:
            tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ModelFormatError(f"{file}: cannot parse tokenizer ({e})") from None
        tok.no_padding()
        tok.no_truncation()
        cfg_file = path / "tokenizer_config.json"
        config = read_json(cfg_file) if cfg_file.is_file() else {}
        template_file = path / "chat_template.jinja"  # transformers' separate template file
        if not config.get("chat_template") and template_file.is_file():
            config = {**config, "chat_template": template_file.read_text(encoding="utf-8")}
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            eos = read_json(gen_file).get("eos_token_id")
            eos_ids = tuple(eos_ids) + (tuple(eos) if isinstance(eos, list) else
                                        (() if eos is None else (eos,)))
        return cls(tok, config, eos_ids)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> HFTokenizer:
        """The ``tokenizers.Tokenizer`` every method here runs."""
        return self._tok

    def special_token(self, key: str) -> str | None:
        """The text of a special token named in tokenizer_config.json (``eos_token``...)."""
        return _token_str(self.config.get(key))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token text (``<|im_end|>``) always maps to its id, and
        ``add_special_tokens`` adds what the tokenizer adds around a text (its BOS). Through
        ``encode_batch``, which releases the GIL (``encode`` does not), so a long text tokenized
        in a worker thread never stalls the server's event loop; the ids are the same."""
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str | None:
        """The vocabulary entry of one token (byte-level pieces spell bytes: 'Ġ' is a space)."""
        return self._tok.id_to_token(token_id)

    def backend_json(self) -> str:
        """The tokenizer as tokenizers' JSON (what grammar backends read its metadata from)."""
        return self._tok.to_str()

    @property
    def byte_level(self) -> bool:
        return isinstance(self._tok.decoder, decoders.ByteLevel)

    def min_num_tokens(self, text: str) -> int:
        """A certain lower bound on ``len(encode(text))``, without tokenizing: 0 when none is
        known. Exact reasoning: with a byte-level vocabulary, no normalizer and no added token
        that strips whitespace, every token covers at most ``len(its piece)`` characters."""
        longest = self._longest_piece
        return 0 if longest is None else -(-len(text) // longest)

    @cached_property
    def _longest_piece(self) -> int | None:
        tok = self._tok
        stripping = any(t.lstrip or t.rstrip for t in tok.get_added_tokens_decoder().values())
        if not self.byte_level or tok.normalizer is not None or stripping:
            return None
        return max(len(piece) for piece in tok.get_vocab(with_added_tokens=True)) or None

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, *,
                            tools: list[dict[str, Any]] | None = None,
                            template: str | None = None, **kwargs: Any) -> str:
        """Render ``template`` (default: the model's) with ``messages``, ``tools`` and any extra
        template variables ``kwargs`` (a request's ``chat_template_kwargs``)."""
        template = template or self.chat_template
        if not template:
            raise ValueError("this model's tokenizer has no chat template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                   "add_generation_prompt": add_generation_prompt, **kwargs,
                   "messages": messages, "tools": tools}
        try:
            return env.from_string(template).render(**context)
        except TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from None
        except (TypeError, AttributeError, LookupError, ArithmeticError, RecursionError) as e:
            # what the template's own expressions raise on variables it did not expect
            raise ValueError(f"chat template failed: {type(e).__name__}: "
                             f"{str(e)[:200]}") from None


def _raise(message: str) -> None:
    raise TemplateError(message)
