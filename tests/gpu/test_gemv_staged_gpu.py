"""The staged batch-1 GEMV (ops/triton/gemv_staged.py): Hopper, bf16.

Its rows are the bits of ``linear.linear`` (one K chain, the bias in fp32, one cast) and its partials the
bits of ``linear.partials`` (o_proj's two chains), at 1-16 rows; in a CUDA graph with
programmatic launch, a chain of staged GEMVs (each reading the previous one's output, its weights
loaded before its wait) equals the same chain launched eagerly. The checks can fail: another K
chaining of the same product gives other bits.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a Hopper GPU")

from samebits.ops.backend import row_parallel_bounds  # noqa: E402
from samebits.ops.triton import launcher, linear  # noqa: E402
from samebits.ops.triton.gemv_staged import gemv_staged, supports  # noqa: E402


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (torch.equal takes -0 for +0)."""
    ints = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    return a.dtype == b.dtype and torch.equal(a.view(ints[a.dtype]), b.view(ints[b.dtype]))


def _rand(*shape, scale=1.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).bfloat16()


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("k, n, bias", [(2048, 5120, False), (2048, 5120, True), (3072, 2048, False)])
def test_staged_rows_are_the_bits_of_linear(m, k, n, bias):
    x, w = _rand(m, k, seed=1), _rand(n, k, scale=1 / 45, seed=2)
    b = _rand(n, seed=3) if bias else None
    assert supports(x, w, b)
    assert _same_bits(gemv_staged(x, w, b), linear.linear(x, w, b))


@pytest.mark.parametrize("m", [1, 5, 8])
def test_staged_partials_are_the_bits_of_linear_partials(m):
    x, w = _rand(m, 4096, seed=4), _rand(2048, 4096, scale=1 / 64, seed=5)
    bounds = row_parallel_bounds(4096, 2)
    want = linear.partials(x, w, bounds)
    assert _same_bits(gemv_staged(x, w, segments=2, partials=True), want)
    quarters = gemv_staged(x, w, segments=4, partials=True)
    assert not torch.equal(quarters[0] + quarters[1], want[0])  # the check can fail: other chains


@pytest.mark.parametrize("max_stages", [1, 2, 6])
def test_staged_bits_do_not_follow_its_stage_count(monkeypatch, max_stages):
    from samebits.ops.triton import gemv_staged as module
    x, w = _rand(3, 2048, seed=6), _rand(5120, 2048, scale=1 / 45, seed=7)
    monkeypatch.setattr(module, "MAX_STAGES", max_stages)
    assert supports(x, w)
    assert _same_bits(gemv_staged(x, w), linear.linear(x, w))


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("k, n, bias", [(2048, 128, False), (2048, 128, True), (4096, 128, False)])
def test_narrow_rows_are_the_bits_of_linear(m, k, n, bias):
    from samebits.ops.triton import gemv_staged as module
    x, w = _rand(m, k, seed=11), _rand(n, k, scale=1 / 45, seed=12)
    b = _rand(n, seed=13) if bias else None
    assert n < module.MIN_N and supports(x, w, b)
    assert _same_bits(gemv_staged(x, w, b), linear.linear(x, w, b))


def test_products_the_kernels_do_not_take_are_refused_not_computed():
    x, router = _rand(1, 2048, seed=17), _rand(128, 2048, seed=18)
    assert not supports(x, router, None, 1, partials=True)  # the narrow kernel keeps no partials
    assert not supports(x, _rand(5120, 1024, seed=19))  # w's K is not x's
    assert not supports(_rand(9, 2048, seed=20), _rand(5120, 2048, seed=21))  # > ROWS rows
    with pytest.raises(ValueError, match="not a product it takes"):
        gemv_staged(x, router, partials=True)
    assert not launcher.programmatic(x)  # eager: the engine keeps linear.py's kernels
    from samebits.ops.triton.gemv_staged import takes
    assert not takes(x, router)
    with launcher.as_captured():
        assert takes(x, router) and takes(x, _rand(5120, 2048, seed=22))


def test_narrow_after_wide_in_a_graph_equals_stream_order():
    w, router = _rand(2048, 2048, scale=1 / 45, seed=14), _rand(128, 2048, scale=1 / 45, seed=15)
    x = _rand(1, 2048, seed=16)
    with launcher.as_captured():
        gemv_staged(gemv_staged(x, w), router)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), launcher.as_captured():
        got = gemv_staged(gemv_staged(x, w), router)
    for seed in (17, 18):
        x.copy_(_rand(1, 2048, seed=seed))
        g.replay()
        assert _same_bits(got, linear.linear(linear.linear(x, w), router)), seed


def test_staged_chain_in_a_graph_equals_the_chain_in_stream_order():
    ws = [_rand(2048, 2048, scale=1 / 45, seed=10 + i) for i in range(12)]
    x = _rand(1, 2048, seed=9)

    def chain():
        h = x
        for w in ws:
            h = gemv_staged(h, w)
        return h

    want = chain()
    with launcher.as_captured():
        chain()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), launcher.as_captured():
        got = chain()
    for seed in (20, 21):
        x.copy_(_rand(1, 2048, seed=seed))
        g.replay()
        assert _same_bits(got, chain()), seed
    assert not torch.equal(got, want)  # new inputs: the replay did not return stale rows
