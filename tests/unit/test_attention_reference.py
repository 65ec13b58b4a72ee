"""Paged split attention of the CPU reference backend (``samebits.ops.attention``).

The output of the query at position p must be a function of q and of K/V at positions [0, p] of its
own sequence alone: bitwise the same whether the prompt is prefilled at once, in chunks of odd
sizes, or decoded one token at a time; batched with other sequences of any lengths in any order;
with its KV in any physical blocks; on either side of a split boundary. And it must be attention:
close to a float64 causal softmax.

Every step here goes through the engine's path: this step's K/V are written into the paged cache
with ``store_kv`` first, then attention reads only the cache. Unused cache slots hold random
garbage (finite), so reading a slot outside the context would show.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import samebits.ops as ops
from samebits.ops import AttentionMetadata, get_backend, store_kv

INV = get_backend("cpu", True)
STD = get_backend("cpu", False)

Step = list[tuple[int, int]]  # (sequence, number of new tokens) for each sequence in the batch


@dataclass
class World:
    """Fixed q/k/v for every position of every sequence: the 'model' behind the steps."""

    q: list[torch.Tensor]  # [L, Hq, D]
    k: list[torch.Tensor]  # [L, Hkv, D]
    v: list[torch.Tensor]
    hq: int
    hkv: int
    d: int
    dtype: torch.dtype

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.d)

    def lens(self) -> list[int]:
        return [t.shape[0] for t in self.q]


def make_world(lens: list[int], hq: int = 6, hkv: int = 2, d: int = 64,
               dtype: torch.dtype = torch.float32, seed: int = 0) -> World:
    g = torch.Generator().manual_seed(seed)

    def rnd(n: int, h: int) -> torch.Tensor:
        return torch.randn(n, h, d, generator=g).to(dtype)
    return World([rnd(n, hq) for n in lens], [rnd(n, hkv) for n in lens],
                 [rnd(n, hkv) for n in lens], hq, hkv, d, dtype)


def run_steps(world: World, steps: list[Step], *, block_size: int = 16, split_size: int = 32,
              block_order: list[int] | None = None, backend=INV, plan: bool = True,
              cache_fill: float | None = None, num_blocks: int | None = None,
              table_pad: int = 0, prefix_hits: dict[int, tuple[int, int]] | None = None
              ) -> dict[tuple[int, int], torch.Tensor]:
    """Run ``steps`` through a fresh paged cache; returns {(sequence, position): out [Hq, D]}.

    Blocks are handed out in ``block_order`` (default 0, 1, 2, ...) as sequences grow. Cache slots
    start as random garbage, or ``cache_fill`` everywhere if given. ``prefix_hits[s] = (t, n)``:
    when s is first scheduled, it takes t's first n blocks as its own (a prefix-cache hit) and
    starts computing after them."""
    need = sum(-(-n // block_size) for n in world.lens())
    if num_blocks is None:
        num_blocks = max(block_order) + 1 if block_order is not None else need + 2
    free = list(block_order) if block_order is not None else list(range(num_blocks))
    shape = (num_blocks, block_size, world.hkv, world.d)
    if cache_fill is None:
        g = torch.Generator().manual_seed(12345)
        kc = (torch.randn(shape, generator=g) * 3).to(world.dtype)
        vc = (torch.randn(shape, generator=g) * 3).to(world.dtype)
    else:
        kc = torch.full(shape, cache_fill, dtype=world.dtype)
        vc = torch.full(shape, cache_fill, dtype=world.dtype)
    tables: dict[int, list[int]] = {}
    done: dict[int, int] = {}
    out: dict[tuple[int, int], torch.Tensor] = {}
    for step in steps:
        qs, ks, vs, slots, seq_lens, qsl, rows = [], [], [], [], [], [0], []
        for s, n in step:
            if s not in tables and prefix_hits and s in prefix_hits:
                src, n_blocks = prefix_hits[s]
                tables[s] = tables[src][:n_blocks]
                done[s] = n_blocks * block_size
            start = done.get(s, 0)
            end = start + n
            assert 0 < n and end <= world.lens()[s]
            table = tables.setdefault(s, [])
            while len(table) * block_size < end:
                table.append(free.pop(0))
            qs.append(world.q[s][start:end])
            ks.append(world.k[s][start:end])
            vs.append(world.v[s][start:end])
            slots += [table[p // block_size] * block_size + p % block_size
                      for p in range(start, end)]
            seq_lens.append(end)
            qsl.append(qsl[-1] + n)
            rows += [(s, p) for p in range(start, end)]
            done[s] = end
        width = max(len(tables[s]) for s, _ in step) + table_pad
        bt = [tables[s] + [0] * (width - len(tables[s])) for s, _ in step]
        meta = AttentionMetadata(
            block_tables=torch.tensor(bt, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            seq_lens_list=tuple(seq_lens), query_start_loc_list=tuple(qsl),
            block_size=block_size, split_size=split_size)
        store_kv(torch.cat(ks), torch.cat(vs), kc, vc, meta.slot_mapping)
        if plan:
            meta = backend.plan_attention(meta)
        o = backend.attention(torch.cat(qs), kc, vc, meta, world.scale)
        assert o.shape == (len(rows), world.hq, world.d) and o.dtype == world.dtype
        for r, key in enumerate(rows):
            out[key] = o[r]
    return out


def prefill(s: int, length: int) -> list[Step]:
    return [[(s, length)]]


def chunks(s: int, length: int, size: int, first: int = 0) -> list[Step]:
    """``first`` tokens in one step (if any), then the rest in chunks of ``size``."""
    steps = [[(s, first)]] if first else []
    return steps + [[(s, min(size, length - i))] for i in range(first, length, size)]


def mismatches(a: dict, b: dict) -> list[tuple[int, int]]:
    common = sorted(set(a) & set(b))
    assert common
    return [key for key in common if not torch.equal(a[key], b[key])]


def causal_reference(world: World, s: int) -> torch.Tensor:
    """Plain causal softmax attention in float64: [L, Hq, D]."""
    q, k, v = (t[s].double() for t in (world.q, world.k, world.v))
    g = world.hq // world.hkv
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * world.scale
    n = q.shape[0]
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


HEADS = pytest.mark.parametrize(("hq", "hkv"), [(6, 2), (4, 4)], ids=["gqa6x2", "mha4"])


# ---- one sequence: prefill == chunked prefill == decode ----------------------------------------

@HEADS
def test_prefill_chunked_prefill_and_decode_are_bitwise_equal(hq: int, hkv: int) -> None:
    n = 72  # three splits of 32
    world = make_world([n], hq, hkv)
    whole = run_steps(world, prefill(0, n))
    arrangements = [chunks(0, n, 7), chunks(0, n, 13), chunks(0, n, 37), chunks(0, n, 1)]
    for steps in arrangements:
        assert mismatches(whole, run_steps(world, steps)) == []
    # negative control: stock SDPA gives other bits for a query in a chunk or decoded alone
    std_whole = run_steps(world, prefill(0, n), backend=STD)
    assert any(mismatches(std_whole, run_steps(world, steps, backend=STD))
               for steps in arrangements)


def test_prefill_chunks_and_decode_bitwise_equal_in_bf16() -> None:
    n = 70
    world = make_world([n], dtype=torch.bfloat16, seed=3)
    whole = run_steps(world, prefill(0, n))
    arrangements = [chunks(0, n, 13), chunks(0, n, 1, first=40)]
    for steps in arrangements:
        assert mismatches(whole, run_steps(world, steps)) == []
    std_whole = run_steps(world, prefill(0, n), backend=STD)
    assert any(mismatches(std_whole, run_steps(world, steps, backend=STD))
               for steps in arrangements)


@pytest.mark.parametrize("split_size", [32, 256])
def test_bitwise_equal_across_the_split_boundary(split_size: int) -> None:
    n = split_size + 6
    world = make_world([n], seed=1)
    whole = run_steps(world, prefill(0, n), split_size=split_size)
    edge = [(0, p) for p in (split_size - 2, split_size - 1, split_size, split_size + 1)]
    for steps in (chunks(0, n, 1, first=split_size - 3),  # decode across the boundary
                  chunks(0, n, 37),
                  chunks(0, n, 7, first=split_size - 1),  # a chunk starting at the boundary
                  [[(0, split_size)], [(0, n - split_size)]]):
        got = run_steps(world, steps, split_size=split_size)
        assert mismatches(whole, got) == []
        assert all(torch.equal(whole[k], got[k]) for k in edge)


def test_two_split_boundaries_with_a_small_split() -> None:
    world = make_world([140], 6, 2, d=32, seed=2)
    whole = run_steps(world, prefill(0, 140), split_size=32)
    steps = chunks(0, 140, 13, first=30)
    assert mismatches(whole, run_steps(world, steps, split_size=32)) == []
    assert mismatches(whole, run_steps(world, chunks(0, 140, 1, first=60), split_size=32)) == []


# ---- batches ---------------------------------------------------------------------------------
# The standard backend runs SDPA once per sequence over its own gathered context, so neighbours,
# batch order and physical block placement cannot change its bits either: no stock negative
# control exists for these three properties. test_one_ulp_change_in_context_changes_the_output
# shows the exact comparison would catch a one-ulp difference.

@HEADS
def test_batched_with_other_sequences_in_any_order_bitwise_equal(hq: int, hkv: int) -> None:
    lens = [50, 3, 90, 17, 1, 33]
    world = make_world(lens, hq, hkv, seed=4)
    alone = {}
    for s, n in enumerate(lens):
        alone.update(run_steps(world, prefill(s, n)))
    everything = [[(s, n) for s, n in enumerate(lens)]]
    reversed_ = [[(s, n) for s, n in reversed(list(enumerate(lens)))]]
    shuffled = [[(s, lens[s]) for s in (3, 0, 5, 2, 4, 1)]]
    # mixed steps: some sequences decode while others prefill or take a chunk
    mixed = [
        [(2, 40), (0, 10)],
        [(0, 1), (1, 3), (2, 25), (5, 16)],
        [(3, 17), (2, 1), (0, 20), (4, 1)],
        [(0, 19), (5, 17), (2, 24)],
    ]
    for steps in (everything, reversed_, shuffled, mixed):
        assert mismatches(alone, run_steps(world, steps)) == []
    assert len(alone) == sum(lens)


def test_decode_batch_of_many_sequences_equals_each_alone() -> None:
    lens = [20 + 7 * i for i in range(12)]
    world = make_world(lens, 6, 2, d=32, seed=5)
    prefills = [[(s, n - 1) for s, n in enumerate(lens)]]
    together = run_steps(world, prefills + [[(s, 1) for s in range(12)]])
    for s, n in enumerate(lens):
        alone = run_steps(world, [[(s, n - 1)], [(s, 1)]])
        assert torch.equal(alone[(s, n - 1)], together[(s, n - 1)])


@HEADS
def test_kv_in_permuted_physical_blocks_bitwise_equal(hq: int, hkv: int) -> None:
    lens = [75, 40, 9]
    world = make_world(lens, hq, hkv, seed=6)
    steps = [[(0, 30), (1, 40), (2, 5)], [(0, 45), (2, 4)]]
    base = run_steps(world, steps)
    need = 5 + 3 + 1
    for seed in range(3):
        order = torch.randperm(need + 6, generator=torch.Generator().manual_seed(seed)).tolist()
        assert mismatches(base, run_steps(world, steps, block_order=order)) == []
    assert mismatches(base, run_steps(world, steps, block_order=list(range(need + 6))[::-1])) == []


def test_prefix_cache_hit_reads_shared_blocks_with_the_same_bits() -> None:
    # sequences 0 and 1 share their first 40 tokens (q, k, v alike); 1 takes 0's first two
    # 16-token blocks from the prefix cache and computes from position 32 on
    world = make_world([60, 70], seed=15)
    for t in (world.q, world.k, world.v):
        t[1][:40] = t[0][:40]
    alone = run_steps(world, prefill(1, 70))
    hit = run_steps(world, [[(0, 60)], [(1, 38)]], prefix_hits={1: (0, 2)})
    assert sorted(p for s, p in hit if s == 1) == list(range(32, 70))
    assert mismatches(alone, hit) == []
    hit_chunked = run_steps(world, [[(0, 45)], [(1, 5), (0, 15)], [(1, 33)]],
                            prefix_hits={1: (0, 2)})
    assert mismatches(alone, hit_chunked) == []


def test_block_size_does_not_change_the_bits() -> None:
    world = make_world([80], seed=7)
    base = run_steps(world, chunks(0, 80, 13), block_size=16)
    for bs in (1, 4, 8, 32):
        assert mismatches(base, run_steps(world, chunks(0, 80, 13), block_size=bs)) == []


def test_planned_and_unplanned_metadata_give_the_same_bits() -> None:
    world = make_world([40, 66], seed=8)
    steps = [[(0, 20), (1, 33)], [(1, 33), (0, 20)]]
    assert mismatches(run_steps(world, steps), run_steps(world, steps, plan=False)) == []


def test_wider_block_table_than_needed_changes_nothing() -> None:
    world = make_world([30, 5], seed=9)
    steps = [[(0, 30), (1, 5)]]
    assert mismatches(run_steps(world, steps), run_steps(world, steps, table_pad=3)) == []


def test_samebits_ops_attention_is_the_reference_backend() -> None:
    world = make_world([21], seed=10)
    direct = run_steps(world, prefill(0, 21))
    meta_free = run_steps(world, prefill(0, 21), plan=False, backend=_OpsModule())
    assert mismatches(direct, meta_free) == []


class _OpsModule:
    """samebits.ops as a backend object (its attention picks the invariant backend itself)."""

    def plan_attention(self, meta: AttentionMetadata) -> AttentionMetadata:
        return meta

    def attention(self, q, k_cache, v_cache, meta, scale):
        return ops.attention(q, k_cache, v_cache, meta, scale)


# ---- sensitivity and correctness ---------------------------------------------------------------

def test_one_ulp_change_in_context_changes_the_output() -> None:
    world = make_world([20], seed=11)
    base = run_steps(world, prefill(0, 20))
    k = world.k[0].clone()
    k[3, 0, 5] = torch.nextafter(k[3, 0, 5], torch.tensor(math.inf))
    bumped = World(world.q, [k], world.v, world.hq, world.hkv, world.d, world.dtype)
    moved = mismatches(base, run_steps(bumped, prefill(0, 20)))
    # queries before position 3 cannot see key 3; those at 3.. must see the one-ulp change
    assert moved and all(p >= 3 for _, p in moved)


@HEADS
@pytest.mark.parametrize("split_size", [32, 256])
def test_close_to_float64_causal_softmax_attention(hq: int, hkv: int, split_size: int) -> None:
    lens = [split_size + 44, 45]
    world = make_world(lens, hq, hkv, seed=12)
    first = lens[0] // 2
    out = run_steps(world, [[(0, first), (1, 45)], [(0, lens[0] - first)]],
                    split_size=split_size)
    for s, n in enumerate(lens):
        got = torch.stack([out[(s, p)] for p in range(n)]).double()
        torch.testing.assert_close(got, causal_reference(world, s), rtol=1e-5, atol=1e-5)


def test_first_query_attends_only_to_itself() -> None:
    world = make_world([5], seed=13)
    out = run_steps(world, prefill(0, 5))
    g = world.hq // world.hkv
    expected = world.v[0][0].repeat_interleave(g, dim=0)
    assert torch.equal(out[(0, 0)], expected)


def test_query_output_ignores_nonfinite_values_in_a_block_outside_its_context() -> None:
    world = make_world([20], seed=14)
    clean = run_steps(world, prefill(0, 20), block_order=[1, 2, 3])
    poisoned = run_steps(world, prefill(0, 20), block_order=[1, 2, 3], cache_fill=math.inf)
    assert mismatches(clean, poisoned) == []
