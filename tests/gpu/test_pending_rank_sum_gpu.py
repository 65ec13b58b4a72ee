"""The tensor-parallel rank sum folded into the residual add + RMSNorm, on CUDA (Triton backend).

What the tests prove, bit for bit: ``rms_norm(PendingRankSum(parts, bf16), w, eps, residual)``
(one launch: the tree sum of the ranks' fp32 sums, one cast, the add, the norm) is ``sum_tree``
then ``rms_norm(x, w, eps, residual)`` -- both outputs, for 2, 4 and 8 parts at Qwen3-8B's hidden
size, one row, 64 and a 2048-row prefill; eager and replayed from a CUDA graph captured as the
engine captures (``as_captured``: programmatic dependent launch where the device has it), its
parts written by the GEMM launched right before it. Negative control: the chain of four parts is
another sum. Skipped without CUDA.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from samebits.ops.backend import row_parallel_bounds  # noqa: E402
from samebits.ops.pending_rank_sum import PendingRankSum  # noqa: E402
from samebits.ops.triton.backend import TritonBackend  # noqa: E402
from tests.gpu.captured import capture_as_engine  # noqa: E402

OPS = TritonBackend()
H, EPS, BF16 = 4096, 1e-6, torch.bfloat16


def _case(n: int, m: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    parts = (torch.randn(n, m, H, device="cuda", generator=g)
             * torch.logspace(0, 2, H, device="cuda"))
    residual = (torch.randn(m, H, device="cuda", generator=g) * 30).to(BF16)
    w = (1 + torch.randn(H, device="cuda", generator=g) / 4).to(BF16)
    return parts, residual, w


def _unfused(parts: torch.Tensor, w: torch.Tensor, residual: torch.Tensor):
    return OPS.rms_norm(OPS.sum_tree(parts, BF16), w, EPS, residual)


def _same(got, want) -> bool:
    return all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 64, 2048])
def test_fused_rank_sum_norm_is_sum_tree_then_add_norm(n, m):
    parts, residual, w = _case(n, m, seed=n + m)
    assert _same(OPS.rms_norm(PendingRankSum(parts, BF16), w, EPS, residual),
                 _unfused(parts, w, residual))


def test_negative_control_the_chain_of_four_parts_is_another_sum():
    parts, residual, w = _case(4, 2048, seed=1)
    got = OPS.rms_norm(PendingRankSum(parts, BF16), w, EPS, residual)
    chain = OPS.rms_norm(functools.reduce(torch.add, parts).to(BF16), w, EPS, residual)
    assert not torch.equal(got[1], chain[1])


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("m", [1, 64, 2048])
def test_fused_rank_sum_norm_replayed_from_a_graph_equals_eager(n, m):
    """The parts are the segment partials of the GEMM launched just before (a PDL producer),
    as a rank's gathered sums would be; replayed over new inputs: the eager unfused bits."""
    kb = row_parallel_bounds(4096, n)
    g = torch.Generator(device="cuda").manual_seed(m)
    wl = (torch.randn(H, 4096, device="cuda", generator=g) / 64).to(BF16)
    _, residual, w = _case(n, m, seed=m)

    def step(x: torch.Tensor):
        return OPS.rms_norm(PendingRankSum(OPS.linear_partials(x, wl, kb), BF16), w, EPS,
                            residual)

    static = torch.randn(m, 4096, device="cuda", generator=g).to(BF16)
    graph, out = capture_as_engine(step, static)
    for seed in range(3):
        fresh = torch.randn(m, 4096, device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(100 + seed))
        static.copy_(fresh.to(BF16))
        graph.replay()
        torch.cuda.synchronize()
        assert _same(out, _unfused(OPS.linear_partials(static, wl, kb), w, residual)), seed
