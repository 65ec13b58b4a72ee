"""The tensor-parallel rank sum folded into the residual add + RMSNorm, against the two launches
it replaces, JSON lines (one GPU).

    python benchmarks/rank_sum_norm.py [--hidden 4096]

Per (parts N, rows M): ``fused_us`` (``rms_norm(PendingRankSum(parts), w, eps, residual)``: one
launch), ``unfused_us`` (``sum_tree`` then the add + norm: two launches, what a row-parallel layer
under tensor parallel ran before) and their ratio; both timed from a CUDA graph of 20 calls
captured as the engine captures (``as_captured``: programmatic dependent launch where the device
has it), plus ``fused_gb_s``: the bytes the fused kernel must move (N fp32 parts, the residual
in, the sum and the normed out) over its time. ``bits_equal``: the two give the same outputs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from graph_timer import graph_us  # noqa: E402

from samebits.ops.pending_rank_sum import PendingRankSum  # noqa: E402
from samebits.ops.triton.backend import TritonBackend

OPS = TritonBackend()
EPS = 1e-6


def row(n: int, m: int, h: int) -> dict:
    parts = torch.randn(n, m, h, device="cuda")
    residual = torch.randn(m, h, device="cuda").bfloat16()
    w = torch.randn(h, device="cuda").bfloat16()
    pending = PendingRankSum(parts, torch.bfloat16)

    def fused():
        return OPS.rms_norm(pending, w, EPS, residual)

    def unfused():
        return OPS.rms_norm(OPS.sum_tree(parts, torch.bfloat16), w, EPS, residual)

    equal = all(torch.equal(a, b) for a, b in zip(fused(), unfused(), strict=True))
    f_us, u_us = graph_us(fused, captured=True), graph_us(unfused, captured=True)
    moved = n * m * h * 4 + 3 * m * h * 2
    return {"bench": "rank_sum_norm", "parts": n, "rows": m, "hidden": h, "fused_us": round(f_us, 2),
            "unfused_us": round(u_us, 2), "fused_over_unfused": round(f_us / u_us, 3),
            "fused_gb_s": round(moved / f_us / 1e3, 1), "bits_equal": equal,
            "device": torch.cuda.get_device_name(0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    args = p.parse_args()
    for n in (2, 4, 8):
        for m in (1, 8, 64, 512, 2048):
            print(json.dumps(row(n, m, args.hidden)), flush=True)


if __name__ == "__main__":
    main()
