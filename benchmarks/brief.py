"""Compact table of benchmark JSON lines (stdin or files): one line per row, for reading a device
run's tail. ``python benchmarks/kernels.py ... | tee out.jsonl | python benchmarks/brief.py``"""

from __future__ import annotations

import fileinput
import json

KEYS = ("prefill_gluon", "decode_gluon", "block_m", "prefill_stages", "split_size", "merge_scan",
        "split_warps", "split_stages", "merge_warps", "merge_stages")


def brief(row: dict) -> str:
    launch = row.get("launch") or {}
    knobs = {k: launch.get(k, row.get(k)) for k in KEYS if launch.get(k, row.get(k)) is not None}
    shape = ",".join(f"{k}={v}" for k, v in row.get("shape", {}).items() if k not in ("hq", "hkv"))
    extra = f" tflops={row['tflops']}" if "tflops" in row else ""
    extra += f" kernels={row['kernels_us']}" if "kernels_us" in row else ""
    return (f"{row['op']:18s} {shape:28s} {row['invariant_us']:>10} / {row['stock_us']:>10}"
            f" = {row['ratio']:.3f}{extra} {knobs}")


def main() -> None:
    for line in fileinput.input():
        line = line.strip()
        if line.startswith('{"op"'):
            print(brief(json.loads(line)), flush=True)
        elif line:
            print(line, flush=True)


if __name__ == "__main__":
    main()
