"""Record what a GPU test found (negative controls above all) as JSON lines."""

from __future__ import annotations

import json
import os

import torch


def record(test: str, **fields: object) -> None:
    """Print a finding as JSON; append it to $SAMEBITS_GPU_REPORT if set."""
    line = json.dumps({"test": test, "device": torch.cuda.get_device_name(), **fields})
    print(line)
    if os.environ.get("SAMEBITS_GPU_REPORT"):
        with open(os.environ["SAMEBITS_GPU_REPORT"], "a") as f:
            f.write(line + "\n")
