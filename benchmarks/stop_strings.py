"""Per-token cost of the stop-string check, by output length: re-decoding the whole output every
token against the incremental detokenizer (a bounded window and a bounded search). JSON lines.

    python benchmarks/stop_strings.py [--lengths 128 512 2048]
"""

from __future__ import annotations

import argparse
import json
import time

from samebits.loader import resolve_model_dir
from samebits.text.detokenizer import IncrementalDetokenizer
from samebits.text.tokenizer import Tokenizer

TEXT = ("Reproducible inference means that the same request returns the same answer. "
        "Les chats dorment seize heures par jour. 日本語のテキスト 🙂. def f(x): return x * 2\n")
STOPS = ["\n\n\n", "STOP HERE"]  # never found: every token pays the full search


def full_decode(tok: Tokenizer, ids: list[int]) -> float:
    """Seconds for the whole output, checking by decoding everything each token."""
    start = time.perf_counter()
    for i in range(1, len(ids) + 1):
        text = tok.decode(ids[:i])
        _ = [text.find(s) for s in STOPS if s in text]
    return time.perf_counter() - start


def incremental(tok: Tokenizer, ids: list[int]) -> float:
    start = time.perf_counter()
    d = IncrementalDetokenizer(tok, STOPS)
    for t in ids:
        d.find_stop(len(d.push(t)))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    args = p.parse_args(argv)
    tok = Tokenizer.from_dir(resolve_model_dir(None))
    corpus = tok.encode(TEXT * 200)
    for n in args.lengths:
        ids = corpus[:n]
        old, new = full_decode(tok, ids), incremental(tok, ids)
        print(json.dumps({"bench": "stop_strings", "output_tokens": n,
                          "full_decode_us_per_token": round(old / n * 1e6, 1),
                          "incremental_us_per_token": round(new / n * 1e6, 1),
                          "speedup": round(old / new, 2)}), flush=True)


if __name__ == "__main__":
    main()
