"""HF-format model directories: config.json + *.safetensors (single or sharded by an index).

Every problem becomes a ``ModelFormatError`` naming the file: a missing config.json, a truncated
or corrupt safetensors file, an index that points at a missing shard.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from samebits.config import ModelFormatError, read_json

_FULL_HASH_LIMIT = 1 << 30  # files up to this size are hashed whole; larger ones by samples


def check_model_dir(path: Path) -> None:
    if not path.exists():
        raise ModelFormatError(f"{path}: no such file or directory")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelFormatError(f"{path}: directory has no config.json")


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelFormatError(f"{index}: no 'weight_map' object")
        files = [path / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelFormatError(f"{index}: shard {f.name} is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{path}: no *.safetensors files")
    return files


def count_tensors(files: list[Path]) -> int:
    """How many tensors the files hold (their headers only; a progress bar's total)."""
    total = 0
    for f in files:
        try:
            with safe_open(f, framework="pt") as st:
                total += len(st.keys())
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelFormatError(f"{f}: cannot read safetensors ({e})") from None
    return total


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of the files."""
    return _iter(files, lambda st, name: st.get_tensor(name))


def iter_safetensors_slices(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """(name, a lazy safetensors slice) of every tensor: indexing a slice reads only the rows /
    columns asked for (a tensor-parallel rank's shard); valid while the iteration runs."""
    return _iter(files, lambda st, name: st.get_slice(name))


def _iter(files: list[Path], read) -> Iterator[tuple[str, Any]]:
    for f in files:
        try:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    yield name, read(st, name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelFormatError(f"{f}: cannot read safetensors ({e})") from None


def weights_digest(files: list[Path]) -> str:
    """sha256 over the weight files (whole, or size + head + tail samples for huge files)."""
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            if size <= _FULL_HASH_LIMIT:
                for chunk in iter(lambda: fh.read(1 << 24), b""):
                    h.update(chunk)
            else:
                h.update(fh.read(1 << 24))
                fh.seek(size - (1 << 24))
                h.update(fh.read())
    return h.hexdigest()
