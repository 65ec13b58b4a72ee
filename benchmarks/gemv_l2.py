"""Does a batch-1 decode product run faster when its weights are already in L2? JSON lines.

    python benchmarks/gemv_l2.py

For each batch-1 product of a Qwen3-30B-A3B decode step (bf16), one CUDA graph of CALLS calls is
timed twice, captured as the engine captures (``as_captured``: programmatic dependent launch and
the GEMVs' weight prefetch): over COPIES distinct weight copies (every call reads HBM: the copies
are more bytes than L2 holds) and over one copy (every call after the first reads L2).

``l2_to_hbm`` near 1 says the product is bound by its programs' own chain of latencies, not by
where its weights are: then asking L2 for weights ahead cannot help it, and only weights held on
chip before the input exists can. ``hbm_to_copy`` is the HBM run's time against the weight bytes
at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import graph_timer  # noqa: E402

from samebits.ops.backend import get_backend, row_parallel_bounds  # noqa: E402
from samebits.ops.triton import moe as triton_moe  # noqa: E402
from samebits.tools.roofline import copy_bandwidth  # noqa: E402

CALLS, COPIES = 16, 6
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, INTER, TOP_K = 2048, 32, 4, 128, 128, 768, 8


def graph_us(calls: list) -> float:
    """Microseconds per call of ``calls`` (CALLS closures) replayed from one captured graph."""
    cycle = itertools.cycle(calls)
    return graph_timer.graph_us(lambda: next(cycle)(), reps=len(calls), captured=True)


def dense(name: str, k: int, n: int, chains: int | None) -> tuple[str, int, list, list]:
    ops = get_backend("cuda", True)
    x = torch.randn(1, k, device="cuda").bfloat16()
    ws = [(torch.randn(n, k, device="cuda") / 64).bfloat16() for _ in range(COPIES)]
    kb = row_parallel_bounds(k, chains) if chains else None

    def calls(copies: int) -> list:
        return [lambda w=ws[i % copies]: ops.linear(x, w, k_bounds=kb) for i in range(CALLS)]
    return name, n * k * 2, calls(COPIES), calls(1)


def experts(name: str, gated: bool) -> tuple[str, int, list, list]:
    """The copies differ by which experts they read: ids shifted by one expert a copy."""
    rows, k = (2 * INTER, HIDDEN) if gated else (HIDDEN, INTER)
    x = torch.randn(1 if gated else TOP_K, k, device="cuda").bfloat16()
    w = (torch.randn(EXPERTS, rows, k, device="cuda") / 45).bfloat16()
    out = torch.empty(TOP_K, INTER if gated else HIDDEN, device="cuda").bfloat16()
    # no preload: it would overlap a call with the one before it, not time one call alone
    cfg = dataclasses.replace(triton_moe.pick_config(TOP_K, EXPERTS, torch.bfloat16, gated),
                              preload=0)
    base = torch.arange(TOP_K, device="cuda", dtype=torch.int32) * (COPIES + 1)
    ids = [(base + c).contiguous() for c in range(COPIES)]

    def calls(copies: int) -> list:
        return [lambda i=ids[j % copies]: triton_moe.moe_gemm(x, w, out, None, i, TOP_K, gated,
                                                               cfg) for j in range(CALLS)]
    return name, TOP_K * rows * k * 2, calls(COPIES), calls(1)


def main() -> None:
    bandwidth = copy_bandwidth(torch.device("cuda"))
    products = [dense("qkv", HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, None),
                dense("o_proj (2 chains)", HEADS * HEAD_DIM, HIDDEN, 2),
                experts("gate/up (8 experts)", True),
                experts("down (8 experts)", False)]
    for name, nbytes, hbm_calls, l2_calls in products:
        hbm_us, l2_us = graph_us(hbm_calls), graph_us(l2_calls)
        print(json.dumps({"bench": "gemv_l2", "device": torch.cuda.get_device_name(),
                          "product": name, "weight_mb": round(nbytes / 1e6, 2),
                          "hbm_us": round(hbm_us, 2), "l2_us": round(l2_us, 2),
                          "l2_to_hbm": round(l2_us / hbm_us, 3),
                          "hbm_to_copy": round(hbm_us / (nbytes / bandwidth * 1e6), 3)}),
              flush=True)


if __name__ == "__main__":
    main()
