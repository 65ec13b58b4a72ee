"""Capture a step as the engine's decode graphs do: warmed up, then captured, under
``launcher.as_captured()`` (programmatic dependent launch), for tests that replay it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from samebits.ops.triton import launcher


def capture_as_engine(step: Callable[[torch.Tensor], object], static: torch.Tensor
                      ) -> tuple[torch.cuda.CUDAGraph, object]:
    """(the graph, ``step(static)``'s output captured in it): refill ``static`` and replay."""
    with launcher.as_captured():
        step(static)  # the warm-up compiles the captured variants
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), launcher.as_captured():
        out = step(static)
    return graph, out
