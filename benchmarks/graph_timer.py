"""Microseconds per call of a GPU op, from a CUDA graph: ``reps`` calls captured once, the graph
replayed 5 times between two events. ``captured=True`` warms up and captures under
``launcher.as_captured()``, as the engine's decode graphs run (programmatic dependent launch, and
the GEMVs' weight prefetch); False times plain stream-ordered launches."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from samebits.ops.triton import launcher


def graph_us(fn: Callable[[], object], reps: int = 20, captured: bool = False) -> float:
    mode = launcher.as_captured if captured else contextlib.nullcontext
    with mode():
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), mode():
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (5 * reps)
