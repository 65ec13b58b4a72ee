"""The block pool and KV cache manager (plain Python, no tensors): accounting, prefix caching keyed
by the numerics fingerprint, LRU eviction, and no leaked blocks after finish / abort / preemption."""

from __future__ import annotations

import pytest

from samebits.engine.kv_cache import BlockPool, KVCacheManager
from samebits.engine.scheduler import Scheduler
from samebits.engine.sequence import Sequence, SequenceStatus
from samebits.sampling_params import SamplingParams

BS = 4


def _seq(rid: str, tokens: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens), seed=0)


def _compute(kv: KVCacheManager, seq: Sequence, n: int, cached: list[int] = ()) -> None:
    """What admission + one engine step do to the bookkeeping: allocate, compute n, commit."""
    assert kv.allocate(seq, n, list(cached))
    seq.num_computed_tokens += len(cached) * kv.block_size + n
    kv.commit(seq)


def _check_refcounts(pool: BlockPool, seqs: list[Sequence]) -> None:
    """Every block's reference count is the number of live block tables holding it."""
    for b in range(pool.num_blocks):
        holders = sum(s.block_table.count(b) for s in seqs)
        assert pool.ref_cnt[b] == holders, (b, pool.ref_cnt[b], holders)
        assert (b in pool.free) == (holders == 0)
    assert pool.num_free + pool.num_used == pool.num_blocks


# ---- BlockPool ---------------------------------------------------------------------------------

def test_pool_allocate_and_release_accounting() -> None:
    pool = BlockPool(10)
    assert pool.num_free == 10 and pool.num_used == 0
    a = pool.allocate(3)
    b = pool.allocate(4)
    assert len(set(a + b)) == 7
    assert pool.num_free == 3 and pool.num_used == 7
    assert all(pool.ref_cnt[x] == 1 for x in a + b)
    pool.release(a)
    assert pool.num_free == 6
    pool.release(b)
    assert pool.num_free == 10 and pool.num_used == 0
    assert pool.ref_cnt == [0] * 10


def test_pool_refuses_to_over_allocate_and_to_over_release() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    assert pool.num_free == 0  # the failed call took nothing
    pool.release(blocks)
    with pytest.raises(RuntimeError):
        pool.release(blocks[:1])


def test_pool_touch_takes_a_reference_on_a_free_cached_block() -> None:
    pool = BlockPool(4)
    [b] = pool.allocate(1)
    pool.register(b, b"h")
    pool.release([b])
    assert pool.num_free == 4 and pool.cached[b"h"] == b
    pool.touch([b])
    assert pool.ref_cnt[b] == 1 and b not in pool.free
    pool.touch([b])
    assert pool.ref_cnt[b] == 2
    pool.release([b, b])
    assert pool.num_free == 4


@pytest.mark.smoke
def test_lru_evicts_the_least_recently_freed_cached_block_first() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(6)
    for i, b in enumerate(blocks):
        pool.register(b, f"h{i}".encode())
    # free in the order 3, 0, 5, 1: that is their eviction order
    for b in (blocks[3], blocks[0], blocks[5], blocks[1]):
        pool.release([b])
    evicted = []
    for _ in range(4):
        before = set(pool.cached)
        [got] = pool.allocate(1)
        lost = before - set(pool.cached)
        evicted.append(got)
        assert lost == {f"h{blocks.index(got)}".encode()}  # its hash left the cache
        assert pool.block_hash[got] is None
    assert evicted == [blocks[3], blocks[0], blocks[5], blocks[1]]
    # the two still-referenced cached blocks were never candidates
    assert pool.cached == {b"h2": blocks[2], b"h4": blocks[4]}
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_lru_a_reused_cached_block_moves_to_the_back_of_the_eviction_queue() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for blk, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.register(blk, h)
    pool.release([a, b, c])  # eviction order a, b, c
    pool.touch([a])  # prefix hit on a
    pool.release([a])  # freed again: now the most recent
    assert [pool.allocate(1)[0] for _ in range(3)] == [b, c, a]


def test_never_used_blocks_are_handed_out_before_cached_free_blocks() -> None:
    pool = BlockPool(5)
    [x] = pool.allocate(1)
    pool.register(x, b"x")
    pool.release([x])
    got = pool.allocate(4)
    assert x not in got and pool.cached == {b"x": x}
    assert pool.allocate(1) == [x] and pool.cached == {}


def test_register_keeps_the_first_block_for_a_hash() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.register(a, b"same")
    pool.register(b, b"same")
    assert pool.cached == {b"same": a}
    assert pool.block_hash[b] is None
    pool.release([b, a])  # b is evicted first
    pool.allocate(1)
    assert pool.cached == {b"same": a}  # evicting b leaves a's entry alone
    pool.allocate(1)
    assert pool.cached == {}


# ---- KVCacheManager: prefix caching ------------------------------------------------------------

def test_allocate_gives_ceil_blocks_and_fails_without_side_effects_when_short() -> None:
    kv = KVCacheManager(5, BS, True, "fp")
    s = _seq("a", list(range(9)))
    assert kv.allocate(s, 9)
    assert len(s.block_table) == 3 and kv.pool.num_free == 2
    s.num_computed_tokens = 9
    assert kv.allocate(s, 3)  # 12 tokens: still 3 blocks
    assert len(s.block_table) == 3
    assert kv.allocate(s, 4)  # 13: one more
    assert len(s.block_table) == 4
    t = _seq("b", list(range(100, 109)))
    assert not kv.allocate(t, 9)  # needs 3, 1 free
    assert t.block_table == [] and kv.pool.num_free == 1


def test_prefix_cache_hit_after_a_sequence_finishes() -> None:
    kv = KVCacheManager(16, BS, True, "fp")
    prompt = list(range(10, 21))  # 11 tokens: 2 full blocks + 3
    a = _seq("a", prompt)
    assert kv.find_cached_prefix(a) == []
    _compute(kv, a, 11)
    first_two = a.block_table[:2]
    kv.free(a)
    assert kv.pool.num_free == 16
    b = _seq("b", prompt + [99])
    hit = kv.find_cached_prefix(b)
    assert hit == first_two
    assert kv.allocate(b, b.num_tokens - 2 * BS, hit)
    assert b.block_table[:2] == first_two
    assert all(kv.pool.ref_cnt[x] == 1 for x in first_two)
    assert kv.pool.num_free == 16 - 3


def test_prefix_cache_hit_while_the_owner_is_still_running_shares_the_blocks() -> None:
    kv = KVCacheManager(16, BS, True, "fp")
    prompt = list(range(12))
    a = _seq("a", prompt)
    _compute(kv, a, 12)
    b = _seq("b", prompt[:8] + [50, 51])
    hit = kv.find_cached_prefix(b)
    assert hit == a.block_table[:2]
    _compute(kv, b, 2, hit)
    assert kv.pool.ref_cnt[hit[0]] == 2 and kv.pool.ref_cnt[hit[1]] == 2
    _check_refcounts(kv.pool, [a, b])
    kv.free(a)
    _check_refcounts(kv.pool, [b])
    kv.free(b)
    assert kv.pool.num_free == 16


def test_prefix_cache_miss_for_a_different_fingerprint() -> None:
    kv_a = KVCacheManager(16, BS, True, "weights=abc|dtype=float32")
    kv_b = KVCacheManager(16, BS, True, "weights=abc|dtype=bfloat16")
    kv_b.pool = kv_a.pool  # one pool, two numerics
    prompt = list(range(13))
    a = _seq("a", prompt)
    _compute(kv_a, a, 13)
    kv_a.free(a)
    assert len(kv_a.pool.cached) == 3
    assert kv_b.find_cached_prefix(_seq("b", prompt)) == []
    assert len(kv_a.find_cached_prefix(_seq("c", prompt))) == 3
    # and the hash chain itself differs from the first block on
    ha = _seq("x", prompt)
    hb = _seq("y", prompt)
    kv_a.find_cached_prefix(ha)
    kv_b.find_cached_prefix(hb)
    assert all(x != y for x, y in zip(ha.block_hashes, hb.block_hashes, strict=True))


def test_block_hash_chains_the_parent_so_a_block_hits_only_after_the_same_prefix() -> None:
    kv = KVCacheManager(16, BS, True, "fp")
    a = _seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    _compute(kv, a, 9)
    kv.free(a)
    # same second block, different first block: no hit at all
    assert kv.find_cached_prefix(_seq("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])) == []
    # same first block, different second block: one block
    assert len(kv.find_cached_prefix(_seq("c", [1, 2, 3, 4, 5, 6, 7, 0, 9]))) == 1


def test_only_full_blocks_are_cached() -> None:
    kv = KVCacheManager(16, BS, True, "fp")
    a = _seq("a", list(range(10)))  # 2 full blocks + 2 tokens
    _compute(kv, a, 10)
    assert len(kv.pool.cached) == 2
    assert set(kv.pool.cached.values()) == set(a.block_table[:2])
    assert kv.pool.block_hash[a.block_table[2]] is None
    # two generated tokens fill the third block: once computed, it is cached too
    a.output_token_ids += [77]
    _compute(kv, a, 1)
    assert len(kv.pool.cached) == 2
    a.output_token_ids += [78]
    _compute(kv, a, 1)
    assert len(kv.pool.cached) == 3
    table = list(a.block_table)
    kv.free(a)
    b = _seq("b", list(range(10)) + [77, 78, 5])
    assert kv.find_cached_prefix(b) == table[:3]


def test_only_computed_tokens_are_cached_not_scheduled_ones() -> None:
    kv = KVCacheManager(16, BS, True, "fp")
    a = _seq("a", list(range(12)))
    assert kv.allocate(a, 12)
    a.num_computed_tokens = 5  # a chunk of 5 ran
    kv.commit(a)
    assert len(kv.pool.cached) == 1


@pytest.mark.parametrize("prompt_len", [4, 5, 8, 9, 12, 13])
def test_at_least_one_token_is_always_left_to_compute(prompt_len: int) -> None:
    kv = KVCacheManager(16, BS, True, "fp")
    prompt = list(range(prompt_len))
    a = _seq("a", prompt)
    _compute(kv, a, prompt_len)
    kv.free(a)
    hit = kv.find_cached_prefix(_seq("b", prompt))
    assert len(hit) == (prompt_len - 1) // BS
    assert prompt_len - len(hit) * BS >= 1


def test_prefix_caching_off_never_hits_nor_registers() -> None:
    kv = KVCacheManager(16, BS, False, "fp")
    a = _seq("a", list(range(12)))
    _compute(kv, a, 12)
    kv.free(a)
    assert kv.pool.cached == {}
    assert kv.find_cached_prefix(_seq("b", list(range(13)))) == []


def test_score_only_sequences_do_not_take_prefix_hits() -> None:
    kv = KVCacheManager(16, BS, True, "fp")
    a = _seq("a", list(range(12)))
    _compute(kv, a, 12)
    kv.free(a)
    s = _seq("s", list(range(13)))
    s.score_only = True
    assert kv.find_cached_prefix(s) == []


def test_allocate_counts_free_cached_hits_against_the_free_blocks() -> None:
    kv = KVCacheManager(4, BS, True, "fp")
    a = _seq("a", list(range(8)))
    _compute(kv, a, 8)
    kv.free(a)  # 2 cached blocks, all 4 free
    b = _seq("b", list(range(8)) + list(range(50, 59)))  # 17 tokens: 2 cached + 3 new blocks
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 2
    assert not kv.allocate(b, 9, hit)  # 2 free blocks left after touching the hits: not enough
    assert kv.pool.num_free == 4 and b.block_table == []
    assert kv.allocate(b, 8, hit)  # 2 new blocks fit
    assert kv.pool.num_free == 0


def test_evicted_block_is_no_longer_a_hit() -> None:
    kv = KVCacheManager(3, BS, True, "fp")
    a = _seq("a", list(range(9)))
    _compute(kv, a, 9)
    kv.free(a)
    c = _seq("c", list(range(100, 112)))  # needs all 3 blocks: evicts a's cached blocks
    _compute(kv, c, 12)
    assert kv.find_cached_prefix(_seq("b", list(range(9)))) == []
    kv.free(c)
    assert kv.pool.num_free == 3


def test_free_releases_last_blocks_first_so_prefix_blocks_survive_longest() -> None:
    kv = KVCacheManager(4, BS, True, "fp")
    a = _seq("a", list(range(16)))  # 4 full blocks
    _compute(kv, a, 16)
    table = list(a.block_table)
    kv.free(a)
    c = _seq("c", list(range(100, 108)))  # takes 2 blocks: a's last two
    assert kv.allocate(c, 8)
    assert c.block_table == [table[3], table[2]]
    assert len(kv.find_cached_prefix(_seq("b", list(range(16)) + [1]))) == 2


# ---- no leaks through the scheduler ------------------------------------------------------------

def _drive(sched: Scheduler, seqs: list[Sequence], abort_at: dict[str, int] | None = None,
           max_steps: int = 500) -> None:
    abort_at = abort_at or {}
    step = 0
    while sched.has_unfinished():
        step += 1
        assert step < max_steps
        for s in seqs:
            if abort_at.get(s.request_id) == step and not s.is_finished:
                sched.finish(s, "abort")
        batch = sched.schedule()
        for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            s.num_computed_tokens += n
            sched.kv.commit(s)
        for s in batch.seqs:
            if s.num_computed_tokens == s.num_tokens:
                s.output_token_ids.append(1000 + len(s.output_token_ids))
                if len(s.output_token_ids) >= s.params.max_tokens:
                    sched.finish(s, "length")
        live = [s for s in seqs if s.status is SequenceStatus.RUNNING]
        _check_refcounts(sched.kv.pool, live)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_no_block_leaks_after_completion_aborts_and_preemption(prefix_caching: bool) -> None:
    kv = KVCacheManager(10, BS, prefix_caching, "fp")
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=16, kv=kv)
    shared = list(range(8))
    seqs = [_seq(f"r{i}", shared + list(range(100 * i, 100 * i + 3 + i)), max_tokens=6)
            for i in range(6)]
    for s in seqs:
        sched.add(s)
    # r1 aborted while running, r4 while waiting, r5 after it finished (a no-op)
    _drive(sched, seqs, abort_at={"r1": 3, "r4": 2, "r5": 400})
    assert kv.pool.num_free == kv.pool.num_blocks
    assert all(s.block_table == [] for s in seqs)
    assert seqs[1].finish_reason == "abort" and seqs[4].finish_reason == "abort"
    assert sum(s.num_preemptions for s in seqs) > 0  # the pool is small enough to preempt
    for s in seqs:
        if s.finish_reason == "length":
            assert len(s.output_token_ids) == 6


def test_abort_of_a_waiting_running_and_preempted_sequence_frees_everything() -> None:
    kv = KVCacheManager(6, BS, True, "fp")
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, kv=kv)
    a, b, c = (_seq(x, list(range(10 * i, 10 * i + 9)), max_tokens=8)
               for i, x in enumerate("abc"))
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()  # a: 3 blocks, b: 3 blocks, c waits (no blocks)
    assert batch.seqs == [a, b] and kv.pool.num_free == 0
    for _ in range(4):  # prefill, then decode until a needs a 4th block (position 12)
        for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            s.num_computed_tokens += n
            kv.commit(s)
            s.output_token_ids.append(5)
        batch = sched.schedule()
        if b.num_preemptions:
            break
    # b, the most recently admitted, was preempted: blocks freed, back at the front of the queue
    assert batch.seqs == [a] and a.num_computed_tokens == 12
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_preemptions == 1
    assert b.num_computed_tokens == 0
    assert list(sched.waiting) == [b, c]
    sched.finish(b, "abort")  # preempted, waiting
    sched.finish(c, "abort")  # never ran
    sched.finish(a, "abort")  # running
    assert not sched.has_unfinished()
    assert kv.pool.num_free == 6


def test_cache_salt_separates_prefix_hits() -> None:
    kv = KVCacheManager(64, 4, True, "fp")
    params = SamplingParams(max_tokens=1)
    first = Sequence("a", list(range(13)), params, seed=0, cache_salt="tenant-a")
    assert kv.allocate(first, 13)
    first.num_computed_tokens = 13
    kv.commit(first)
    for salt, hits in (("tenant-a", 3), ("tenant-b", 0), (None, 0)):
        seq = Sequence(f"q-{salt}", list(range(13)), params, seed=0, cache_salt=salt)
        assert len(kv.find_cached_prefix(seq)) == hits, salt
