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


def _weights(h: int = H, inter: int = INTER, layers: int = LAYERS,
             dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    def rand(*shape):
        return (torch.randn(*shape, device="cuda", generator=g) * 0.05).to(dtype)
    return [(rand(h) + 1, rand(2 * inter, h), rand(h, inter)) for _ in range(layers)]


def _chain(x: torch.Tensor, weights) -> torch.Tensor:
    residual = torch.zeros_like(x)
    for norm, up, down in weights:
        h, residual = add_rms_norm(x, residual, norm, 1e-6)
        gate_up = linear(h, up)
        inter = down.shape[1]
        x = linear(silu_mul(gate_up[:, :inter], gate_up[:, inter:]), down)
    return x + residual


@pytest.mark.parametrize("m", [1, 8, 256])
def test_pdl_chain_in_a_graph_equals_the_chain_in_stream_order(m):
    if not launcher._programmatic_device(torch.cuda.current_device()):
        pytest.skip("no programmatic dependent launch on this device / Triton")
    weights = _weights()
    x = torch.randn(m, H, device="cuda").bfloat16()
    assert not launcher.programmatic(x)  # eager: plain stream order
    want = _chain(x, weights)
    with launcher.as_captured():
        _chain(x, weights)  # the engine's warm-up: compiles the PDL variants
    plain = torch.cuda.CUDAGraph()
    with torch.cuda.graph(plain):
        plain_with_pdl = launcher.programmatic(x)  # a capture outside as_captured: eager variants
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), launcher.as_captured():
        captured_with_pdl = launcher.programmatic(x)
        out = _chain(x, weights)
    assert captured_with_pdl and not plain_with_pdl
    for _ in range(20):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


def test_warm_up_as_captured_leaves_nothing_to_compile_in_the_capture():
    """The engine warms up and captures under ``as_captured``: the capture's kernel variants
    (PDL on) are then compiled already. In fp16, a dtype no other GPU test's captures
    use, so no earlier test compiled these variants (Triton specializes on dtypes and on the
    divisibility of sizes, not on their values)."""
    if not launcher._programmatic_device(torch.cuda.current_device()):
        pytest.skip("no programmatic dependent launch on this device / Triton")
    runtime = launcher.knobs.runtime
    if not hasattr(runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no compile hook")
    weights = _weights(768, 2048, 2, torch.float16)
    x = torch.randn(3, 768, device="cuda").half()
    _chain(x, weights)  # plain eager variants
    compiled, old = [], runtime.jit_post_compile_hook
    runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["repr"])
    try:
        with launcher.as_captured():
            want = _chain(x, weights)
        torch.cuda.synchronize()
        warmed = len(compiled)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), launcher.as_captured():  # as the engine captures
            out = _chain(x, weights)
    finally:
        runtime.jit_post_compile_hook = old
    assert warmed > 0  # negative control: the captured variants are not the plain eager ones
    assert compiled[warmed:] == []
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
