"""Does staging a batch-1 GEMV's weights before its wait pay in the decode step's chain? JSON lines.

    python benchmarks/gemv_staged.py

One CUDA graph (captured as the engine captures: programmatic launch) of 16 (RMSNorm, GEMV)
pairs, the GEMV reading the norm's output, over 6 weight copies (HBM): the persistent TMA GEMV
(``linear``, the engine's qkv tile), the split schedule (o_proj's two chains, ``linear_partials``)
and the staged GEMV (``gemv_staged``), which loads its first weight tiles into shared memory
while the norm runs. Microseconds per pair and the ratio to the engine's kernel.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import graph_timer  # noqa: E402

from samebits.ops.backend import get_backend, row_parallel_bounds  # noqa: E402
from samebits.ops.triton import linear  # noqa: E402
from samebits.ops.triton.gemv_staged import gemv_staged  # noqa: E402
from samebits.ops.triton.launcher import programmatic  # noqa: E402

PAIRS, COPIES = 16, 6


def pair_us(pair, weights: list[torch.Tensor]) -> float:
    """Microseconds of one pair in a graph of PAIRS, each reading the next weight copy."""
    copies = itertools.cycle(weights)
    return graph_timer.graph_us(lambda: pair(next(copies)), reps=PAIRS, captured=True)


def measure(name: str, k: int, n: int, segs: int) -> None:
    ops = get_backend("cuda", True)
    x = torch.randn(1, k, device="cuda").bfloat16()
    gamma = torch.ones(k, device="cuda").bfloat16()
    ws = [(torch.randn(n, k, device="cuda") / 64).bfloat16() for _ in range(COPIES)]
    bounds = row_parallel_bounds(k, segs)

    def engine(w: torch.Tensor) -> torch.Tensor:
        h = ops.rms_norm(x, gamma, 1e-6)
        return linear.linear(h, w) if segs == 1 else linear.partials(h, w, bounds)

    def staged(w: torch.Tensor) -> torch.Tensor:
        return gemv_staged(ops.rms_norm(x, gamma, 1e-6), w, segments=segs, partials=segs > 1)

    assert torch.equal(engine(ws[0]), staged(ws[0]))
    base, new = pair_us(engine, ws), pair_us(staged, ws)
    print(json.dumps({"bench": "gemv_staged", "device": torch.cuda.get_device_name(),
                      "product": name, "engine_pair_us": round(base, 2),
                      "staged_pair_us": round(new, 2), "staged_to_engine": round(new / base, 3)}),
          flush=True)


def measure_merged(splits: int) -> None:
    """The attention merge + o_proj's two chains (the engine: the merge kernel, then the staged
    partials) against the staged GEMV merging the split partials itself, one decode token."""
    from samebits.ops.pending_merge import PendingMerge
    from samebits.ops.triton.attention_kernels import _merge_kernel
    from samebits.ops.triton.gemv_staged import merged_partials
    hq, d, ms, c = 32, 128, splits, 0.1275
    part_acc = torch.randn(1, hq, ms, d, device="cuda")
    part_ml = torch.stack([torch.randn(1, hq, ms, device="cuda"),
                           torch.rand(1, hq, ms, device="cuda") + 1], -1)
    pos = torch.tensor([ms * 128 - 1], dtype=torch.int32, device="cuda")
    rows = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.empty(1, hq, d, dtype=torch.bfloat16, device="cuda")
    ws = [(torch.randn(2048, hq * d, device="cuda") / 64).bfloat16() for _ in range(COPIES)]
    bounds = row_parallel_bounds(hq * d, 2)
    ops = get_backend("cuda", True)

    def engine(w: torch.Tensor) -> torch.Tensor:
        pdl = programmatic(out)
        _merge_kernel[(1, hq)](part_acc, part_ml, pos, rows, out, hq * ms, ms, out.stride(0),
                               out.stride(1), c, hq, HB=1, D=d, SPLIT=128, STAGES=min(12, ms),
                               PDL=pdl, num_warps=1, enable_fp_fusion=False, launch_pdl=pdl)
        return ops.linear_partials(out.view(1, hq * d), w, bounds)

    pm = PendingMerge(part_acc, part_ml, pos, 128, c, torch.bfloat16, merge=lambda: out)

    def fused(w: torch.Tensor) -> torch.Tensor:
        return merged_partials(pm, w, 2)

    assert torch.equal(engine(ws[0]), fused(ws[0]))
    base, new = pair_us(engine, ws), pair_us(fused, ws)
    print(json.dumps({"bench": "gemv_staged", "device": torch.cuda.get_device_name(),
                      "product": f"merge ({splits} splits) + o_proj", "engine_pair_us": round(base, 2),
                      "merged_us": round(new, 2), "merged_to_engine": round(new / base, 3)}),
          flush=True)


def main() -> None:
    measure("qkv", 2048, 5120, 1)
    measure("o_proj (2 chains)", 4096, 2048, 2)
    for splits in (2, 4):
        measure_merged(splits)


if __name__ == "__main__":
    main()
