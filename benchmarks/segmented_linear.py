"""Cost of the segmented K (the default row-parallel arithmetic: o_proj, down_proj) on CUDA.

For Qwen3-8B's row-parallel shapes and S = 8 segments (its KV heads), prints one JSON line per
(shape, M): the segmented Triton linear's time as a ratio to the one-segment Triton linear and to
cuBLAS (``F.linear``), the same inputs, the same run (CUDA events, median of 20).

    PYTHONPATH=$PWD python benchmarks/segmented_linear.py
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from samebits.ops.backend import row_parallel_bounds
from samebits.ops.triton import linear as L

SHAPES = {"o_proj": (4096, 4096), "down_proj": (12288, 4096)}  # (K, N)


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


def main() -> None:
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        bounds = row_parallel_bounds(k, 8)
        for m in (1, 16, 64, 512, 2048, 8192):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            seg = _us(L.linear, x, w, None, bounds)
            one = _us(L.linear, x, w)
            stock = _us(F.linear, x, w)
            print(json.dumps({"bench": "segmented_linear", "shape": name, "m": m, "k": k, "n": n,
                              "segments": 8, "segmented_us": round(seg, 1),
                              "one_segment_us": round(one, 1), "cublas_us": round(stock, 1),
                              "segmented_over_one_segment": round(seg / one, 3),
                              "segmented_over_cublas": round(seg / stock, 3)}), flush=True)


if __name__ == "__main__":
    main()
