"""The tensor-parallel sum ops on CUDA (Triton backend): ``linear_sum`` and ``sum_tree``.

What the tests prove, bit for bit: ``linear_sum(x, w, k_bounds)`` (the split GEMM's partials,
then the tree sum kernel into fp32) is ``tree_sum(linear_partials(x, w, k_bounds))``, and cast it
is ``linear(x, w, k_bounds=...)``; ``sum_tree(p, dtype)`` (one tree sum kernel launch for
power-of-two counts, torch's ``tree_sum`` for others) is ``tree_sum(p).to(dtype)`` -- for 1, 2, 3,
4, 8 (and 16, 64, 128) segments, bf16 / fp16 / fp32, 2-D and 3-D inputs, one row to a prefill's
rows, contiguous or strided and offset partials, eager and replayed from a CUDA graph captured as
the engine captures (programmatic dependent launch). ``RowParallelLinear.gathered`` on one GPU
then gives ``linear(..., k_bounds)``'s bits. Negative control: the chain of four partials is
another sum. Skipped without CUDA.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from samebits.distributed.group import TPGroup  # noqa: E402
from samebits.models.parallel import RowParallelLinear  # noqa: E402
from samebits.ops.backend import row_parallel_bounds, tree_sum  # noqa: E402
from samebits.ops.triton.backend import TritonBackend  # noqa: E402
from tests.gpu.captured import capture_as_engine  # noqa: E402

OPS = TritonBackend()
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
LEADS = [(1,), (37,), (200,), (4, 33), (600,), (1100,)]  # decode .. prefill (one chain: 3 tiles), [B, T]


def _data(lead: tuple[int, ...], k: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(*lead, k, device="cuda", generator=g) * torch.logspace(0, 2, k, device="cuda")
    w = torch.randn(n, k, device="cuda", generator=g) / k ** 0.5
    return x.to(dtype), w.to(dtype)


def _parts(s: int, lead: tuple[int, ...], n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(s, *lead, n, device="cuda", generator=g)
            * torch.logspace(0, 4, n, device="cuda"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,s", [(1024, 1), (1024, 2), (1000, 3), (4096, 4), (4096, 8),
                                 (12288, 8), (200, 8), (2048, 4), (12800, 4)])
def test_linear_sum_is_the_tree_sum_of_the_partials(dtype, k, s):
    kb = row_parallel_bounds(k, s)
    for lead in LEADS:
        x, w = _data(lead, k, 1024, dtype, seed=s)
        got = OPS.linear_sum(x, w, kb)
        assert got.dtype == torch.float32 and got.shape == (*lead, 1024)
        assert torch.equal(got, tree_sum(OPS.linear_partials(x, w, kb))), lead
        if s > 1 or dtype != torch.float32:  # one fp32 segment: linear's plain kernel, whose
            # bits test_segmented_gpu.py does not claim equal to the split schedule's either
            assert torch.equal(got.to(dtype), OPS.linear(x, w, k_bounds=kb)), lead


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s", [1, 2, 3, 4, 8, 16, 64, 128])
def test_sum_tree_is_tree_sum_then_cast(dtype, s):
    for lead, n in [((1,), 4096), ((37,), 1000), ((3, 5), 24), ((200,), 4096)]:
        p = _parts(s, lead, n, seed=s)
        assert torch.equal(OPS.sum_tree(p, dtype), tree_sum(p).to(dtype)), (lead, n)
    wide = _parts(s, (7,), 2 * 1000, seed=s)  # strided, and offset by 4 bytes
    for view in (wide[..., ::2], wide[..., 1:1001]):
        assert torch.equal(OPS.sum_tree(view, dtype), tree_sum(view).to(dtype))


def test_negative_control_the_chain_of_four_partials_is_another_sum():
    p = _parts(4, (37,), 4096, seed=1)
    assert not torch.equal(OPS.sum_tree(p, torch.float32), functools.reduce(torch.add, p))
    x, w = _data((37,), 4096, 1024, torch.bfloat16, seed=2)
    kb = row_parallel_bounds(4096, 4)
    parts = OPS.linear_partials(x, w, kb)
    assert not torch.equal(OPS.linear_sum(x, w, kb), functools.reduce(torch.add, parts))


@pytest.mark.parametrize("m", [1, 8, 256])
def test_rank_sum_replayed_from_a_graph_equals_eager(m):
    """linear_sum then sum_tree (one rank's ``gathered`` without the gather), captured as the
    engine captures (``as_captured``: PDL variants where the device has them), replayed over new
    inputs: the eager bits."""
    kb = row_parallel_bounds(4096, 8)
    x, w = _data((m,), 4096, 1024, torch.bfloat16, seed=m)

    def step(inp: torch.Tensor) -> torch.Tensor:
        return OPS.sum_tree(OPS.linear_sum(inp, w, kb).unsqueeze(0), inp.dtype)

    static = x.clone()
    graph, out = capture_as_engine(step, static)
    for seed in range(3):
        fresh, _ = _data((m,), 4096, 1024, torch.bfloat16, seed=100 + seed)
        static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step(fresh)), seed
        assert torch.equal(out, OPS.linear(fresh, w, k_bounds=kb)), seed


@pytest.mark.parametrize("segments", [8, 3])
def test_gathered_on_one_gpu_is_the_segmented_linear(segments):
    """The tensor-parallel path at world size 1 (linear_sum, sum_tree, then the bias) gives one
    GPU's ``linear(x, w, b, k_bounds)``."""
    layer = RowParallelLinear(1536, 512, segments, TPGroup(0, 1), segments, bias=True).cuda()
    x, w = _data((37,), 1536, 512, torch.bfloat16, seed=segments)
    layer.weight.data = w
    layer.bias.data = torch.randn(512, device="cuda").bfloat16()
    got = layer.gathered(OPS, x)
    assert torch.equal(got, OPS.linear(x, w, layer.bias, k_bounds=layer.k_bounds))
