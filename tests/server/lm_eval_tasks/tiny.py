"""The datasets of the samebits lm-eval tasks: jsonl files beside this module (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets

HERE = Path(__file__).parent


def _load(name: str) -> dict[str, datasets.Dataset]:
    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}


def mc(**kwargs) -> dict[str, datasets.Dataset]:
    return _load("mc.jsonl")


def gen(**kwargs) -> dict[str, datasets.Dataset]:
    return _load("gen.jsonl")
