"""The scheduler, driven by hand (no tensors): schedule(), then what the engine's postprocess does
(``num_computed_tokens += n; kv.commit``; a token for every sequence whose prefill is complete;
finish after ``max_tokens``). Checks budgets, chunking, max_num_seqs, preemption and FIFO order."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from samebits.engine.kv_cache import KVCacheManager
from samebits.engine.scheduler import ScheduledBatch, Scheduler
from samebits.engine.sequence import Sequence, SequenceStatus
from samebits.sampling_params import SamplingParams


@dataclass
class Trace:
    batches: list[list[tuple[str, int, int]]] = field(default_factory=list)  # (id, start, n)
    admitted: list[str] = field(default_factory=list)  # admission order (re-admissions too)
    preempted: list[tuple[int, str, list[str]]] = field(default_factory=list)  # (step, id, running)
    finished: list[str] = field(default_factory=list)


def _seq(rid: str, n_prompt: int, max_tokens: int, base: int = 0) -> Sequence:
    tokens = [base + i for i in range(n_prompt)]
    return Sequence(rid, tokens, SamplingParams(max_tokens=max_tokens), seed=0)


def _check_step(sched: Scheduler, batch: ScheduledBatch) -> None:
    kv = sched.kv
    assert sum(batch.num_new_tokens) <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    assert len(batch.seqs) == len(set(map(id, batch.seqs)))
    for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        assert n >= 1
        assert s.status is SequenceStatus.RUNNING
        assert s.num_computed_tokens + n <= s.num_tokens
        assert len(s.block_table) * kv.block_size >= s.num_computed_tokens + n
    # every block is referenced exactly by the tables that hold it
    for b in range(kv.pool.num_blocks):
        holders = sum(s.block_table.count(b) for s in sched.running)
        assert kv.pool.ref_cnt[b] == holders
    for s in sched.waiting:
        assert s.block_table == [] and s.num_computed_tokens == 0


def run(sched: Scheduler, seqs: list[Sequence], arrivals: dict[int, list[Sequence]] | None = None,
        max_steps: int = 2000) -> Trace:
    """Step until every sequence finished; returns what happened."""
    arrivals = arrivals or {0: seqs}
    trace = Trace()
    step = 0
    while step == 0 or sched.has_unfinished() or any(k >= step for k in arrivals):
        for s in arrivals.get(step, []):
            sched.add(s)
        before = {s.request_id: s.num_preemptions for s in seqs}
        running_before = [s.request_id for s in sched.running]
        waiting_before = {s.request_id for s in sched.waiting}
        batch = sched.schedule()
        _check_step(sched, batch)
        for s in seqs:
            if s.num_preemptions > before[s.request_id]:
                trace.preempted.append((step, s.request_id, running_before))
        for s in batch.seqs:
            if s.request_id in waiting_before:
                trace.admitted.append(s.request_id)
        trace.batches.append([(s.request_id, s.num_computed_tokens, n)
                              for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)])
        for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            s.num_computed_tokens += n
            sched.kv.commit(s)
        for s in batch.seqs:
            if s.num_computed_tokens == s.num_tokens:  # prefill complete: a token is sampled
                s.output_token_ids.append(10_000 + len(s.output_token_ids))
                if len(s.output_token_ids) >= s.params.max_tokens:
                    sched.finish(s, "length")
                    trace.finished.append(s.request_id)
        step += 1
        assert step < max_steps, "no progress"
    return trace


def _make(num_blocks: int = 256, block_size: int = 4, max_num_seqs: int = 8, budget: int = 32,
          prefix: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, prefix, "fp")
    return Scheduler(max_num_seqs, budget, kv)


def _assert_all_done(sched: Scheduler, seqs: list[Sequence]) -> None:
    for s in seqs:
        assert s.is_finished and s.finish_reason == "length"
        assert len(s.output_token_ids) == s.params.max_tokens
        assert s.block_table == []
    assert sched.kv.pool.num_free == sched.kv.pool.num_blocks
    assert not sched.running and not sched.waiting


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 8, 13, 32, 100])
def test_token_budget_respected_and_prompts_chunked_at_any_budget(budget: int) -> None:
    sched = _make(budget=budget, max_num_seqs=4)
    seqs = [_seq(f"s{i}", n, max_tokens=3, base=100 * i) for i, n in enumerate([1, 7, 23, 40, 9])]
    trace = run(sched, seqs)
    _assert_all_done(sched, seqs)
    for batch in trace.batches:
        assert sum(n for _, _, n in batch) <= budget
    # without preemption, each token of each sequence is computed exactly once, in order
    assert not trace.preempted
    for s in seqs:
        spans = [(start, n) for b in trace.batches for rid, start, n in b if rid == s.request_id]
        pos = 0
        for start, n in spans:
            assert start == pos
            pos += n
        # the prompt and every fed-back generated token: all but the last sampled one
        assert pos == s.num_tokens - 1
    if budget < 40:  # the 40-token prompt cannot fit one step
        assert any(n < 40 for b in trace.batches for rid, _, n in b if rid == "s3")


def test_budget_is_filled_running_first_then_waiting() -> None:
    sched = _make(budget=10, max_num_seqs=8)
    a = _seq("a", 4, max_tokens=5)
    sched.add(a)
    batch = sched.schedule()
    assert batch.seqs == [a] and batch.num_new_tokens == [4]
    a.num_computed_tokens += 4
    a.output_token_ids.append(1)
    b = _seq("b", 30, max_tokens=2, base=50)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 9]  # a's decode, then b's chunk


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3])
def test_max_num_seqs_respected(max_num_seqs: int) -> None:
    sched = _make(max_num_seqs=max_num_seqs, budget=64)
    seqs = [_seq(f"s{i}", 5, max_tokens=4, base=10 * i) for i in range(7)]
    trace = run(sched, seqs)
    _assert_all_done(sched, seqs)
    assert max(len(b) for b in trace.batches) == max_num_seqs


def test_waiting_queue_is_fifo() -> None:
    sched = _make(max_num_seqs=2, budget=64)
    seqs = [_seq(f"s{i}", 3 + (7 * i) % 5, max_tokens=2 + i % 3, base=10 * i) for i in range(8)]
    trace = run(sched, seqs)
    _assert_all_done(sched, seqs)
    assert trace.admitted == [s.request_id for s in seqs]


def test_late_arrivals_are_admitted_after_earlier_ones() -> None:
    sched = _make(max_num_seqs=1, budget=64)
    seqs = [_seq(f"s{i}", 4, max_tokens=3, base=10 * i) for i in range(5)]
    trace = run(sched, seqs, arrivals={0: seqs[:2], 1: seqs[2:4], 5: seqs[4:]})
    _assert_all_done(sched, seqs)
    assert trace.admitted == ["s0", "s1", "s2", "s3", "s4"]


def test_preemption_when_blocks_run_out_takes_the_most_recently_admitted() -> None:
    # 12 blocks of 4 tokens; four sequences of up to 6 + 10 = 16 tokens (4 blocks) each
    sched = _make(num_blocks=12, block_size=4, max_num_seqs=4, budget=64)
    seqs = [_seq(f"s{i}", 6, max_tokens=10, base=100 * i) for i in range(4)]
    trace = run(sched, seqs)
    _assert_all_done(sched, seqs)
    assert trace.preempted, "the pool is too small for all four: someone must be preempted"
    for _, rid, running_before in trace.preempted:
        assert rid in running_before
    # the victims of a step are the last admitted among those running at that step
    by_step: dict[int, list[str]] = {}
    for step, rid, _ in trace.preempted:
        by_step.setdefault(step, []).append(rid)
    for step, victims in by_step.items():
        running_before = next(r for s, _, r in trace.preempted if s == step)
        assert set(victims) == set(running_before[-len(victims):])
    assert sum(s.num_preemptions for s in seqs) == len(trace.preempted)


@pytest.mark.smoke
def test_preempted_sequence_frees_its_blocks_resumes_first_and_completes() -> None:
    sched = _make(num_blocks=6, block_size=4, max_num_seqs=4, budget=64, prefix=False)
    a = _seq("a", 8, max_tokens=8)
    b = _seq("b", 8, max_tokens=8, base=100)
    c = _seq("c", 3, max_tokens=2, base=200)
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    assert batch.seqs == [a, b, c]  # 2 + 2 + 1 blocks; c finishes before the pool runs out
    seen_preempt = False
    steps = 0
    while sched.has_unfinished():
        steps += 1
        assert steps < 200
        _check_step(sched, batch)
        for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            s.num_computed_tokens += n
            sched.kv.commit(s)
        for s in batch.seqs:
            if s.num_computed_tokens == s.num_tokens:
                s.output_token_ids.append(7)
                if len(s.output_token_ids) >= s.params.max_tokens:
                    sched.finish(s, "length")
        batch = sched.schedule()
        if b.num_preemptions and not seen_preempt:
            seen_preempt = True
            assert b.block_table == [] and b.num_computed_tokens == 0
            assert b.status is SequenceStatus.WAITING and sched.waiting[0] is b
            assert a.status is SequenceStatus.RUNNING and a in batch.seqs
    assert seen_preempt
    _assert_all_done(sched, [a, b, c])
    assert a.num_preemptions == 0


def test_preempted_sequence_recomputes_its_prompt_and_generated_tokens() -> None:
    sched = _make(num_blocks=8, block_size=4, max_num_seqs=4, budget=64, prefix=False)
    seqs = [_seq(f"s{i}", 5, max_tokens=12, base=100 * i) for i in range(3)]
    trace = run(sched, seqs)
    _assert_all_done(sched, seqs)
    victims = {rid for _, rid, _ in trace.preempted}
    assert victims
    for rid in victims:
        # after a preemption the sequence restarts at position 0 (no prefix cache)
        starts = [start for b in trace.batches for r, start, _ in b if r == rid]
        assert starts.count(0) == 1 + next(s for s in seqs if s.request_id == rid).num_preemptions


def test_preemption_with_prefix_caching_resumes_from_its_surviving_cached_blocks() -> None:
    # 10 blocks of 4; three 9-token prompts take 9. At position 12, s0 takes the last free block,
    # s1 preempts s2 and takes s2's last block; s2's first two (full, cached) blocks survive.
    sched = _make(num_blocks=10, block_size=4, max_num_seqs=4, budget=64, prefix=True)
    seqs = [_seq("s0", 9, max_tokens=5, base=0), _seq("s1", 9, max_tokens=5, base=100),
            _seq("s2", 9, max_tokens=10, base=200)]
    trace = run(sched, seqs)
    _assert_all_done(sched, seqs)
    assert [rid for _, rid, _ in trace.preempted] == ["s2"]
    starts = [start for b in trace.batches for rid, start, _ in b if rid == "s2"]
    assert starts[:4] == [0, 9, 10, 11]
    resumed = starts[4]
    assert resumed == 8  # recomputes from the first uncached token, not from 0
    assert seqs[2].num_cached_tokens == 8


def test_many_sequences_tiny_pool_all_complete_without_leaks() -> None:
    sched = _make(num_blocks=9, block_size=2, max_num_seqs=5, budget=7)
    seqs = [_seq(f"s{i}", 1 + (5 * i) % 9, max_tokens=1 + (3 * i) % 6, base=(i % 3) * 50)
            for i in range(12)]  # some share prompts: prefix hits
    run(sched, seqs)
    _assert_all_done(sched, seqs)
    assert sched.kv.pool.num_free == 9


def test_identical_prompts_get_prefix_hits_once_the_first_has_computed() -> None:
    sched = _make(budget=64, max_num_seqs=4, block_size=4)
    a = _seq("a", 10, max_tokens=2)
    run(sched, [a])
    b = _seq("b", 10, max_tokens=2)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [b]
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert batch.num_new_tokens == [2]


# ---- the engine's postprocess over the scheduler: score-only sequences ------------------------

def _bare_engine(sched: Scheduler):
    """An LLMEngine without a model: just what ``postprocess`` touches (plain Python)."""
    from samebits.engine.engine import LLMEngine
    engine = LLMEngine.__new__(LLMEngine)
    engine.scheduler, engine.kv = sched, sched.kv
    engine.tokenizer, engine._eos, engine.max_model_len = None, set(), 1 << 20
    return engine


def _fake_step_result(batch: ScheduledBatch):
    """What the runner returns, with 'logprob of token p+1' faked as float(p + 1) and a sampled
    token 7 (logprob -1.0) for each generating sequence whose prefill completes."""
    from samebits.engine.step import ScoredSpan, StepResult
    result = StepResult([], [], [], [], [])
    for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        start = s.num_computed_tokens
        if s.score_only:
            m = min(n, s.num_tokens - 1 - start)
            result.scored.append(ScoredSpan([float(p + 1) for p in range(start, start + m)], [], []))
        elif start + n == s.num_tokens:
            result.sampled.append(s)
            result.tokens.append(7)
            result.logprobs.append(-1.0)
            result.top_logprobs.append({})
    return result


def _run_engine(sched: Scheduler, seqs: list[Sequence]) -> None:
    engine = _bare_engine(sched)
    for s in seqs:
        sched.add(s)
    for _ in range(500):
        if not sched.has_unfinished():
            return
        batch = sched.schedule()
        _check_step(sched, batch)
        engine.postprocess(batch, _fake_step_result(batch))
    raise AssertionError("no progress")


def test_score_only_sequence_scores_every_token_once_with_chunked_prefill() -> None:
    sched = _make(num_blocks=64, block_size=4, max_num_seqs=4, budget=5)
    s = _seq("s", 13, max_tokens=1)
    s.score_only = True
    g = _seq("g", 6, max_tokens=4, base=100)
    _run_engine(sched, [g, s])
    assert s.finish_reason == "length" and s.output_token_ids == []
    assert s.prompt_logprobs == [float(i) for i in range(1, 13)]
    assert g.output_token_ids == [7] * 4
    assert sched.kv.pool.num_free == 64


def test_score_only_sequence_preempted_mid_prefill_reports_each_logprob_once() -> None:
    # 5 blocks of 4: g grows to 16 tokens (4 blocks) while s (12 tokens, 3 blocks) is prefilled in
    # chunks of the 3-token budget, so s, the most recently admitted, gets preempted mid-prefill.
    sched = _make(num_blocks=5, block_size=4, max_num_seqs=4, budget=3)
    g = _seq("g", 4, max_tokens=12, base=100)
    s = _seq("s", 12, max_tokens=1)
    s.score_only = True
    _run_engine(sched, [g, s])
    assert s.num_preemptions >= 1
    assert s.finish_reason == "length"
    assert s.prompt_logprobs == [float(i) for i in range(1, 12)]


@pytest.mark.parametrize("chunk", [1, 3, 8, 16])
def test_prefill_chunk_bounds_each_step_and_running_streams_decode_every_step(chunk: int) -> None:
    kv = KVCacheManager(256, 4, True, "fp")
    sched = Scheduler(8, 64, kv, long_prefill_token_threshold=chunk)
    stream = _seq("stream", 3, 40, base=500)
    longs = [_seq(f"long{i}", 50, 2, base=100 * i) for i in range(2)]
    trace = run(sched, [stream, *longs], arrivals={0: [stream], 2: longs})
    prompt_len = {s.request_id: len(s.prompt_token_ids) for s in [stream, *longs]}
    for step, batch in enumerate(trace.batches):
        # a prefill chunk: scheduled while more than one token was left to compute
        prefill = sum(n for rid, start, n in batch if start < prompt_len[rid] - 1)
        assert prefill <= chunk, (step, batch)
    with_stream = [i for i, b in enumerate(trace.batches) if any(r == "stream" for r, _, _ in b)]
    assert with_stream == list(range(len(with_stream)))  # every step until it finished
    overlap = sum(any(r.startswith("long") for r, _, _ in trace.batches[i]) for i in with_stream)
    assert overlap >= min(100 // (2 * chunk), 30)  # the long prompts prefilled beside it
    _assert_all_done(sched, [stream, *longs])


def test_prefill_chunk_default_is_the_step_budget() -> None:
    sched = _make(budget=32)
    assert sched.prefill_chunk == 32


def test_without_chunked_prefill_a_prompt_runs_whole_or_waits():
    """An encoder's scheduler: each prompt in one step (the prefill cap is the step budget), a
    prompt that does not fit what is left waits for the next step, in arrival order."""
    kv = KVCacheManager(64, 16, False, "fp")
    sched = Scheduler(8, 100, kv, long_prefill_token_threshold=16, chunked_prefill=False)
    seqs = [_seq("a", 60, 1), _seq("b", 50, 1), _seq("c", 30, 1)]
    for s in seqs:
        sched.add(s)
    steps = []
    while sched.waiting:
        batch = sched.schedule()
        _check_step(sched, batch)
        steps.append([(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens,
                                                         strict=True)])
        for s in batch.seqs:
            sched.finish(s, "length")
    assert steps == [[("a", 60)], [("b", 50), ("c", 30)]]


def _lookahead(num_blocks: int, lookahead_until: int, max_num_seqs: int = 8) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, False, "fp")
    return Scheduler(max_num_seqs, 64, kv, lookahead_until=lookahead_until)


def _decode_to_boundary(sched: Scheduler, *seqs: Sequence) -> None:
    """Prefill ``seqs`` (3 tokens each) in one step and sample one token each: their next
    decode computes position 3, the last of their first block, the step after position 4."""
    for seq in seqs:
        sched.add(seq)
    batch = sched.schedule()
    assert batch.seqs == list(seqs)
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        seq.num_computed_tokens += n
        seq.output_token_ids.append(7)


def test_a_decode_at_a_block_boundary_holds_its_next_positions_block_under_lookahead():
    with_ahead, without = _lookahead(16, lookahead_until=64), _lookahead(16, lookahead_until=0)
    for sched in (with_ahead, without):
        seq = _seq("a", 3, max_tokens=8)
        _decode_to_boundary(sched, seq)
        batch = sched.schedule()
        assert batch.num_new_tokens == [1] and seq.num_computed_tokens == 3
        held = len(seq.block_table)
        assert held == (2 if sched is with_ahead else 1)  # position 4's block: only looking ahead
        _check_step(sched, batch)


def test_lookahead_stops_at_its_limit_and_never_preempts():
    seq = _seq("a", 3, max_tokens=8)
    sched = _lookahead(16, lookahead_until=4)  # position 4 is at the limit: no block for it
    _decode_to_boundary(sched, seq)
    sched.schedule()
    assert len(seq.block_table) == 1
    full = _lookahead(3, lookahead_until=64, max_num_seqs=3)  # 3 blocks, 3 sequences: one each
    seqs = [_seq(f"s{i}", 3, max_tokens=8, base=10 * i) for i in range(3)]
    _decode_to_boundary(full, *seqs)
    assert full.kv.pool.num_free == 0
    full.schedule()
    assert [len(s.block_table) for s in seqs] == [1, 1, 1]
    assert full.num_preemptions == 0


def test_lookahead_keeps_every_sequence_completing_without_leaks():
    kv = KVCacheManager(9, 2, True, "fp")
    sched = Scheduler(5, 7, kv, lookahead_until=64)
    seqs = [_seq(f"s{i}", 1 + (5 * i) % 9, max_tokens=1 + (3 * i) % 6, base=(i % 3) * 50)
            for i in range(12)]
    run(sched, seqs)
    _assert_all_done(sched, seqs)
