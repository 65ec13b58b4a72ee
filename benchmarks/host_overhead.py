"""Eager wall time against GPU time, invariant op vs stock op, same run. JSON lines.

    python benchmarks/host_overhead.py            # linear at Qwen3-8B shapes, M <= 128; rms_norm
    python benchmarks/host_overhead.py --cprofile # where the host time of one op goes

``wall_us``: microseconds per call of N back-to-back eager calls followed by one synchronize (what
an eager caller -- override mode, prefill, the trainer -- pays per op; the larger of host and GPU
time). ``gpu_us``: the same call replayed from a CUDA graph (no host work). ``host_us``: the host
time per call alone (the loop's time before the final synchronize, the GPU kept busy). Ratios:
invariant / stock (target: wall <= 1.1x).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import samebits.ops as ops

LINEAR = [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)]
MS = [1, 16, 64, 128]


def gpu_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return do_bench(g.replay, warmup=10, rep=50, return_mode="median") * 1e3


def wall_and_host_us(fn, n: int = 300) -> tuple[float, float]:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    best_wall, best_host = float("inf"), float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        best_wall, best_host = min(best_wall, (t2 - t0) / n), min(best_host, (t1 - t0) / n)
    return best_wall * 1e6, best_host * 1e6


def row(op: str, shape: dict, inv, stock) -> dict:
    (iw, ih), (sw, sh) = wall_and_host_us(inv), wall_and_host_us(stock)
    ig, sg = gpu_us(inv), gpu_us(stock)
    r = {"op": op, **shape, "invariant_wall_us": round(iw, 1), "stock_wall_us": round(sw, 1),
         "ratio_wall": round(iw / sw, 3), "invariant_host_us": round(ih, 1),
         "stock_host_us": round(sh, 1), "invariant_gpu_us": round(ig, 1),
         "stock_gpu_us": round(sg, 1), "ratio_gpu": round(ig / sg, 3)}
    print(json.dumps(r), flush=True)
    return r


def bench(args: argparse.Namespace) -> list[dict]:
    rows = []
    for k, n in LINEAR:
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
        for m in MS:
            x = torch.randn(m, k, device="cuda").bfloat16()
            rows.append(row("linear", {"M": m, "K": k, "N": n},
                            lambda x=x, w=w: ops.linear(x, w), lambda x=x, w=w: F.linear(x, w)))
    h = 4096
    wn = torch.randn(h, device="cuda").bfloat16()
    for m in MS:
        x = torch.randn(m, h, device="cuda").bfloat16()
        rows.append(row("rms_norm", {"M": m, "H": h}, lambda x=x: ops.rms_norm(x, wn, 1e-6),
                        lambda x=x: F.rms_norm(x, (h,), wn, 1e-6)))
    return rows


def cprofile(n: int = 2000) -> None:
    """Top host functions of ``n`` linear calls (M=16, 4096x4096) and ``n`` rms_norm calls."""
    x = torch.randn(16, 4096, device="cuda").bfloat16()
    w = torch.randn(4096, 4096, device="cuda").bfloat16()
    wn = torch.randn(4096, device="cuda").bfloat16()
    for name, fn in (("linear", lambda: ops.linear(x, w)),
                     ("rms_norm", lambda: ops.rms_norm(x, wn, 1e-6))):
        fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"== {name}: {n} calls")
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cprofile", action="store_true")
    args = p.parse_args()
    if args.cprofile:
        cprofile()
        return
    rows = bench(args)
    worst = {op: max(r["ratio_wall"] for r in rows if r["op"] == op) for op in ("linear", "rms_norm")}
    print(json.dumps({"bench": "host_overhead", "device": torch.cuda.get_device_name(),
                      "worst_ratio_wall": worst}))


if __name__ == "__main__":
    main()
