"""Programmatic dependent launch (ops/triton/launcher.py) moves launches, never results.

On Hopper every decode kernel of the Triton backend captured in a CUDA graph is launched with
``launch_pdl``: the next kernel's programs start while the previous one finishes and wait at
their first statement (GEMV programs prefetch weights before it). A missing or misplaced wait
would read a tensor before its producer wrote it. Here a chain of dependent launches (add+norm,
GEMV/GEMM, SiLU*up, GEMV; 24 layers, pointer and TMA GEMMs) is replayed 20 times from a graph
captured with PDL, against the same chain run eagerly in plain stream order: bit for bit.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from samebits.ops.triton import launcher  # noqa: E402
from samebits.ops.triton.activation import silu_mul  # noqa: E402
from samebits.ops.triton.linear import linear  # noqa: E402
from samebits.ops.triton.rms_norm import add_rms_norm  # noqa: E402

H, INTER, LAYERS = 1024, 2816, 24


def _weights():
    g = torch.Generator(device="cuda").manual_seed(0)
    def rand(*shape):
        return (torch.randn(*shape, device="cuda", generator=g) * 0.05).bfloat16()
    return [(rand(H) + 1, rand(2 * INTER, H), rand(H, INTER)) for _ in range(LAYERS)]


def _chain(x: torch.Tensor, weights) -> torch.Tensor:
    residual = torch.zeros_like(x)
    for norm, up, down in weights:
        h, residual = add_rms_norm(x, residual, norm, 1e-6)
        gate_up = linear(h, up)
        x = linear(silu_mul(gate_up[:, :INTER], gate_up[:, INTER:]), down)
    return x + residual


@pytest.mark.parametrize("m", [1, 8, 256])
def test_pdl_chain_in_a_graph_equals_the_chain_in_stream_order(m):
    if not launcher._programmatic_device(torch.cuda.current_device()):
        pytest.skip("no programmatic dependent launch on this device / Triton")
    weights = _weights()
    x = torch.randn(m, H, device="cuda").bfloat16()
    assert not launcher.programmatic(x)  # eager: plain stream order
    want = _chain(x, weights)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_with_pdl = launcher.programmatic(x)
        out = _chain(x, weights)
    assert captured_with_pdl
    for _ in range(20):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
