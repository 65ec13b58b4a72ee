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


def main() -> None:
    measure("qkv", 2048, 5120, 1)
    measure("o_proj (2 chains)", 4096, 2048, 2)


if __name__ == "__main__":
    main()
