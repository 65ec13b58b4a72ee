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
``StructuredOutputsParams`` and hands out a ``GrammarState`` per request. ``compile`` checks the
constraint's size first (``samebits.engine.grammar_limits``), refuses a constraint whose first
token mask is empty (no output can satisfy it), and keeps compiled grammars in a cache bounded in
bytes (least recently used dropped first); every refusal is a ``ValueError`` naming the cause.
``compile_async`` runs ``compile`` in the compiler's own threads (never the event loop's default
pool, which tokenization uses), one compile per distinct constraint however many requests wait
for it, and gives up after ``timeout_s`` with a ``ValueError``. ``apply_grammar_masks(logits,
seqs)`` returns the logits with every constrained row masked (a copy; the input, whose
``log_softmax`` is the reported logprobs, is never modified) and raises ``GrammarError`` when a
constrained row has no allowed token. The engine calls ``GrammarState.accept`` on each generated
token and finishes the request with "stop" once the grammar has terminated (it accepted a stop
token after a complete output).

JSON is generated without free whitespace (xgrammar's ``any_whitespace=False``: separators
``", "`` and ``": "``), so a small model cannot loop on blanks; schemas are compiled in strict mode
(``additionalProperties`` false unless the schema says otherwise), as vLLM does.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import torch

from samebits.engine.grammar_limits import check_limits
from samebits.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from samebits.text.tokenizer import Tokenizer

CACHE_BYTES = 64 << 20  # compiled grammars kept (their xgrammar memory_size_bytes)
COMPILE_TIMEOUT_S = 10.0  # compile_async gives up after this long
COMPILE_THREADS = 2  # the compiler's own threads (xgrammar releases the GIL while compiling)
_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
          "json_object": "JSON object"}
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarError(RuntimeError):
    """A constrained request cannot go on (its mask allows no token): that request fails."""


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):  # every token the grammar allows was forbidden
            raise GrammarError(f"the output constraint does not allow token {token}, and "
                               "min_tokens, stop_token_ids or logit_bias forbade every token it "
                               "allows")

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


class GrammarCompiler:
    """Compiles constraints against one tokenizer; thread-safe (the server compiles at admission
    in the compiler's threads, then the engine thread finds the grammar in the cache)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Seq[int],
                 cache_bytes: int = CACHE_BYTES, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._stop = sorted(stop_token_ids)
        self.cache_bytes, self.timeout_s = cache_bytes, timeout_s
        self._lock = threading.Lock()
        self._compiler: Any = None  # built on first use: xgrammar loads only when needed
        self._cache: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self._cached_bytes = 0
        self._pending: dict[tuple[str, str], Future] = {}  # compiles in flight, by key
        self._pool: ThreadPoolExecutor | None = None

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
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec``; ``ValueError`` if the constraint is over a limit,
        invalid, or allows no first token."""
        check_limits(spec)
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key][0]
        compiled = self._compile(*key)
        if not _first_mask_allows_any(compiled, self._vocab_size):
            raise ValueError(f"no output satisfies this {_NAMES[key[0]]}: it allows no first "
                             "token")
        self._remember(key, compiled)
        return compiled

    def _remember(self, key: tuple[str, str], compiled: Any) -> None:
        """Cache ``compiled``, then drop the least recently used entries past ``cache_bytes`` (an
        entry larger than the whole budget is not kept)."""
        size = int(compiled.memory_size_bytes)
        with self._lock:
            if key in self._cache or size > self.cache_bytes:
                return
            self._cache[key] = (compiled, size)
            self._cached_bytes += size
            while self._cached_bytes > self.cache_bytes:
                self._cached_bytes -= self._cache.popitem(last=False)[1][1]

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """``compile(spec)`` in the compiler's own threads; requests for a constraint already
        being compiled share that compile. A constraint over a limit raises ``ValueError`` here."""
        check_limits(spec)  # bounded work: it gives up past the limits, before key()
        key = spec.key()
        with self._lock:
            if key in self._pending:
                return self._pending[key]
            if self._pool is None:
                self._pool = ThreadPoolExecutor(COMPILE_THREADS, "samebits-grammar")
            future = self._pool.submit(self.compile, spec)
            self._pending[key] = future
        future.add_done_callback(lambda _: self._forget(key))
        return future

    def _forget(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._pending.pop(key, None)

    async def compile_async(self, spec: StructuredOutputsParams) -> Any:
        """``compile`` off the event loop, bounded by ``timeout_s`` (past it: ``ValueError``;
        the compile goes on and its result is cached for the next request)."""
        compiled = asyncio.wrap_future(self.submit(spec))  # shared: never cancelled from here
        compiled.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, if late
        try:
            return await asyncio.wait_for(asyncio.shield(compiled), self.timeout_s)
        except TimeoutError:
            raise ValueError(f"the {_NAMES[spec.kind]} did not compile within "
                             f"{self.timeout_s:g} s; simplify it") from None

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
        except (RuntimeError, ValueError, UnicodeError) as e:  # xgrammar: C++ errors are
            raise ValueError(f"invalid {_NAMES[kind]}: {_clean(e)}") from None  # RuntimeError

    def state(self, spec: StructuredOutputsParams) -> GrammarState:
        import xgrammar as xgr
        return GrammarState(xgr.GrammarMatcher(self.compile(spec)))


def _first_mask_allows_any(compiled: Any, vocab_size: int) -> bool:
    import xgrammar as xgr
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    return bool(_unpack(bitmask, vocab_size).any())


class Constrained(Protocol):
    """What the masks read of a sequence: its matcher, or None when unconstrained."""

    grammar: GrammarState | None


def apply_grammar_masks(logits: torch.Tensor, seqs: Seq[Constrained]) -> torch.Tensor:
    """logits [B, V] -> a copy with each constrained row's disallowed tokens at -inf (row i is
    seqs[i]'s); the input itself when no row is constrained. ``GrammarError`` when a constrained
    row allows no token (its request cannot go on)."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not rows:
        return logits
    import xgrammar as xgr
    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[-1])
    for j, i in enumerate(rows):
        seqs[i].grammar.fill(bitmask, j)
    if not bool((bitmask != 0).any(dim=-1).all()):
        raise GrammarError("the output constraint allows no next token")
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
