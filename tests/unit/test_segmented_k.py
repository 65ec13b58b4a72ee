"""Segmented K on the CPU backend (``linear(x, w, k_bounds=...)``, ``linear_partials``,
``silu_mul``) and the decoder's row-parallel layers on one device against their tensor-parallel
path.

What they prove: ``tree_sum`` gives the same bits level by level and by halves, and is another sum
than the chain beyond three partials (so the tests below could fail); a rank's block of S/N
segments is a subtree exactly where ``rank_blocks_are_subtrees`` says, and then the tree of the
block sums is the tree of all S; the segmented product is the tree-ordered fp32 sum of each
segment's product computed alone on its contiguous slice (what a TP rank computes), row by row
whatever M; a rank's shard spans are whole segments (o_proj: its KV groups' columns); the
row-parallel layer's tensor-parallel path gathers one fp32 sum per rank where its blocks are
subtrees (all its partials where not) and gives one device's bits either way; the decoder's
hidden states and logits with every row-parallel layer on its gathered path equal the one-call
path bitwise; and, as negative controls, one K chain gives other bits than the segments.
"""

from __future__ import annotations

import functools

import pytest
import torch

from samebits.distributed.group import TPGroup
from samebits.models.parallel import RowParallelLinear, ShardSpec
from samebits.ops import cpu_kernels, get_backend
from samebits.ops.backend import (
    AttentionMetadata,
    _tree_by_halves,
    _tree_by_levels,
    bounds,
    check_k_bounds,
    rank_blocks_are_subtrees,
    row_parallel_bounds,
    tree_sum,
)
from tests.tiny_models import TP_LLAMA_CONFIG, write_config

OPS = get_backend("cpu", batch_invariant=True)


def _partials(n: int, seed: int = 0) -> torch.Tensor:
    """[n, 16, 96] fp32 partials over a wide range (their sums round)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, 96, generator=g) * torch.logspace(0, 4, 96)


def _chain(partials) -> torch.Tensor:
    acc = partials[0].clone()
    for p in partials[1:]:
        acc += p
    return acc


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 64])
def test_tree_sum_by_levels_equals_by_halves(n):
    p = _partials(n, seed=n)
    levels = _tree_by_levels(p)
    assert torch.equal(levels, _tree_by_halves(list(p), 0, n))
    assert torch.equal(tree_sum(p), levels) and torch.equal(tree_sum(list(p)), levels)


def test_tree_sum_is_the_chain_up_to_three_partials_and_differs_beyond():
    for n in (1, 2, 3):
        p = _partials(n)
        assert torch.equal(tree_sum(p), _chain(p))
    for n in (4, 5, 6, 8):  # negative control: another order, other bits
        p = _partials(n)
        assert not torch.equal(tree_sum(p), _chain(p)), n
    p = _partials(5)  # the left half is the larger: ((p0 + p1) + p2) + (p3 + p4)
    assert torch.equal(tree_sum(p), ((p[0] + p[1]) + p[2]) + (p[3] + p[4]))


@pytest.mark.parametrize("s", range(1, 17))
def test_rank_blocks_are_subtrees_exactly_where_block_sums_give_the_tree(s):
    """Where the helper says so, the tree of the N block sums (each block tree-summed alone) is
    the tree of all S partials, bitwise; where it does not, the two orders differ (6 / 3, 12 / 3:
    the fallback gathers every partial)."""
    p = _partials(s, seed=s)
    for n in (d for d in range(1, s + 1) if s % d == 0):
        blocks = tree_sum(torch.stack([tree_sum(b) for b in p.split(s // n)]))
        if rank_blocks_are_subtrees(s, n):
            assert torch.equal(blocks, tree_sum(p)), (s, n)
        elif (s, n) in ((6, 3), (12, 3)):
            assert not torch.equal(blocks, tree_sum(p)), (s, n)
    assert all(rank_blocks_are_subtrees(8, n) for n in (1, 2, 4, 8))
    assert rank_blocks_are_subtrees(6, 2) and rank_blocks_are_subtrees(12, 4)
    assert not (rank_blocks_are_subtrees(6, 3) or rank_blocks_are_subtrees(12, 3)
                or rank_blocks_are_subtrees(6, 4))


def _data(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(0, 2, k)  # wide range: sums round
    return x.to(dtype), (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)


def _alone(x: torch.Tensor, w: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Segment [lo, hi)'s product as a rank computes it: the kernel on contiguous copies."""
    cdt = torch.float32 if x.dtype != torch.float64 else torch.float64
    xs, ws = x[:, lo:hi].to(cdt).contiguous(), w[:, lo:hi].contiguous()
    return cpu_kernels.linear(xs, cpu_kernels.packed(ws, cdt), w.shape[0])


@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_rank_spans_are_whole_segments(n):
    """o_proj's columns: rank r owns KV groups [r 6/n, (r+1) 6/n); down_proj's: the same
    segments of the uneven intermediate slices; the ranks' spans tile the dimension."""
    o = [ShardSpec(1, (192,), 6, r, n) for r in range(n)]
    down = [ShardSpec(1, (200,), 6, r, n) for r in range(n)]
    per = 6 // n
    for r in range(n):
        assert o[r].span(0) == (r * per * 32, (r + 1) * per * 32)  # 2 heads of 16 per group
        cuts = bounds(200, 6)[r * per:(r + 1) * per]
        assert down[r].span(0) == (cuts[0][0], cuts[-1][1])
        assert down[r].local_chains(6) == tuple((a - cuts[0][0], b - cuts[0][0]) for a, b in cuts)
    assert [s.span(0) for s in down][-1][1] == 200 and sum(down[0].sizes(0)) == 200
    assert bounds(200, 6) == [(0, 34), (34, 68), (68, 101), (101, 134), (134, 167), (167, 200)]
    assert row_parallel_bounds(192, 3) == ((0, 64), (64, 128), (128, 192))


@pytest.mark.parametrize("bad", [(), ((0, 5), (6, 10)), ((0, 5), (5, 9)), ((1, 10),),
                                 ((0, 5), (5, 5), (5, 10))])
def test_check_k_bounds_rejects_what_does_not_tile_k(bad):
    with pytest.raises(ValueError):
        check_k_bounds(bad, 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("k,s", [(200, 6), (192, 3), (200, 8)])
def test_segmented_linear_is_the_tree_sum_of_segments_alone(dtype, k, s):
    x, w = _data(37, k, 40, dtype)
    b = torch.randn(40).to(dtype)
    kb = row_parallel_bounds(k, s)
    partials = [_alone(x, w, lo, hi) for lo, hi in kb]
    want = tree_sum(partials).to(dtype) + b
    got = OPS.linear(x, w, b, k_bounds=kb)
    assert torch.equal(got, want)
    assert torch.equal(OPS.linear_partials(x, w, kb), torch.stack(partials))
    for m in (1, 2, 16, 17):  # rows do not depend on M or position
        assert torch.equal(OPS.linear(x[3:3 + m], w, b, k_bounds=kb), got[3:3 + m])
    assert OPS.linear(x.view(37, 1, k), w, k_bounds=kb).shape == (37, 1, 40)
    exact = x.double() @ w.double().T + b.double()
    assert (got.double() - exact).norm() / exact.norm() < (1e-5 if dtype != torch.bfloat16 else 1e-2)


@pytest.mark.smoke
def test_negative_control_one_k_chain_differs_from_segments():
    x, w = _data(37, 200, 40, torch.float32)
    assert not torch.equal(OPS.linear(x, w), OPS.linear(x, w, k_bounds=row_parallel_bounds(200, 6)))


def test_segment_packs_follow_in_place_updates():
    x, w = _data(5, 200, 40, torch.float32)
    kb = row_parallel_bounds(200, 6)
    before = OPS.linear(x, w, k_bounds=kb)
    with torch.no_grad():
        w.mul_(2)  # bumps the version: the kept packs are stale
    assert torch.equal(OPS.linear(x, w, k_bounds=kb), (before * 2))


def test_silu_mul_gives_each_segment_a_ranks_bits():
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(20, 400, generator=g) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    kb = row_parallel_bounds(200, 6)
    got = OPS.silu_mul(gate, up, kb)
    for lo, hi in kb:  # a rank's gate/up product holds only its slice: [T, 2 (hi - lo)]
        local = torch.cat([gate[:, lo:hi], up[:, lo:hi]], dim=-1)
        rank_gate, rank_up = local.chunk(2, dim=-1)
        assert torch.equal(got[:, lo:hi], OPS.silu_mul(rank_gate, rank_up))


class _Exchange(TPGroup):
    """Rank ``rank`` of N ranks run one after another in this process: ``all_gather`` records
    what the rank sends; once every rank has sent, it returns their tensors in rank order."""

    def __init__(self, rank: int, world_size: int, sent: dict[int, torch.Tensor]) -> None:
        super().__init__(rank, world_size)
        self.sent = sent

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self.sent[self.rank] = x.clone()
        if len(self.sent) < self.world_size:
            return torch.cat([x] * self.world_size)  # a first pass: its result is not used
        return torch.cat([self.sent[r] for r in range(self.world_size)])


@pytest.mark.parametrize("s,n,sent", [(8, 2, 1), (8, 4, 1), (8, 8, 1), (6, 2, 1), (6, 3, 2),
                                      (6, 6, 1), (3, 3, 1)])
def test_row_parallel_ranks_gather_one_sum_each_where_blocks_are_subtrees(s, n, sent):
    """Each rank's ``gathered`` sends [sent, T, H] fp32 (one tree-summed local where its S/N
    segments are a subtree, else its S/N partials) and returns one device's segmented linear
    (bias included), bitwise, on every rank."""
    k, h, t = 40 * s + 3, 48, 9  # uneven segments
    x, w = _data(t, k, h, torch.bfloat16, seed=s + n)
    b = torch.randn(h).to(torch.bfloat16)
    want = OPS.linear(x, w, b, k_bounds=row_parallel_bounds(k, s))
    exchanged: dict[int, torch.Tensor] = {}
    layers = [RowParallelLinear(k, h, s, _Exchange(r, n, exchanged), s, bias=True) for r in range(n)]
    for layer in layers:
        lo, hi = layer.weight.spec.span(0)
        layer.weight.data, layer.bias.data = w[:, lo:hi].clone(), b.clone()
        layer.x = x[:, lo:hi]
    for _ in range(2):  # the second pass gathers what every rank sent in the first
        outs = [layer.gathered(OPS, layer.x) for layer in layers]
    assert all(e.shape == (sent, t, h) and e.dtype == torch.float32 for e in exchanged.values())
    assert all(torch.equal(out, want) for out in outs)


def _meta(n: int) -> AttentionMetadata:
    meta = AttentionMetadata(torch.tensor([[0, 1, 2]], dtype=torch.int32),
                             torch.tensor([n], dtype=torch.int32),
                             torch.tensor([0, n], dtype=torch.int32), torch.arange(n), (n,),
                             (0, n), 16, 128)
    return OPS.plan_attention(meta)


def test_decoder_one_call_equals_gathered_partials_path_bitwise(tmp_path):
    """The decoder on one device (o_proj / down_proj: one segmented ``linear`` call each) against
    the same model with every row-parallel layer on its tensor-parallel path (per-segment
    partials on the rank's columns, tree-summed and gathered, cast, bias)."""
    from samebits import LLM
    path = write_config(tmp_path, TP_LLAMA_CONFIG)  # 12 / 6 heads of 16, intermediate 200
    model = LLM(str(path), load_format="dummy", num_kv_blocks=8).engine.runner.model
    rows = [m for m in model.modules() if isinstance(m, RowParallelLinear)]
    assert len(rows) == 4
    for n in (1, 5, 40):
        ids, pos = torch.arange(10, 10 + n), torch.arange(n)
        with torch.inference_mode():
            hidden = model(ids, pos, _caches(), _meta(n))
            for m in rows:
                m.forward = functools.partial(RowParallelLinear.gathered, m)
            try:
                gathered = model(ids, pos, _caches(), _meta(n))
            finally:
                for m in rows:
                    del m.forward
            assert torch.equal(hidden, gathered), n
            assert torch.equal(model.compute_logits(hidden), model.compute_logits(gathered))


def _caches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(4, 16, 6, 16), torch.zeros(4, 16, 6, 16)) for _ in range(2)]
