"""The invariant CPU kernels against stock torch on the default model's shapes (SmolLM2-135M:
hidden 576, 9 q / 3 kv heads, d 64, MLP 1536, vocab 49152), one JSON line per case.

Each case times the invariant op and the stock op interleaved in the same run and reports the
minimum over ``--repeats`` of each (robust to a loaded machine), in ms, with their ratio
(invariant / stock: below 1 means the invariant kernel is faster):

- ``linear``: every projection of one layer and the LM head, at M = ``--rows`` rows each;
- ``attention``: one layer's attention of a ``--chunk``-query prefill chunk at ``--context``, and
  of a decode step of ``--decode-batch`` sequences at ``--context``.

    PYTHONPATH=$PWD python benchmarks/cpu_ops.py --rows 1 16 128 --context 3000
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from samebits.ops import get_backend
from samebits.ops.backend import AttentionMetadata

H, HQ, HKV, D, FF, V = 576, 9, 3, 64, 1536, 49152
SHAPES = {"qkv": ((HQ + 2 * HKV) * D, H), "o": (H, HQ * D), "gate_up": (2 * FF, H),
          "down": (H, FF), "lm_head": (V, H)}
INV, STD = get_backend("cpu", True), get_backend("cpu", False)


def _interleaved(fns, repeats: int) -> list[float]:
    """Minimum ms of each function, the functions called in turn ``repeats`` times."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return [b * 1e3 for b in best]


def _report(case: dict, inv_ms: float, std_ms: float) -> None:
    print(json.dumps({"bench": "cpu_ops", **case, "invariant_ms": round(inv_ms, 3),
                      "stock_ms": round(std_ms, 3), "ratio": round(inv_ms / std_ms, 2)}),
          flush=True)


def bench_linear(rows: int, repeats: int) -> None:
    for name, (n, k) in SHAPES.items():
        w, x = torch.randn(n, k) / k ** 0.5, torch.randn(rows, k)
        inv, std = _interleaved([lambda x=x, w=w: INV.linear(x, w),
                                 lambda x=x, w=w: STD.linear(x, w)], repeats)
        flop = 2 * rows * n * k
        _report({"op": "linear", "shape": name, "M": rows, "N": n, "K": k,
                 "inv_gflops": round(flop / inv / 1e6, 1)}, inv, std)


def _meta(queries: list[int], context: int, block: int = 16) -> tuple[AttentionMetadata, int]:
    """Sequences with ``queries[b]`` new tokens each, all at ``context`` tokens of context."""
    b, per = len(queries), -(-context // block)
    tables = torch.arange(b * per, dtype=torch.int32).view(b, per)
    qsl = [0]
    for n in queries:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(tables, torch.full((b,), context, dtype=torch.int32),
                             torch.tensor(qsl, dtype=torch.int32), torch.zeros(qsl[-1], dtype=torch.int64),
                             (context,) * b, tuple(qsl), block, 128)
    return meta, b * per


def bench_attention(name: str, queries: list[int], context: int, repeats: int) -> None:
    meta, blocks = _meta(queries, context)
    kc, vc = torch.randn(blocks, 16, HKV, D), torch.randn(blocks, 16, HKV, D)
    q = torch.randn(sum(queries), HQ, D)
    inv_meta, std_meta = INV.plan_attention(meta), STD.plan_attention(meta)
    inv, std = _interleaved([lambda: INV.attention(q, kc, vc, inv_meta, D ** -0.5),
                             lambda: STD.attention(q, kc, vc, std_meta, D ** -0.5)], repeats)
    _report({"op": "attention", "case": name, "queries": sum(queries), "seqs": len(queries),
             "context": context}, inv, std)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128])
    p.add_argument("--context", type=int, default=3000)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--decode-batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--only", choices=["linear", "attention"], default=None)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.only != "linear":
        bench_attention("prefill_chunk", [args.chunk], args.context, args.repeats)
        bench_attention("decode", [1] * args.decode_batch, args.context, args.repeats)
    if args.only != "attention":
        for rows in args.rows:
            bench_linear(rows, args.repeats)


if __name__ == "__main__":
    main()
