"""Fixed-shape row tiles: the device-agnostic way to make a row-wise op batch-invariant.

``by_tiles(fn, x)`` runs ``fn`` on zero-padded blocks of exactly ``TILE_M`` rows, so whatever the
batch, the library underneath always sees the same problem shape (and so the same kernel and
reduction order); a row's result never depends on how many rows there are or where it sits.
``silu_mul_rows`` does the same for a CPU elementwise op by single-threaded row blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

TILE_M = 16  # rows per GEMM / reduction tile
GRAIN = 32768  # torch's intra-op grain: a CPU elementwise call below it runs on one thread


def pad_rows(x: torch.Tensor, tile: int = TILE_M) -> torch.Tensor:
    """``x`` [M, ...] zero-padded to a whole number of ``tile`` rows."""
    m = x.shape[0]
    padded = -(-m // tile) * tile
    if padded == m:
        return x
    return torch.cat([x, x.new_zeros(padded - m, *x.shape[1:])])


def by_tiles(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Apply a row-wise ``fn`` to fixed [TILE_M, H] blocks of ``x`` [..., H]."""
    lead, h = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, h)
    m = x2.shape[0]
    if m == 0:
        return fn(x2).reshape(*lead, -1)
    xp = pad_rows(x2)
    if xp.shape[0] == TILE_M:  # one tile (every decode step up to 16 sequences): no concatenation
        return fn(xp)[:m].reshape(*lead, -1)
    out = torch.cat([fn(xp[i:i + TILE_M]) for i in range(0, xp.shape[0], TILE_M)])
    return out[:m].reshape(*lead, out.shape[-1])


def silu_mul_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up on CPU, in calls of fewer than GRAIN elements: each call runs on one
    thread, so every row goes through torch's elementwise loop whole and from its first column
    (a parallel split inside a row moves its vector / scalar-tail boundary, and torch's SiLU
    rounds the two differently)."""
    rows = max(1, GRAIN // max(1, gate.shape[-1]) - 1)
    if gate.shape[0] <= rows:
        return F.silu(gate) * up
    return torch.cat([F.silu(gate[i:i + rows]) * up[i:i + rows]
                      for i in range(0, gate.shape[0], rows)])
