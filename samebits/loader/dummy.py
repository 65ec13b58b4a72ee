"""``load_format="dummy"``: random weights of the right shapes, from a config.json alone.

Seeded and generated on the target device, so the same (config, seed, device) gives the same
weights. Norm weights are 1 + noise so every code path sees non-trivial values. Each parameter is
drawn whole (the checkpoint's full shape, fused as the model fuses it), then loaded through its
``weight_loader``, so a tensor-parallel rank keeps its own shard of the same weights at every
tensor-parallel size.
"""

from __future__ import annotations

import hashlib
import json

import torch
from torch import nn


def init_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        spec = getattr(p, "spec", None)
        shape = list(p.shape)
        if spec is not None and spec.dim is not None:
            shape[spec.dim] = sum(spec.full_sizes)
        noise = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std
        if p.dim() == 1 and "bias" not in name:
            noise += 1.0
        _load_whole(p, noise.to(p.dtype))


def _load_whole(p: nn.Parameter, full: torch.Tensor) -> None:
    """Give ``p`` its part of ``full`` (a fused parameter's shards in order along its dim)."""
    spec = getattr(p, "spec", None)
    if spec is None or spec.dim is None:
        p.data.copy_(full)
    elif len(spec.full_sizes) == 1:
        p.weight_loader(p, full, None)
    else:
        for i, part in enumerate(full.split(list(spec.full_sizes), dim=spec.dim)):
            p.weight_loader(p, part, i)


def dummy_digest(config: dict, seed: int) -> str:
    blob = json.dumps(config, sort_keys=True) + f"|dummy-seed={seed}"
    return hashlib.sha256(blob.encode()).hexdigest()
