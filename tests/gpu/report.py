"""Findings of the GPU tests (negative controls) as JSON lines, for benchmarks/RESULTS.md.

Set ``SAMEBITS_GPU_REPORT=path`` to collect them; without it they are only printed.
"""

from __future__ import annotations

import json
import os

import torch


def record(test: str, **fields: object) -> None:
    line = json.dumps({"test": test, "device": torch.cuda.get_device_name(), **fields})
    print(line)
    path = os.environ.get("SAMEBITS_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
