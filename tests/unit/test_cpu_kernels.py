"""The invariant CPU kernels (samebits/ops/csrc): bits independent of the thread count, packed
weights that follow in-place updates, and CPU constants in the CPU fingerprint only."""

from __future__ import annotations

import functools

import pytest
import torch

from samebits.config import EngineConfig
from samebits.loader import fingerprint
from samebits.ops import cpu_kernels, get_backend, reference
from samebits.ops.backend import tree_sum

INV = get_backend("cpu", True)


def _with_threads(n: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.smoke
def test_linear_bits_do_not_depend_on_the_thread_count_or_row_count() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(33, 576, generator=g), torch.randn(200, 576, generator=g)
    one, two = _with_threads(1, lambda: INV.linear(x, w)), _with_threads(2, lambda: INV.linear(x, w))
    assert torch.equal(one, two)
    assert all(torch.equal(INV.linear(x[i:i + 1], w), one[i:i + 1]) for i in range(33))
    # negative control: the stock product of one row differs from the same row among 33
    stock = torch.nn.functional.linear
    assert any(not torch.equal(stock(x[i:i + 1], w), stock(x, w)[i:i + 1]) for i in range(33))


def test_linear_is_close_to_float64_and_follows_in_place_weight_updates() -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 100, generator=g), torch.randn(50, 100, generator=g)
    before = INV.linear(x, w)
    assert (before.double() - x.double() @ w.double().t()).abs().max() < 1e-4
    with torch.no_grad():
        w.mul_(2)  # the packed copy kept on w must not survive this
    assert torch.equal(INV.linear(x, w), before * 2)


def test_attention_bits_do_not_depend_on_the_thread_count() -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(40, 6, 64, generator=g)
    k, v = torch.randn(8, 16, 2, 64, generator=g), torch.randn(8, 16, 2, 64, generator=g)
    plan = reference.SplitPlan(torch.tensor([[3, 1, 0, 2], [7, 6, 5, 4]], dtype=torch.int32),
                               torch.tensor([0] * 20 + [1] * 20, dtype=torch.int32),
                               torch.tensor(list(range(45, 65)) + list(range(1, 21)),
                                            dtype=torch.int32))

    def run() -> torch.Tensor:
        return reference.split_attention(q, k, v, plan, 0.125, 16)
    assert torch.equal(_with_threads(1, run), _with_threads(2, run))


def test_cpu_kernel_constants_enter_only_the_cpu_fingerprint(monkeypatch) -> None:
    assert cpu_kernels.ARITHMETIC in INV.name and f"tile_m={reference.TILE_M}" in INV.name
    cfg = EngineConfig()
    cuda = fingerprint("digest", torch.float32, cfg, "triton-cuda-kb128")
    monkeypatch.setattr(reference, "TILE_M", 2 * reference.TILE_M)
    assert fingerprint("digest", torch.float32, cfg, "triton-cuda-kb128") == cuda
    assert cuda != fingerprint("digest", torch.float32, cfg, INV.name)


def test_avx2_and_scalar_paths_give_the_same_bits() -> None:
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(7, 577, generator=g), torch.randn(100, 577, generator=g)
    q = torch.randn(10, 6, 64, generator=g)
    k, v = torch.randn(4, 16, 2, 64, generator=g), torch.randn(4, 16, 2, 64, generator=g)
    plan = reference.SplitPlan(torch.tensor([[2, 0, 3, 1]], dtype=torch.int32),
                               torch.zeros(10, dtype=torch.int32),
                               torch.arange(55, 65, dtype=torch.int32))

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        return INV.linear(x, w), reference.split_attention(q, k, v, plan, 0.125, 16)
    vec = run()
    before = cpu_kernels.set_vectorized(False)
    try:
        scalar = run()
    finally:
        cpu_kernels.set_vectorized(before)
    assert torch.equal(vec[0], scalar[0]) and torch.equal(vec[1], scalar[1])


@pytest.mark.parametrize("bounds", [None, [0, 300, 577]])
def test_linear_avx512_avx2_and_scalar_paths_give_the_same_bits(bounds) -> None:
    """Every row count 1-9 (tiles of 4 rows and the 1-3 left) and a row block past 32, one K
    chain or two segments: the three paths are the same fma chains."""
    if cpu_kernels.linear_lanes() != 16:
        pytest.skip("the linear has no AVX-512 path on this CPU")
    g = torch.Generator().manual_seed(11)
    w = torch.randn(100, 577, generator=g)
    for m in (*range(1, 10), 37):
        x = torch.randn(m, 577, generator=g) * torch.logspace(0, 3, 577)
        paths = []
        for avx512, vectorized in ((True, True), (False, True), (False, False)):
            before = cpu_kernels.set_avx512(avx512), cpu_kernels.set_vectorized(vectorized)
            try:
                assert cpu_kernels.linear_lanes() == (16 if avx512 else 8 if vectorized else 1)
                paths.append(_packed_linear(x, w, bounds))
            finally:
                cpu_kernels.set_avx512(before[0]), cpu_kernels.set_vectorized(before[1])
        assert torch.equal(paths[0], paths[1]) and torch.equal(paths[0], paths[2]), m
        assert not torch.equal(paths[0], x @ w.T), m  # the check can fail: MKL sums otherwise


def _mixed_attention_case(hq: int, hkv: int, d: int, block: int, seed: int):
    """Two sequences over shuffled blocks: a 37-row causal chunk ending 3 keys short of the cache,
    and 6 single rows of assorted lengths (one of them 0 keys: a padding row)."""
    g = torch.Generator().manual_seed(seed)
    nblk = max(16, 2 * (320 // block))
    k, v = torch.randn(nblk, block, hkv, d, generator=g), torch.randn(nblk, block, hkv, d, generator=g)
    tables = torch.randperm(nblk, generator=g).to(torch.int32).view(2, nblk // 2).contiguous()
    cap = nblk // 2 * block
    nkeys = list(range(cap - 39, cap - 2)) + [1, 2, 50, cap, 3, 0]
    seq = [0] * 37 + [1] * 6
    q = torch.randn(len(seq), hq, d, generator=g)
    plan = reference.SplitPlan(tables, torch.tensor(seq, dtype=torch.int32),
                               torch.tensor(nkeys, dtype=torch.int32))
    return q, k, v, plan


def _row_plan(plan: reference.SplitPlan, t: int) -> reference.SplitPlan:
    return reference.SplitPlan(plan.block_tables, plan.q_seq[t:t + 1], plan.q_nkeys[t:t + 1])


def test_batched_query_attention_equals_one_query_at_a_time() -> None:
    # GQA groups of 3 and 1, head dims 64 and 32, splits that do not divide the key counts
    for hq, hkv, d, block, split in [(9, 3, 64, 16, 128), (6, 2, 64, 16, 20), (4, 4, 32, 8, 7)]:
        q, k, v, plan = _mixed_attention_case(hq, hkv, d, block, seed=hq + d)
        whole = reference.split_attention(q, k, v, plan, d ** -0.5, split)
        for t in range(q.shape[0]):
            alone = reference.split_attention(q[t:t + 1], k, v, _row_plan(plan, t), d ** -0.5, split)
            assert torch.equal(alone, whole[t:t + 1]), (hq, hkv, d, split, t)
        assert torch.equal(whole[-1], torch.zeros_like(whole[-1]))  # the 0-key row
        # negative control: another split size gives other bits, so equality above is not trivial
        other = reference.split_attention(q, k, v, plan, d ** -0.5, split + 1)
        assert not torch.equal(other, whole)


def test_batched_attention_avx2_equals_the_scalar_path_for_mixed_lengths() -> None:
    q, k, v, plan = _mixed_attention_case(9, 3, 64, 16, seed=5)
    vec = reference.split_attention(q, k, v, plan, 0.125, 128)
    before = cpu_kernels.set_vectorized(False)
    try:
        scalar = reference.split_attention(q, k, v, plan, 0.125, 128)
    finally:
        cpu_kernels.set_vectorized(before)
    assert torch.equal(vec, scalar)


def test_attention_with_the_kernel_exp_is_close_to_float64() -> None:
    q, k, v, plan = _mixed_attention_case(6, 2, 64, 16, seed=6)
    out = reference.split_attention(q * 4, k, v, plan, 0.125, 16)  # wide score range
    ref = reference.split_attention((q * 4).double(), k.double(), v.double(), plan, 0.125, 16)
    assert (out.double() - ref).abs().max() < 1e-5


def _packed_linear(x: torch.Tensor, w: torch.Tensor, k_bounds=None) -> torch.Tensor:
    return cpu_kernels.linear(x.contiguous(), cpu_kernels.pack_weight(w.contiguous()), w.shape[0],
                              k_bounds)


@pytest.mark.parametrize("bounds", [[0, 200, 390, 577], [0, 60, 200, 260, 390, 400, 577],
                                    [0, 70, 140, 200, 290, 350, 430, 500, 577]])
def test_segmented_k_linear_equals_the_tree_sum_of_per_segment_products(bounds) -> None:
    """3, 6 and 8 segments, longer and shorter than the kernel's K block: the kernel adds the
    per-segment chains in ``tree_sum``'s order (for 6 and 8 another sum than the chain)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(100, 577, generator=g)
    segs = [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    xs = [torch.randn(m, 577, generator=g) * torch.logspace(0, 3, 577) for m in (1, 2, 3, 17, 128)]
    results = {}
    for vectorized in (True, False):
        before = cpu_kernels.set_vectorized(vectorized)
        try:
            for x in xs:
                m = x.shape[0]
                parts = [_packed_linear(x[:, s], w[:, s]) for s in segs]
                got = results[vectorized, m] = _packed_linear(x, w, bounds)
                assert torch.equal(got, tree_sum(parts)), (vectorized, m)
                if len(parts) > 3:  # negative control: the chain is another sum
                    assert not torch.equal(got, functools.reduce(torch.add, parts)), m
                assert torch.equal(_packed_linear(x, w, torch.tensor(bounds)), got)
                assert torch.equal(_packed_linear(x, w, [0, 577]), _packed_linear(x, w))
                # negative control: the segmented sum is another arithmetic than one chain
                assert not torch.equal(got, _packed_linear(x, w))
        finally:
            cpu_kernels.set_vectorized(before)
    assert all(torch.equal(results[True, x.shape[0]], results[False, x.shape[0]]) for x in xs)

