"""All linears and attentions of one decode step of the default model's shapes (SmolLM2-135M:
30 layers, hidden 576, 9 q / 3 kv heads, d 64, MLP 1536, vocab 49152), invariant C++ kernels
against stock torch, interleaved; the minimum over ``--repeats`` (robust to a loaded machine), ms.

    PYTHONPATH=$PWD python benchmarks/cpu_ops.py --batch 1 16 --context 128
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from samebits.ops import get_backend
from samebits.ops.backend import AttentionMetadata

LAYERS, H, HQ, HKV, D, FF, V = 30, 576, 9, 3, 64, 1536, 49152
SHAPES = [((HQ + 2 * HKV) * D, H), (H, HQ * D), (2 * FF, H), (H, FF)]  # qkv, o, gate_up, down


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _meta(batch: int, context: int, block: int = 16) -> tuple[AttentionMetadata, int]:
    per = -(-context // block)
    tables = torch.arange(batch * per, dtype=torch.int32).view(batch, per)
    meta = AttentionMetadata(tables, torch.full((batch,), context, dtype=torch.int32),
                             torch.arange(batch + 1, dtype=torch.int32),
                             torch.zeros(batch, dtype=torch.int64), (context,) * batch,
                             tuple(range(batch + 1)), block, 128)
    return meta, batch * per


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    weights = [torch.randn(n, k) / k ** 0.5 for n, k in SHAPES]
    head = torch.randn(V, H) * 0.05
    for b in args.batch:
        for mode, inv in (("invariant", True), ("standard", False)):
            ops = get_backend("cpu", inv)
            x = {k: torch.randn(b, k) for k in (H, FF)}

            def linears(ops=ops, x=x) -> None:
                for _ in range(LAYERS):
                    for w in weights:
                        ops.linear(x[w.shape[1]], w)
                ops.linear(x[H], head)
            meta, blocks = _meta(b, args.context)
            meta = ops.plan_attention(meta)
            kc, vc = torch.randn(blocks, 16, HKV, D), torch.randn(blocks, 16, HKV, D)
            q = torch.randn(b, HQ, D)

            def attention(ops=ops, meta=meta, kc=kc, vc=vc, q=q) -> None:
                for _ in range(LAYERS):
                    ops.attention(q, kc, vc, meta, D ** -0.5)
            print(json.dumps({"bench": "cpu_ops", "mode": mode, "batch": b, "context": args.context,
                              "linears_ms": round(_best(linears, args.repeats), 2),
                              "attention_ms": round(_best(attention, args.repeats), 2)}), flush=True)


if __name__ == "__main__":
    main()
