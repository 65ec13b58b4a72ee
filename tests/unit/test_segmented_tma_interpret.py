"""``_segmented_tma_kernel`` (segmented K in the persistent TMA kernel) on CPU, under
TRITON_INTERPRET=1: its output is the split schedule's, bit for bit -- each K segment's fp32
partial from zero, the partials added in ``tree_sum``'s order, one cast -- for 2, 3, 4 and 8
segments, through ``linear`` (the bias added after the cast) and ``linear_sum`` (fp32, uncast),
for rows past a tile's end and whatever M. The interpreter's ``tl.dot`` is tests/conftest.py's
fixed-order model, so both schedules are compared with the same BLOCK_K; fp16 only (the
interpreter's bf16 ``tl.dot`` is wrong; bf16 is checked on the GPU, tests/gpu)."""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit runs, i.e. at the modules' import

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

for _name in ("tree", "linear_kernels", "linear"):  # re-import under the interpreter if compiled before
    _full = f"samebits.ops.triton.{_name}"
    if _full in sys.modules:
        importlib.reload(sys.modules[_full])
from samebits.ops.backend import row_parallel_bounds, tree_sum  # noqa: E402
from samebits.ops.triton import linear as L  # noqa: E402
from samebits.ops.triton import linear_tiles  # noqa: E402

SPLIT = L.GemmConfig(16, 16, 32, 4, 2)  # the pointer kernel's split schedule
TMA = L.GemmConfig(16, 16, 32, 4, 2, tma=True)  # the same BLOCK_K, the segmented TMA kernel


def _data(m: int, k: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(0, 2, k)  # segments of unlike scale
    w = torch.randn(n, k, generator=g) / k ** 0.5
    return x.half(), w.half(), torch.randn(n, generator=g).half()


def _run(x, w, out, cfg, layout):
    L.run(x, w, None, out, cfg, layout)
    return out


@pytest.fixture
def launches(monkeypatch):
    """Counts ``_segmented_tma_kernel`` launches."""
    calls = []
    real = L._SEG_TMA

    def spy(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    spy.intern, spy.direct = real.intern, real.direct
    monkeypatch.setattr(L, "_SEG_TMA", spy)
    return calls


@pytest.mark.parametrize("segs", [2, 3, 4, 8])
def test_segmented_tma_kernel_is_the_split_schedule(segs, launches):
    k, n = 32 * 2 * segs, 48  # segments of two BLOCK_K steps
    x, w, _ = _data(37, k, n, segs)  # 37 rows: the last row tile is partial
    layout = L.SegmentLayout(segs, 64)
    parts = _run(x, w, torch.empty(segs, 37, n), SPLIT, layout)
    for dtype in (torch.float16, torch.float32):  # linear's cast output, linear_sum's fp32
        want = _run(x, w, torch.empty(37, n, dtype=dtype), SPLIT, layout)
        assert torch.equal(want, tree_sum(parts).to(dtype))
        got = _run(x, w, torch.empty(37, n, dtype=dtype), TMA, layout)
        assert torch.equal(got, want), dtype
        for lo, hi in ((0, 1), (5, 22), (20, 37)):  # a row's bits whatever M and its tile
            sub = _run(x[lo:hi], w, torch.empty(hi - lo, n, dtype=dtype), TMA, layout)
            assert torch.equal(sub, want[lo:hi]), (dtype, lo, hi)
    assert len(launches) == 8


@pytest.mark.parametrize("segs", [2, 3, 4, 8])
def test_linear_and_linear_sum_take_the_segmented_tma_kernel_above_64_rows(segs, launches):
    """The public ops, 65+ rows: ``linear`` casts the tree sum then adds the bias in fp16,
    ``linear_sum`` returns the fp32 tree sum; a row's bits do not depend on M."""
    k, n = 64 * segs, 40  # BLOCK_K 64: one step per segment
    x, w, b = _data(70, k, n, 10 + segs)
    kb = row_parallel_bounds(k, segs)
    parts = _run(x, w, torch.empty(segs, 70, n), L.GemmConfig(16, 16, 64, 4, 2),
                 L.SegmentLayout.from_bounds(kb, k))
    total = tree_sum(parts)
    got = L.linear(x, w, b, k_bounds=kb)
    assert torch.equal(got, total.half() + b)
    assert torch.equal(L.linear(x, w, k_bounds=kb), total.half())
    assert torch.equal(L.linear_sum(x, w, kb), total)
    assert torch.equal(L.linear(x[:66], w, b, k_bounds=kb), got[:66])
    assert len(launches) == 4
    assert not torch.equal(L.linear(x, w, b), got)  # negative control: one K chain differs


def test_uneven_segments_keep_the_split_schedule(launches):
    """Segments that are not whole BLOCK_K steps (here 100 columns) take the pointer kernel."""
    x, w, b = _data(70, 300, 40, 3)
    kb = row_parallel_bounds(300, 3)
    parts = torch.stack([L.partials(x[:, lo:hi].contiguous(), w[:, lo:hi].contiguous(),
                                    ((0, hi - lo),))[0] for lo, hi in kb])
    assert torch.equal(L.linear(x, w, b, k_bounds=kb), tree_sum(parts).half() + b)
    assert launches == []


@pytest.mark.parametrize("peer", [None, True])
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("segs", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("m", [128, 256, 1024, 8192])
def test_segmented_tma_tiles_fit_shared_memory(segs: int, m: int, out: torch.dtype,
                                               peer: bool | None) -> None:
    """Every tile the plan launches fits a Hopper program's shared memory: its stages and the
    output staging tile (fp32 for ``linear_sum``, twice a bf16 one), and with a peer output the
    scratch of its stores (as much again)."""
    layout = L.SegmentLayout(segs, 512)
    cfg = linear_tiles.segmented_tma_config(segs, m)
    plan = L._seg_tma_plan(m, 4096, 512 * segs, torch.bfloat16, torch.bfloat16, out, layout,
                           cfg, True, peer)
    bm, bn, bk, stages = *plan.tail[5:8], plan.options["num_stages"]
    cfg = L.GemmConfig(bm, bn, bk, 4, stages, tma=True, subtile=plan.tail[-1])
    assert L.smem_bytes(cfg, torch.bfloat16, out, 1 + (peer is not None)) <= L.SMEM_BYTES
    assert layout.even(512 * segs, bk)


def test_a_ranks_one_fp32_chain_is_its_split_partial_above_64_rows(launches):
    """A TP rank's one chain (``linear_sum`` over one range) takes the segmented TMA kernel
    above 64 rows, its output stored in two column halves above 1024 rows (``subtile``), and
    into a peer output too: the split program's one partial, bit for bit, and a row's bits
    whatever M. Negative control: two chains differ."""
    k, n = 256, 300  # past one 128x256 tile: both halves of the second hold columns
    x, w, _ = _data(1100, k, n, 7)
    one = ((0, k),)
    want = L.partials(x, w, one)[0]
    for m in (70, 200, 300, 1100):
        assert torch.equal(L.linear_sum(x[:m], w, one), want[:m]), m
    out, peer = torch.full((1100, n), float("nan")), torch.full((1100, n), float("nan"))
    plan = L._seg_tma_plan(1100, n, k, x.dtype, w.dtype, torch.float32, L.SegmentLayout(1, k),
                           linear_tiles.segmented_tma_config(1, 1100), False)
    assert plan.tail[-1], "the 128x256 tile stores its fp32 output in two halves"
    L.linear_sum(x, w, one, out, peer)
    assert torch.equal(out, want) and torch.equal(peer, want)
    assert len(launches) == 5
    assert not torch.equal(L.linear_sum(x, w, row_parallel_bounds(k, 2)), want)


def test_chains_merged_from_uneven_segments_equal_the_ranks_slices():
    """Chains of unequal length (200 columns in 6 uneven KV-head segments, merged in two: 101
    and 99), which the segmented kernels do not take: ``linear``, ``partials``
    and ``linear_sum`` give each chain's product on its own slice -- what a TP 2 rank holding
    that slice computes -- tree-summed. Negative control: one K chain differs."""
    from samebits.ops.backend import chain_bounds
    x, w, b = _data(9, 200, 24, 3)
    kb = chain_bounds(200, 6, 2)
    assert {hi - lo for lo, hi in kb} == {101, 99}
    ranks = torch.stack([L.linear_sum(x[:, lo:hi].contiguous(), w[:, lo:hi].contiguous(),
                                      ((0, hi - lo),)) for lo, hi in kb])
    assert torch.equal(L.partials(x, w, kb), ranks)
    assert torch.equal(L.linear_sum(x, w, kb), tree_sum(ranks))
    assert torch.equal(L.linear(x, w, b, k_bounds=kb), tree_sum(ranks).half() + b)
    assert not torch.equal(L.linear(x, w, b), L.linear(x, w, b, k_bounds=kb))
