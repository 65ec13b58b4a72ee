"""Decode tiles of the invariant MoE GEMMs (Qwen3-30B-A3B shapes, bf16): a sweep. JSON lines.

For a decode batch of ``--tokens`` tokens (top-8 of 128 experts, each assignment its own block),
times the gated gate/up GEMM and the down GEMM for each tile config (CUDA events, median), as
GB/s of the expert weights they must read and as a ratio to the copy bandwidth measured here.
The tile never changes the bits (tests/gpu/test_moe_gpu.py); this picks the fastest.

    PYTHONPATH=$PWD python benchmarks/moe_tiles.py --tokens 1 4
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from samebits.ops.triton import moe as M
from samebits.tools.roofline import copy_bandwidth

E, H, INTER, TOP_K = 128, 2048, 768, 8
CONFIGS = [(16, n, k, w, s) for n in (16, 32, 64) for k in (128, 256) for w in (4,) for s in (3, 4, 6)]


def _time(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    args = p.parse_args()
    bw = copy_bandwidth()
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * INTER, H, device="cuda", generator=g) / 45).bfloat16()
    w2 = (torch.randn(E, H, INTER, device="cuda", generator=g) / 28).bfloat16()
    for t in args.tokens:
        for gated in (True, False):
            for c in CONFIGS:
                us, nbytes = _run(t, gated, M.MoeGemmConfig(*c), w13, w2, g)
                print(json.dumps({"bench": "moe_tiles", "tokens": t, "gated": gated,
                                  "config": c, "us": round(us, 2),
                                  "GB_s": round(nbytes / us / 1e3, 1),
                                  "ratio_to_copy": round(nbytes / us / 1e3 / (bw / 1e9), 3)}),
                      flush=True)


def _run(t: int, gated: bool, cfg: M.MoeGemmConfig, w13: torch.Tensor, w2: torch.Tensor,
         g: torch.Generator) -> tuple[float, float]:
    """Median us of one GEMM over 16 routings used in turn (the weights read are not in L2),
    and the mean expert-weight bytes one call must read."""
    a = t * TOP_K
    n, k = (INTER, H) if gated else (H, INTER)
    src = torch.randn(t if gated else a, k, device="cuda", generator=g).bfloat16()
    out = torch.empty(a, n, dtype=torch.bfloat16, device="cuda")
    routes = [torch.stack([torch.randperm(E, device="cuda", generator=g)[:TOP_K]
                           for _ in range(t)]).reshape(-1).to(torch.int32).contiguous()
              for _ in range(16)]
    nbytes = sum(r.unique().numel() for r in routes) / 16 * (2 if gated else 1) * n * k * 2
    turn = [0]

    def call() -> None:
        turn[0] = (turn[0] + 1) % 16
        M.moe_gemm(src, w13 if gated else w2, out, None, routes[turn[0]], TOP_K, gated, cfg)
    return _time(call), nbytes

if __name__ == "__main__":
    main()
