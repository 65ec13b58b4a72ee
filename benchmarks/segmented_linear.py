"""Cost of the segmented K (the default row-parallel arithmetic: o_proj, down_proj) on CUDA.

For Qwen3-8B's row-parallel shapes -- TP 1 (K over all S = 8 KV-head segments) and a TP 2 rank
(its K half, 4 segments) -- prints one JSON line per (shape, M): the segmented Triton linear as
``linear`` picks it (above 64 rows: ``_segmented_tma_kernel``), the split schedule (the pointer
kernel's per-segment partials + the tree sum kernel), the one-segment Triton linear and cuBLAS
(``F.linear``) on the same inputs in the same run (CUDA events, median of 20), with the ratios.

    PYTHONPATH=$PWD python benchmarks/segmented_linear.py [--tokens 512 8192]

Tile sweep of the segmented TMA kernel (each config a JSON line; BLOCK_K must divide a segment):

    PYTHONPATH=$PWD python benchmarks/segmented_linear.py --tokens 512 2048 8192 --sweep
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from samebits.ops.backend import row_parallel_bounds
from samebits.ops.triton import linear as L

SHAPES = {"o_proj": (4096, 4096, 8), "down_proj": (12288, 4096, 8),  # (K, N, segments)
          "o_proj_tp2": (2048, 4096, 4), "down_proj_tp2": (6144, 4096, 4)}
SWEEP = [L.GemmConfig(bm, bn, bk, warps, stages, group, tma=True)
         for bm, bn, warps in ((128, 128, 8), (128, 64, 8), (64, 128, 8), (64, 128, 4),
                               (128, 64, 4), (64, 64, 4), (64, 256, 8))
         for bk in (64, 128) for stages in (3, 4, 5) for group in (8,)]


def _us(fn, *args, **kwargs) -> float:
    for _ in range(3):
        fn(*args, **kwargs)
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args, **kwargs)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def _row(name: str, k: int, n: int, segs: int, m: int) -> dict:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bounds = row_parallel_bounds(k, segs)
    layout = L.SegmentLayout.from_bounds(bounds, k)
    seg = _us(L.linear, x, w, None, bounds)
    split = _us(lambda: L.sum_tree(L.partials(x, w, bounds), x.dtype))  # partials, then the sum
    one, stock = _us(L.linear, x, w), _us(F.linear, x, w)
    cfg = L.segmented_config(m, n, k, x.dtype, layout)
    return {"bench": "segmented_linear", "shape": name, "m": m, "k": k, "n": n,
            "segments": segs, "schedule": _schedule(x, w, cfg, layout),
            "segmented_us": round(seg, 1), "split_us": round(split, 1),
            "one_segment_us": round(one, 1), "cublas_us": round(stock, 1),
            "segmented_over_one_segment": round(seg / one, 3),
            "segmented_over_cublas": round(seg / stock, 3),
            "split_over_cublas": round(split / stock, 3)}


def _schedule(x: torch.Tensor, w: torch.Tensor, cfg: L.GemmConfig,
              layout: L.SegmentLayout) -> str:
    """The schedule and tile ``run`` takes for x @ w.T over ``layout`` with ``cfg``."""
    plan = L.plan_of(x, w, cfg, layout)
    return f"{plan.schedule} {plan.tail} {plan.options}"


def _sweep(name: str, k: int, n: int, segs: int, m: int) -> None:
    """Each SWEEP config of the segmented TMA kernel whose BLOCK_K divides a segment, checked
    bitwise against the split schedule (partials, then the sum), timed against cuBLAS; each
    line names the tile that ran (the plan halves BLOCK_K where shared memory overflows)."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bounds = row_parallel_bounds(k, segs)
    layout = L.SegmentLayout.from_bounds(bounds, k)
    want = L.sum_tree(L.partials(x, w, bounds), x.dtype)
    stock = _us(F.linear, x, w)
    for cfg in SWEEP:
        if not layout.even(k, cfg.block_k):
            continue
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        try:
            us = _us(L.run, x, w, None, out, cfg, layout)
        except Exception as e:  # noqa: BLE001 - a config the compiler refuses (shared memory)
            print(json.dumps({"bench": "segmented_sweep", "shape": name, "m": m,
                              "cfg": str(cfg), "error": type(e).__name__}), flush=True)
            continue
        print(json.dumps({"bench": "segmented_sweep", "shape": name, "m": m, "segments": segs,
                          "cfg": str(cfg), "ran": _schedule(x, w, cfg, layout),
                          "us": round(us, 1), "cublas_us": round(stock, 1),
                          "over_cublas": round(us / stock, 3),
                          "bits_equal": torch.equal(out, want)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 512, 2048, 8192])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="time every SWEEP tile config")
    args = ap.parse_args()
    for name in args.shapes:
        k, n, segs = SHAPES[name]
        for m in args.tokens:
            if args.sweep:
                _sweep(name, k, n, segs, m)
            else:
                print(json.dumps(_row(name, k, n, segs, m)), flush=True)


if __name__ == "__main__":
    main()
