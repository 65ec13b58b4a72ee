"""xgrammar vs llguidance on the default model's tokenizer: set-up, compile and per-token mask
time for the same constraints, one JSON line each (what samebits/engine/grammar.py chose by).

    PYTHONPATH=$PWD python benchmarks/grammar_backends.py
"""

from __future__ import annotations

import json
import time

from samebits.loader import resolve_model_dir
from samebits.text.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}
CASES = [("json_object", {"type": "object"}, '{"name": "Bob", "age": 31}'),
         ("json_schema", SCHEMA, '{"name": "Bob", "age": 31}'),
         ("regex", r"\d{3}-[a-z]+", "123-abc")]
REPEATS = 20


def _per_token_ms(fill, accept, ids: list[int]) -> float:
    t = time.perf_counter()
    for _ in range(REPEATS):
        state = fill(None)
        for i in ids:
            fill(state)
            accept(state, i)
        fill(state)
    return (time.perf_counter() - t) / (REPEATS * (len(ids) + 1)) * 1e3


def bench_xgrammar(tok: Tokenizer) -> None:
    import xgrammar as xgr
    t = time.perf_counter()
    vocab = [tok.id_to_piece(i) or "" for i in range(tok.vocab_size)]
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.backend_json())
    info = xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=tok.vocab_size,
                             stop_token_ids=list(tok.eos_token_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - t
    bitmask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    for name, spec, text in CASES:
        t = time.perf_counter()
        g = (compiler.compile_regex(spec) if name == "regex"
             else compiler.compile_json_schema(json.dumps(spec)))
        compile_s = time.perf_counter() - t

        def fill(m, g=g):
            if m is None:
                return xgr.GrammarMatcher(g)
            m.fill_next_token_bitmask(bitmask)
        ms = _per_token_ms(fill, lambda m, i: m.accept_token(i), tok.encode(text))
        print(json.dumps({"backend": "xgrammar", "case": name, "tokenizer_setup_s": round(setup, 4),
                          "compile_s": round(compile_s, 5), "mask_ms_per_token": round(ms, 4)}))


def bench_llguidance(tok: Tokenizer) -> None:
    import llguidance as llg
    import llguidance.torch as lt
    t = time.perf_counter()
    lltok = llg.LLTokenizer(tok.backend_json(), n_vocab=tok.vocab_size,
                            eos_token=list(tok.eos_token_ids))
    setup = time.perf_counter() - t
    bitmask = lt.allocate_token_bitmask(1, tok.vocab_size)
    for name, spec, text in CASES:
        t = time.perf_counter()
        grammar = (llg.LLMatcher.grammar_from_regex(spec) if name == "regex"
                   else llg.LLMatcher.grammar_from_json_schema(json.dumps(spec)))
        llg.LLMatcher(lltok, grammar)
        compile_s = time.perf_counter() - t

        def fill(m, grammar=grammar):
            if m is None:
                return llg.LLMatcher(lltok, grammar)
            lt.fill_next_token_bitmask(m, bitmask, 0)
        ms = _per_token_ms(fill, lambda m, i: m.consume_token(i), tok.encode(text))
        print(json.dumps({"backend": "llguidance", "case": name,
                          "tokenizer_setup_s": round(setup, 4), "compile_s": round(compile_s, 5),
                          "mask_ms_per_token": round(ms, 4)}))


def main() -> None:
    tok = Tokenizer.from_dir(resolve_model_dir(None))
    for bench in (bench_xgrammar, bench_llguidance):
        try:
            bench(tok)
        except ImportError as e:
            print(json.dumps({"backend": bench.__name__.removeprefix("bench_"), "skipped": str(e)}))


if __name__ == "__main__":
    main()
