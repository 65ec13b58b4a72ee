"""Structured output: grammar-constrained decoding with xgrammar, one matcher per request.

Backend choice. xgrammar and llguidance were both tried on this CPU (2 cores, the default model's
49152-token byte-level vocabulary; ``benchmarks/grammar_backends.py`` prints the figures): both
compile a JSON schema or a regex in 1-35 ms, but xgrammar fills a token mask 5-18x faster (0.04-0.08
ms per token against 0.40-1.42 ms for llguidance, JSON object / schema / regex), sets up faster
(0.7 s with its import against 1.1 s), speaks the EBNF/GBNF grammars vLLM clients send as
``grammar`` (and Lark), and is what vLLM and SGLang use by default. So: xgrammar.

Invariance. A request's matcher is built from its own constraint and advanced only by its own
accepted tokens; its mask is filled into its own bitmask row and applied to its own logits row
(elementwise: a disallowed token becomes -inf). Nothing reads a neighbour's row, so a constrained
request's bits are the same alone or in any batch.

Interface: ``GrammarCompiler(tokenizer, vocab_size, stop_token_ids)`` compiles a
``StructuredOutputsParams`` (cached by its canonical spec; an invalid one raises ``ValueError``
naming what is wrong) and hands out a ``GrammarState`` per request. ``apply_grammar_masks(logits,
seqs)`` returns the logits with every constrained row masked (a copy; the input, whose
``log_softmax`` is the reported logprobs, is never modified). The engine calls
``GrammarState.accept`` on each generated token and finishes the request with "stop" once the
grammar has terminated (it accepted a stop token after a complete output).

JSON is generated without free whitespace (xgrammar's ``any_whitespace=False``: separators
``", "`` and ``": "``), so a small model cannot loop on blanks; schemas are compiled in strict mode
(``additionalProperties`` false unless the schema says otherwise), as vLLM does.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import torch

from samebits.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from samebits.engine.sequence import Sequence
    from samebits.text.tokenizer import Tokenizer

CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first
_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
          "json_object": "JSON object"}
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"token {token} was sampled outside the grammar's mask")

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


class GrammarCompiler:
    """Compiles constraints against one tokenizer; thread-safe (the server validates requests on
    its event loop while the engine thread compiles the same specs, then hits the cache)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Seq[int]) -> None:
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._stop = sorted(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler: Any = None  # built on first use: xgrammar loads only when needed
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def _xgr(self) -> Any:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError:
                    raise ValueError("structured output needs xgrammar: pip install "
                                     "'samebits[structured]'") from None
                tok = self._tokenizer
                vocab = [tok.id_to_piece(i) or "" for i in range(tok.vocab_size)]
                vocab += [""] * (self._vocab_size - len(vocab))
                meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.backend_json())
                info = xgr.TokenizerInfo(vocab[:self._vocab_size], meta["vocab_type"],
                                         vocab_size=self._vocab_size, stop_token_ids=self._stop,
                                         add_prefix_space=meta["add_prefix_space"])
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec``; ``ValueError`` if the constraint is invalid."""
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(*key)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, kind: str, text: str) -> Any:
        compiler = self._xgr()
        try:
            if kind == "json":
                return compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                rule = " | ".join(_ebnf_string(c) for c in json.loads(text))
                return compiler.compile_grammar(f"root ::= {rule}")
            if "::=" in text:
                return compiler.compile_grammar(text)
            return compiler.compile_lark(text)
        except (RuntimeError, ValueError) as e:  # xgrammar reports C++ errors as RuntimeError
            raise ValueError(f"invalid {_NAMES[kind]}: {_clean(e)}") from None

    def state(self, spec: StructuredOutputsParams) -> GrammarState:
        import xgrammar as xgr
        return GrammarState(xgr.GrammarMatcher(self.compile(spec)))


def apply_grammar_masks(logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    """logits [B, V] -> a copy with each constrained row's disallowed tokens at -inf (row i is
    seqs[i]'s); the input itself when no row is constrained."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not rows:
        return logits
    import xgrammar as xgr
    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[-1])
    for j, i in enumerate(rows):
        seqs[i].grammar.fill(bitmask, j)
    allowed = _unpack(bitmask.to(logits.device), logits.shape[-1])
    masked = logits.clone()
    idx = torch.tensor(rows, device=logits.device)
    masked[idx] = logits[idx].masked_fill(~allowed, -torch.inf)
    return masked


def _unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask [R, ceil(V/32)] (bit b of word w: token 32w+b allowed) -> bool [R, V]."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = (bitmask[:, :, None] >> bits) & 1
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _ebnf_string(text: str) -> str:
    """A literal in xgrammar's EBNF (JSON string escapes)."""
    return json.dumps(text, ensure_ascii=False)


def _clean(e: Exception) -> str:
    message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    message = message.split(" The JSON string is:")[0]  # never echo the request back
    return _CPP_PREFIX.sub("", message).strip()
