"""Cost of the K chains (the row-parallel arithmetic: o_proj, down_proj) on CUDA.

For Qwen3-8B's row-parallel shapes prints one JSON line per (shape, M): the chained Triton linear
as ``linear`` picks it (its schedule named), the split schedule (a partial per chain + the tree sum
kernel), the one-chain Triton linear and cuBLAS (``F.linear``) on the same inputs in the same run
(CUDA-graph replays of 10 calls, median of 15), with the ratios. Shapes: ``o_proj`` /
``down_proj`` at TP 1's two chains (the default on one GPU), ``*_8`` with all 8 KV-head
segments as chains (for comparison), and ``*_tp2``: a TP 2 rank's one chain summed in fp32
(``linear_sum``, what the rank sends) against its bf16 product.

    PYTHONPATH=$PWD python benchmarks/segmented_linear.py [--tokens 1 512 8192] [--shapes o_proj]

Tile sweep of the segmented TMA kernel (each config a JSON line; BLOCK_K must divide a segment):

    PYTHONPATH=$PWD python benchmarks/segmented_linear.py --tokens 512 2048 8192 --sweep
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from samebits.ops.backend import chain_bounds, row_parallel_bounds
from samebits.ops.triton import linear as L

SHAPES = {"o_proj": (4096, 4096, 2), "down_proj": (12288, 4096, 2),  # (K, N, chains)
          "o_proj_8": (4096, 4096, 8), "down_proj_8": (12288, 4096, 8),
          "o_proj_tp2": (2048, 4096, 1), "down_proj_tp2": (6144, 4096, 1)}
SWEEP = [L.GemmConfig(bm, bn, bk, warps, stages, group, tma=True)
         for bm, bn, warps in ((128, 128, 8), (128, 64, 8), (64, 128, 8), (64, 128, 4),
                               (128, 64, 4), (64, 64, 4), (64, 256, 8), (128, 256, 8))
         for bk in (64, 128) for stages in (3, 4, 5, 6) for group in (8,)]


def _us(fn, *args, reps: int = 10) -> float:
    """Microseconds a call: the median of 15 replays of a CUDA graph of ``reps`` calls (launch
    costs as the engine's graphs pay them)."""
    for _ in range(3):
        fn(*args)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn(*args)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(15):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def _row(name: str, k: int, n: int, chains: int, m: int) -> dict:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bounds = chain_bounds(k, 8, chains)  # the 8 KV heads merged into the chains
    layout = L.SegmentLayout.from_bounds(bounds, k)
    one, stock = _us(L.linear, x, w), _us(F.linear, x, w)
    row = {"bench": "segmented_linear", "shape": name, "m": m, "k": k, "n": n, "chains": chains}
    if chains == 1:  # a TP 2 rank's share: its one chain summed in fp32
        out = torch.empty(m, n, device="cuda", dtype=torch.float32)
        rank = _us(lambda: L.linear_sum(x, w, bounds, out))
        return {**row, "rank_sum_us": round(rank, 1), "one_chain_bf16_us": round(one, 1),
                "cublas_us": round(stock, 1), "rank_sum_over_bf16": round(rank / one, 3)}
    seg = _us(L.linear, x, w, None, bounds)
    split = _us(lambda: L.sum_tree(L.partials(x, w, bounds), x.dtype))  # partials, then the sum
    cfg = L.segmented_config(m, n, k, x.dtype, layout)
    return {**row, "schedule": _schedule(x, w, cfg, layout),
            "chained_us": round(seg, 1), "split_us": round(split, 1),
            "one_chain_us": round(one, 1), "cublas_us": round(stock, 1),
            "chained_over_one_chain": round(seg / one, 3),
            "chained_over_cublas": round(seg / stock, 3),
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
    ap.add_argument("--tokens", type=int, nargs="+",
                    default=[1, 16, 64, 128, 256, 512, 2048, 8192])
    ap.add_argument("--shapes", nargs="+", default=["o_proj", "down_proj", "o_proj_tp2",
                                                    "down_proj_tp2"], choices=list(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="time every SWEEP tile config")
    args = ap.parse_args()
    for name in args.shapes:
        k, n, segs = SHAPES[name]
        for m in args.tokens:
            if args.sweep and segs > 1:
                _sweep(name, k, n, segs, m)
            else:
                print(json.dumps(_row(name, k, n, segs, m)), flush=True)


if __name__ == "__main__":
    main()
