"""Programmatic dependent launch (ops/triton/launcher.py) moves launches, never results.

On Hopper every decode kernel of the Triton backend is launched with ``launch_pdl``: the next
kernel's programs start while the previous one finishes and wait at their first statement. A
missing or misplaced wait would read a tensor before its producer wrote it. Here a chain of
dependent launches (add+norm, GEMV/GEMM, SiLU*up, GEMV; 24 layers, pointer and TMA GEMMs) runs
eagerly and replayed 20 times from a CUDA graph with PDL on, against the same chain with PDL off:
every output bit for bit.
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
def test_pdl_chain_in_a_graph_equals_the_chain_without_pdl(m, monkeypatch):
    if not launcher.programmatic(torch.empty(0, device="cuda")):
        pytest.skip("no programmatic dependent launch on this device / Triton")
    weights = _weights()
    x = torch.randn(m, H, device="cuda").bfloat16()
    pdl_eager = _chain(x, weights)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(x, weights)
    monkeypatch.setattr(launcher, "_programmatic_device", lambda index: False)
    assert not launcher.programmatic(x)
    want = _chain(x, weights)
    torch.cuda.synchronize()
    assert torch.equal(pdl_eager, want)
    for _ in range(20):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
