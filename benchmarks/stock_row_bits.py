"""Where the stock ``F.linear`` changes a row's bits with the number of rows M (the problem).

For each weight shape, row 0 of ``F.linear(x[:M], w)`` for M = 1..max_m, grouped into runs of M
that give the same bits: one run means the stock op is row-invariant there, several mean the
library switched kernels or reduction orders with M. The invariant ``samebits.ops.linear`` on the
same inputs is checked to give one run (its bits never move).

    python benchmarks/stock_row_bits.py                        # CPU, fp32, default-model shapes
    python benchmarks/stock_row_bits.py --device cuda --dtype bfloat16 --shapes 4096x4096

One JSON line per shape: device, dtype, k, n, threads, torch version, ``stock_runs`` (the runs as
[first M, last M]) and ``invariant_runs``.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import samebits.ops as ops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def runs(fn, x: torch.Tensor, w: torch.Tensor, max_m: int) -> list[list[int]]:
    """Runs [first M, last M] of consecutive M whose row 0 has the same bits."""
    found, prev = [], None
    for m in range(1, max_m + 1):
        row = fn(x[:m], w)[0]
        if prev is not None and torch.equal(row, prev):
            found[-1][1] = m
        else:
            found.append([m, m])
        prev = row
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--shapes", nargs="+", default=["576x576", "1536x576", "1536x1536"],
                   help="KxN weight shapes (K inputs, N outputs)")
    p.add_argument("--max-m", type=int, default=128)
    args = p.parse_args()
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        x = torch.randn(args.max_m, k, device=args.device).to(dtype)
        w = (torch.randn(n, k, device=args.device) / k ** 0.5).to(dtype)
        print(json.dumps({"device": args.device, "dtype": args.dtype, "k": k, "n": n,
                          "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "stock_runs": runs(F.linear, x, w, args.max_m),
                          "invariant_runs": runs(ops.linear, x, w, args.max_m)}), flush=True)


if __name__ == "__main__":
    main()
