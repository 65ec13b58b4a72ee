"""Tile sweep of the invariant linear at decode sizes (M <= 64), against cuBLAS and the byte floor.
JSON lines, one per (shape, M, config); a summary line per (shape, M) with the best config.

    python benchmarks/decode_gemv.py
    python benchmarks/decode_gemv.py --shapes 2048,5120 4096,2048 2048,128 --m 1  # Qwen3-30B-A3B

Tiles never change the bits on Hopper (tests/gpu/test_linear_bits.py), so the sweep is free to
pick by speed. Times are CUDA-graph replays with the L2 flushed before each (do_bench), so the
weights come from HBM as in a decode step. Floor: weight bytes / measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from kernels import us

from samebits.ops.triton import linear as L
from samebits.tools.roofline import copy_bandwidth

SHAPES = [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096), (4096, 151936)]


def candidates() -> list[L.GemmConfig]:
    out = []
    for bn, bk, warps, stages in itertools.product((16, 32, 64, 128), (128, 256, 512), (4, 8),
                                                   (3, 4, 6)):
        if bn * bk <= 64 * 512 and not (bk == 512 and stages == 6):
            out.append(L.GemmConfig(16, bn, bk, warps, stages))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=[f"{k},{n}" for k, n in SHAPES],
                   help="weight shapes as K,N")
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 64], help="rows")
    args = p.parse_args()
    bw = copy_bandwidth()
    for k, n in (map(int, shape.split(",")) for shape in args.shapes):
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
        floor = n * k * 2 / bw * 1e6
        for m in args.m:
            x = torch.randn(m, k, device="cuda").bfloat16()
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            stock = us(F.linear, x, w, rep=30)
            default = us(L.linear, x, w, rep=30)
            best = (float("inf"), None)
            for cfg in candidates():
                try:
                    t = us(L.run, x, w, None, out, cfg, 1, rep=20)
                except Exception as e:  # noqa: BLE001 (a tile that does not fit)
                    print(json.dumps({"skipped": cfg.__dict__, "error": str(e)[:60]}), flush=True)
                    continue
                best = min(best, (t, cfg), key=lambda b: b[0])
            print(json.dumps({"shape": [m, k, n], "floor_us": round(floor, 1),
                              "cublas_us": round(stock, 1), "default_us": round(default, 1),
                              "default_cfg": L.pick_config(m, n, k, x.dtype, plain_tma=True).__dict__,
                              "best_us": round(best[0], 1), "best_cfg": best[1].__dict__,
                              "best_over_floor": round(best[0] / floor, 3)}), flush=True)
        del w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
