"""The staged batch-1 GEMV (ops/triton/gemv_staged.py): Hopper, bf16.

Its rows are the bits of ``linear.linear`` (one K chain, the bias in fp32, one cast) and its partials the
bits of ``linear.partials`` (o_proj's two chains), at 1-16 rows; in a CUDA graph with
programmatic launch, a chain of staged GEMVs (each reading the previous one's output, its weights
loaded before its wait) equals the same chain launched eagerly. Merged o_proj (a decode token's
split partials merged inside the GEMV) is the bits of the merge kernel + ``linear.partials`` at
1-4 splits, head dims 64 and 128, bf16 and fp16, in a graph replayed on new partials and
positions. The checks can fail: another K chaining, or one split fewer, gives other bits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a Hopper GPU")

from samebits.ops.backend import row_parallel_bounds  # noqa: E402
from samebits.ops.pending_merge import PendingMerge  # noqa: E402
from samebits.ops.triton import launcher, linear  # noqa: E402
from samebits.ops.triton.gemv_staged import (  # noqa: E402
    gemv_staged,
    merged_partials,
    merges,
    supports,
)


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


def _merge_then_partials(pm, w, segments=2):
    """The engine's path: the merge kernel (attention.decode's launch for one token), then
    ``linear.partials`` over o_proj's chains."""
    from samebits.ops.triton.attention_kernels import _merge_kernel
    _, hq, ms, d = pm.part_acc.shape
    out = torch.empty(1, hq, d, dtype=pm.dtype, device="cuda")
    rows = torch.zeros(1, dtype=torch.int32, device="cuda")
    _merge_kernel[(1, hq)](pm.part_acc, pm.part_ml, pm.positions, rows, out, hq * ms, ms,
                           out.stride(0), out.stride(1), pm.c, hq, HB=1, D=d, SPLIT=128, STAGES=2,
                           PDL=False, num_warps=1, enable_fp_fusion=False)
    return linear.partials(out.view(1, hq * d), w, row_parallel_bounds(hq * d, segments))


def _pending(pos: int, seed: int, c: float, max_splits: int = 4, hq: int = 32, d: int = 128,
             dtype: torch.dtype = torch.bfloat16) -> PendingMerge:
    """Split partials of one token at ``pos`` (splits past its count NaN: never read)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    part_acc = torch.randn(1, hq, max_splits, d, generator=g, device="cuda")
    m = torch.randn(1, hq, max_splits, generator=g, device="cuda") * 4
    sums = torch.rand(1, hq, max_splits, generator=g, device="cuda") * 60 + 0.5
    part_ml = torch.stack([m, sums], -1)
    n = pos // 128 + 1
    part_acc[:, :, n:] = float("nan")
    part_ml[:, :, n:] = float("nan")
    positions = torch.tensor([pos], dtype=torch.int32, device="cuda")
    return PendingMerge(part_acc, part_ml, positions, 128, c, dtype, merge=_no_merge)


def _no_merge() -> torch.Tensor:
    raise AssertionError("the merged GEMV resolved its input")


C = 0.0883883 * 1.4426950408889634  # head dim 128's softmax scale * log2(e)


@pytest.mark.parametrize("pos", [0, 100, 127, 128, 300, 511])
def test_merged_partials_are_the_bits_of_the_merge_then_linear_partials(pos):
    w = _rand(2048, 4096, scale=1 / 64, seed=30)
    pm = _pending(pos, seed=31, c=C)
    assert merges(w, pm, 2)
    want = _merge_then_partials(pm, w)
    assert _same_bits(merged_partials(pm, w, 2), want)
    if pos >= 128:  # the check can fail: merging one split fewer gives other bits
        short = dataclasses.replace(pm, positions=pm.positions - 128)
        assert not torch.equal(merged_partials(short, w, 2), want)


@pytest.mark.parametrize("max_splits,hq,d,segments,dtype", [
    (1, 32, 128, 2, torch.bfloat16), (2, 32, 128, 2, torch.bfloat16),
    (4, 32, 128, 2, torch.float16), (4, 32, 64, 2, torch.bfloat16),
    (4, 16, 128, 1, torch.bfloat16), (4, 64, 64, 4, torch.bfloat16)])
def test_merged_partials_match_at_every_split_count_head_size_and_dtype(max_splits, hq, d,
                                                                       segments, dtype):
    w = _rand(1024, hq * d, scale=1 / 64, seed=32).to(dtype)
    for pos in (0, max_splits * 128 - 1):
        pm = _pending(pos, seed=33 + pos, c=d ** -0.5 * 1.4426950408889634, hq=hq, d=d,
                      max_splits=max_splits, dtype=dtype)
        assert merges(w, pm, segments)
        assert _same_bits(merged_partials(pm, w, segments), _merge_then_partials(pm, w, segments))


def test_merges_refuses_what_it_cannot_merge():
    w = _rand(2048, 4096, scale=1 / 64, seed=34)
    pm = _pending(0, seed=35, c=C)
    assert not merges(w, _pending(0, seed=35, c=C, max_splits=8), 2)  # too many splits
    assert not merges(w.half(), pm, 2)  # the attention's dtype is bf16
    assert not merges(_rand(128, 4096, seed=36), pm, 2)  # a narrow product
    assert not merges(w, pm, 3)  # chains not whole heads in whole tiles


def test_merged_partials_in_a_graph_read_this_steps_partials_and_position():
    w = _rand(2048, 4096, scale=1 / 64, seed=40)
    pm = _pending(300, seed=41, c=0.125)
    src_acc, src_ml = pm.part_acc.clone(), pm.part_ml.clone()

    def step():  # a kernel writes the partials right before the GEMV (as the split kernel does)
        pm.part_acc.copy_(src_acc)
        pm.part_ml.copy_(src_ml)
        return merged_partials(pm, w, 2)

    with launcher.as_captured():
        step()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), launcher.as_captured():
        got = step()
    for seed, pos in ((42, 300), (43, 130), (44, 511), (45, 5)):
        new = _pending(pos, seed=seed, c=0.125)
        src_acc.copy_(new.part_acc)
        src_ml.copy_(new.part_ml)
        pm.positions.copy_(new.positions)  # the step's metadata: written before the graph runs
        g.replay()
        assert _same_bits(got, _merge_then_partials(new, w)), (seed, pos)
