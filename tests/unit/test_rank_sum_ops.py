"""The tensor-parallel sum ops ``linear_sum`` and ``sum_tree`` (``samebits.ops.backend``), on the
CPU reference backend and on the Triton kernels under ``TRITON_INTERPRET=1`` (tiny shapes).

What they prove, bit for bit: ``linear_sum(x, w, k_bounds)`` is ``tree_sum(linear_partials(x, w,
k_bounds))`` in fp32, uncast (Triton: the GEMM's partials then the tree sum kernel into an fp32
output; the reference: the kernel's in-chain segments), and ``sum_tree(p, dtype)`` is
``tree_sum(p).to(dtype)`` (Triton: one tree sum kernel launch for power-of-two counts), for 1, 2,
3, 4 and 8 segments, 2-D and 3-D inputs, one row or more. Negative control: the chain of the
partials, ``((p0 + p1) + p2) + p3``, is another sum on the same inputs. The Triton half runs only
where the kernels are interpreted (no GPU; tests/gpu/test_rank_sum_gpu.py runs it on CUDA).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from samebits.ops.backend import row_parallel_bounds, tree_sum
from samebits.ops.reference import ReferenceBackend
from samebits.ops.standard import StandardBackend

SEGMENTS = [1, 2, 3, 4, 8]
LEADS = [(1,), (5,), (2, 3)]  # rows of x: one token, a few, and a [B, T] batch
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the Triton kernels run compiled here (tests/gpu)")


def _data(lead: tuple[int, ...], s: int, dtype: torch.dtype, seed: int):
    """x [*lead, K] with a wide range of magnitudes over K (segment sums of unlike sizes), w
    [24, K], K = 37 s + 5 (near-equal segments of unequal lengths)."""
    g = torch.Generator().manual_seed(seed)
    k = 37 * s + 5
    x = torch.randn(*lead, k, generator=g) * torch.logspace(0, 3, k)
    w = torch.randn(24, k, generator=g) / k ** 0.5
    return x.to(dtype), w.to(dtype), row_parallel_bounds(k, s)


def _parts(s: int, lead: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(s, *lead, 24, generator=g) * torch.logspace(0, 4, 24)


def _chain(p: torch.Tensor) -> torch.Tensor:
    return functools.reduce(torch.add, p)


@pytest.mark.parametrize("s", SEGMENTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_reference_linear_sum_is_the_tree_sum_of_its_partials(s, dtype) -> None:
    ops = ReferenceBackend()
    for i, lead in enumerate(LEADS):
        x, w, kb = _data(lead, s, dtype, seed=s + i)
        got = ops.linear_sum(x, w, kb)
        assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert got.shape == (*lead, 24)
        assert torch.equal(got, tree_sum(ops.linear_partials(x, w, kb))), lead
        assert torch.equal(ops.sum_tree(got[None], dtype), ops.linear(x, w, k_bounds=kb))


@pytest.mark.parametrize("s", SEGMENTS)
def test_reference_and_standard_sum_tree_is_tree_sum_then_cast(s) -> None:
    for i, lead in enumerate(LEADS):
        p = _parts(s, lead, seed=10 * s + i)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            want = tree_sum(p).to(dtype)
            assert torch.equal(ReferenceBackend().sum_tree(p, dtype), want)
            assert torch.equal(StandardBackend().sum_tree(p, dtype), want)


def test_standard_linear_sum_is_the_tree_sum_of_its_partials() -> None:
    x, w, kb = _data((5,), 4, torch.float32, seed=3)
    ops = StandardBackend()
    assert torch.equal(ops.linear_sum(x, w, kb), tree_sum(ops.linear_partials(x, w, kb)))


def test_negative_control_the_chain_of_four_partials_is_another_sum() -> None:
    p = _parts(4, (5,), seed=1)
    assert not torch.equal(ReferenceBackend().sum_tree(p, torch.float32), _chain(p))
    x, w, kb = _data((5,), 4, torch.float32, seed=2)
    ops = ReferenceBackend()
    assert not torch.equal(ops.linear_sum(x, w, kb), _chain(ops.linear_partials(x, w, kb)))


@functools.cache
def _triton():
    pytest.importorskip("triton")
    from samebits.ops.triton.backend import TritonBackend
    return TritonBackend()


@interpreted
@pytest.mark.parametrize("s", SEGMENTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_triton_linear_sum_is_the_tree_sum_of_its_partials(s, dtype) -> None:
    """fp16 stands for the 16-bit inputs: the interpreter's bf16 ``tl.dot`` is wrong (see
    test_triton_interpret.py); bf16 runs on CUDA."""
    ops = _triton()
    for i, lead in enumerate(LEADS):
        x, w, kb = _data(lead, s, dtype, seed=s + i)
        got = ops.linear_sum(x, w, kb)
        assert got.dtype == torch.float32 and got.shape == (*lead, 24)
        assert torch.equal(got, tree_sum(ops.linear_partials(x, w, kb))), lead


@interpreted
@pytest.mark.parametrize("s", SEGMENTS)
def test_triton_sum_tree_is_tree_sum_then_cast(s) -> None:
    """fp16 stands for the 16-bit outputs: the interpreter casts fp32 to bf16 by truncation
    (the GPU rounds to nearest even, as torch); bf16 runs on CUDA."""
    ops = _triton()
    for i, lead in enumerate(LEADS):
        p = _parts(s, lead, seed=10 * s + i)
        for dtype in (torch.float32, torch.float16):
            assert torch.equal(ops.sum_tree(p, dtype), tree_sum(p).to(dtype)), (lead, dtype)
    wide = _parts(s, (3,), seed=s).repeat(1, 1, 2)  # strided and offset views of a buffer
    for view in (wide[..., ::2], wide[..., 1:25]):
        assert torch.equal(ops.sum_tree(view, torch.float16), tree_sum(view).half())


@interpreted
def test_triton_negative_control_the_chain_of_four_partials_is_another_sum() -> None:
    ops = _triton()
    p = _parts(4, (5,), seed=1)
    assert not torch.equal(ops.sum_tree(p, torch.float32), _chain(p))
    x, w, kb = _data((5,), 4, torch.float32, seed=2)
    assert not torch.equal(ops.linear_sum(x, w, kb), _chain(ops.linear_partials(x, w, kb)))
