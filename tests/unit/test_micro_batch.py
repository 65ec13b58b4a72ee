"""Two-batch overlap's split of a forward into two micro-batches at a token row.

What they prove: a sequence cut in the middle becomes a chunked prefill (its first chunk in the
first micro-batch with seq_len = context + those tokens, the rest in the second with its full
seq_len); a cut on a sequence boundary leaves every sequence whole; one-token edges (one token of
a sequence on either side, a one-token decode row at the cut) are right; for every cut of a mixed
batch each micro-batch is a well-formed forward (each sequence's positions are the last
query-length positions before its seq_len, its slots and ids those of the whole batch's rows) and
the two together are the whole batch's tokens; forwards below the threshold are not split."""

from __future__ import annotations

import pytest

from samebits.engine.micro_batch import TWO_BATCH_OVERLAP_MIN_TOKENS, split_at, two_batch_split
from samebits.engine.step import ForwardInputs

BS = 4  # tokens per KV block


def forward_inputs(seqs: list[tuple[int, int]]) -> ForwardInputs:
    """A forward of sequences (context tokens already cached, new tokens), block b * 10 + j the
    j-th block of sequence b; token ids 1000 b + position."""
    ids, pos, slots, seq_lens, qsl, tables = [], [], [], [], [0], []
    for b, (ctx, n) in enumerate(seqs):
        blocks = [b * 10 + j for j in range(-(-(ctx + n) // BS))]
        ids += [1000 * b + p for p in range(ctx, ctx + n)]
        pos += range(ctx, ctx + n)
        slots += [blocks[p // BS] * BS + p % BS for p in range(ctx, ctx + n)]
        seq_lens.append(ctx + n)
        qsl.append(qsl[-1] + n)
        tables.append(blocks)
    return ForwardInputs(ids, pos, slots, seq_lens, qsl, tables)


def test_a_sequence_cut_in_the_middle_is_chunk_prefilled():
    whole = forward_inputs([(0, 3), (2, 6), (0, 4)])  # rows 0-2, 3-8, 9-12
    a, b = split_at(whole, 5)  # sequence 1: rows 3, 4 in A (positions 2, 3), 5-8 in B
    assert a.seq_lens == [3, 4] and a.query_start_loc == [0, 3, 5]
    assert b.seq_lens == [8, 4] and b.query_start_loc == [0, 4, 8]
    assert a.positions == [0, 1, 2, 2, 3] and b.positions == [4, 5, 6, 7, 0, 1, 2, 3]
    assert a.slots == whole.slots[:5] and b.slots == whole.slots[5:]
    assert a.input_ids == whole.input_ids[:5] and b.input_ids == whole.input_ids[5:]
    assert a.block_tables == whole.block_tables[:2] and b.block_tables == whole.block_tables[1:]


def test_a_cut_on_a_sequence_boundary_keeps_every_sequence_whole():
    whole = forward_inputs([(0, 3), (2, 6), (0, 4)])
    a, b = split_at(whole, 9)
    assert a.seq_lens == [3, 8] and a.query_start_loc == [0, 3, 9]
    assert b.seq_lens == [4] and b.query_start_loc == [0, 4]
    assert a.block_tables == whole.block_tables[:2] and b.block_tables == whole.block_tables[2:]


@pytest.mark.parametrize(("cut", "a_lens", "b_lens"), [
    (1, [1], [5, 7, 3]),  # one token of sequence 0 in A
    (4, [4], [5, 7, 3]),  # one token of sequence 0 in B
    (5, [5], [7, 3]),  # the one-token decode row opens B
    (6, [5, 7], [3]),  # ... or closes A
    (7, [5, 7, 2], [3]),  # one token of the last sequence in B
])
def test_one_token_edges(cut, a_lens, b_lens):
    whole = forward_inputs([(0, 5), (6, 1), (1, 2)])  # a prefill, a decode row, a chunk
    a, b = split_at(whole, cut)
    assert a.seq_lens == a_lens and b.seq_lens == b_lens
    _check_well_formed(whole, a, b, cut)


def test_every_cut_gives_two_well_formed_forwards():
    whole = forward_inputs([(0, 7), (9, 1), (3, 5), (0, 1), (12, 6)])
    for cut in range(1, len(whole.input_ids)):
        _check_well_formed(whole, *split_at(whole, cut), cut)


def _check_well_formed(whole: ForwardInputs, a: ForwardInputs, b: ForwardInputs, cut: int
                       ) -> None:
    for part, rows in ((a, range(cut)), (b, range(cut, len(whole.input_ids)))):
        qsl = part.query_start_loc
        assert qsl[0] == 0 and qsl[-1] == len(rows) == len(part.positions) == len(part.slots)
        assert len(part.seq_lens) == len(part.block_tables) == len(qsl) - 1
        for s, seq_len in enumerate(part.seq_lens):
            n = qsl[s + 1] - qsl[s]
            assert n > 0 and part.positions[qsl[s]:qsl[s + 1]] == list(range(seq_len - n, seq_len))
        assert part.slots == [whole.slots[r] for r in rows]
        assert part.input_ids == [whole.input_ids[r] for r in rows]


def test_only_forwards_from_the_threshold_are_split_in_the_middle():
    small = forward_inputs([(0, TWO_BATCH_OVERLAP_MIN_TOKENS - 1)])
    assert two_batch_split(small) is None
    large = forward_inputs([(0, 100), (0, TWO_BATCH_OVERLAP_MIN_TOKENS)])
    a, b = two_batch_split(large)
    assert len(a.input_ids) == len(b.input_ids) == (100 + TWO_BATCH_OVERLAP_MIN_TOKENS) // 2


@pytest.mark.parametrize("cut", [0, 13, -1])
def test_a_cut_outside_the_tokens_is_refused(cut):
    with pytest.raises(ValueError, match="not inside the 13 query tokens"):
        split_at(forward_inputs([(0, 3), (2, 6), (0, 4)]), cut)
