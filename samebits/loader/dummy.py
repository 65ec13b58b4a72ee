"""``load_format="dummy"``: random weights of the right shapes, from a config.json alone.

Seeded and generated on the target device, so the same (config, seed, device) gives the same
weights. Norm weights are 1 + noise so every code path sees non-trivial values.
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
        noise = torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * std
        if p.dim() == 1 and "bias" not in name:
            noise += 1.0
        p.data.copy_(noise.to(p.dtype))


def dummy_digest(config: dict, seed: int) -> str:
    blob = json.dumps(config, sort_keys=True) + f"|dummy-seed={seed}"
    return hashlib.sha256(blob.encode()).hexdigest()
