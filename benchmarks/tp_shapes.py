"""Each linear of a tensor-parallel rank against the copy bandwidth, at TP 1 and TP 2 shapes.

For a model's projections (a config.json; column-parallel: qkv, gate_up, the LM head; row-parallel:
o_proj, down_proj over S = KV heads K segments), one JSON line per (projection, TP size, M): the op
the model runs (``linear``; at TP >= 2 the row-parallel layers' ``linear_sum`` of the rank's S/N
segments, whose fp32 sums are then gathered; at TP 1 also the segmented linear over all S segments,
``segmented_us``, the arithmetic that would make TP 1 equal TP N) timed from a CUDA graph of 20
replays, its bytes (weight + activations + output) over the time as a share of a 1 GiB device copy's
bandwidth measured in the same run, and cuBLAS (``F.linear``, one K chain) on the same shard for
scale. A rank whose linears run at a lower share than TP 1's loses the 2x that halving its weights
should give.

    PYTHONPATH=$PWD python benchmarks/tp_shapes.py [--model benchmarks/configs/qwen3-32b.json]
        [--tokens 1 64 512 8192] [--tp 1 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from graph_timer import graph_us  # noqa: E402

from samebits.ops.backend import row_parallel_bounds
from samebits.ops.triton import linear as L


def shapes(cfg: dict, tp: int) -> dict[str, tuple[int, int, bool]]:
    """(K, N, row-parallel) of each projection on one rank of ``tp``."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim", h // heads)
    return {"qkv": (h, (heads + 2 * kv) * d // tp, False), "o_proj": (heads * d // tp, h, True),
            "gate_up": (h, 2 * inter // tp, False), "down_proj": (inter // tp, h, True),
            "lm_head": (h, v // tp, False)}


def copy_gb_s() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    us = graph_us(lambda: y.copy_(x), reps=5)
    return 2 * x.numel() / us / 1e3


def row(name: str, tp: int, m: int, k: int, n: int, row_parallel: bool, segments: int,
        bw: float) -> dict:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if row_parallel and tp > 1:
        bounds = row_parallel_bounds(k, segments // tp)
        ours, out_bytes = (lambda: L.linear_sum(x, w, bounds)), 4
    else:
        ours, out_bytes = (lambda: L.linear(x, w)), 2
    us, stock = graph_us(ours), graph_us(lambda: F.linear(x, w))
    nbytes = 2 * (n * k + m * k) + out_bytes * m * n
    out = {"bench": "tp_shapes", "proj": name, "tp": tp, "m": m, "k": k, "n": n,
           "us": round(us, 1), "ratio_to_copy_bandwidth": round(nbytes / us / 1e3 / bw, 3),
           "cublas_us": round(stock, 1), "ratio_to_cublas_time": round(us / stock, 3)}
    if row_parallel and tp > 1:  # the split schedule (partials buffer, then the sum kernel)
        split = graph_us(lambda: L.sum_tree(L.partials(x, w, bounds), torch.float32))
        out |= {"split_us": round(split, 1), "ours_over_split": round(us / split, 3)}
    if row_parallel and tp == 1:
        bounds = row_parallel_bounds(k, segments)
        seg = graph_us(lambda: L.linear(x, w, None, bounds))
        out |= {"segmented_us": round(seg, 1), "segmented_over_one_chain": round(seg / us, 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="benchmarks/configs/qwen3-8b.json")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 512, 8192])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    cfg = json.loads(Path(args.model).read_text())
    bw = copy_gb_s()
    print(json.dumps({"bench": "tp_shapes", "device": torch.cuda.get_device_name(),
                      "model": args.model, "copy_GB_s": round(bw, 1)}), flush=True)
    for m in args.tokens:
        for tp in args.tp:
            for name, (k, n, rp) in shapes(cfg, tp).items():
                print(json.dumps(row(name, tp, m, k, n, rp, cfg["num_key_value_heads"], bw)),
                      flush=True)


if __name__ == "__main__":
    main()
