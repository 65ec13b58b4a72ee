"""The CUDA-graph decode path's host-side logic (buckets and padding); capture and replay are
checked against the eager engine bit for bit in tests/gpu/test_engine_gpu.py."""

from __future__ import annotations

from samebits.engine.cuda_graph import DecodeBatch, HostInputs, batch_bucket, len_bucket


def test_batch_buckets_cover_every_size_with_few_graphs() -> None:
    sizes = [batch_bucket(n) for n in range(1, 257)]
    assert all(s >= n for n, s in zip(range(1, 257), sizes, strict=True))
    assert sorted(set(sizes))[:6] == [1, 2, 4, 8, 16, 24]
    assert len(set(sizes)) == 4 + 31  # 1, 2, 4, 8, then multiples of 8 up to 256


def test_len_bucket_is_a_power_of_two_number_of_splits() -> None:
    assert [len_bucket(n, 256) for n in (1, 256, 257, 1025, 1280, 2049)] == \
        [256, 256, 512, 2048, 2048, 4096]


def test_padding_rows_write_only_the_scratch_block() -> None:
    batch = DecodeBatch(input_ids=[11, 12], positions=[20, 3], slots=[5 * 16 + 4, 7 * 16 + 3],
                        block_tables=[[9, 5], [7]])
    rows = HostInputs(size=4, width=3, scratch_block=99, block_size=16).fill(batch).tolist()
    (ids, pos, slots, lens), tables = [rows[i:i + 4] for i in range(0, 16, 4)], rows[16:]
    assert ids == [11, 12, 0, 0] and pos == [20, 3, 0, 0] and lens == [21, 4, 1, 1]
    assert slots == [84, 115, 99 * 16, 99 * 16]
    assert tables == [9, 5, 99, 7, 99, 99, 99, 99, 99, 99, 99, 99]


def test_host_inputs_follow_grown_replaced_and_dropped_tables() -> None:
    """Rows are rewritten only when their list changed: each step's array must equal a fresh
    fill's, across a table growing in place, a new list (blocks freed and reallocated) of the
    same length, sequences moving rows, and the batch shrinking."""
    host = HostInputs(size=4, width=4, scratch_block=99, block_size=16)
    a, b, c = [1], [2, 3], [4]

    def step(tables: list[list[int]]) -> None:
        n = len(tables)
        batch = DecodeBatch(list(range(n)), [7] * n, [1] * n, tables)
        fresh = HostInputs(size=4, width=4, scratch_block=99, block_size=16).fill(batch)
        assert host.fill(batch).tolist() == fresh.tolist()

    step([a, b, c])
    a.append(5)
    step([a, b, c])
    b = [8, 9]  # freed and reallocated: a new list, same length
    step([a, b, c])
    step([c, a])
    step([c, a, b, [6, 6, 6, 6]])
    step([b])


def test_a_table_longer_than_the_graphs_width_fills_only_the_width() -> None:
    """A sequence at the last position of a length bucket may hold one block more (the
    scheduler's lookahead block, for the step launched after this one): its row takes the first
    ``width`` entries, on a fresh fill and as the same list grows into and past the width."""
    host = HostInputs(size=2, width=3, scratch_block=99, block_size=16)
    table = [4, 5]

    def fill(tables: list[list[int]]) -> list[int]:
        batch = DecodeBatch([1] * len(tables), [40] * len(tables), [1] * len(tables), tables)
        fresh = HostInputs(size=2, width=3, scratch_block=99, block_size=16).fill(batch)
        got = host.fill(batch).tolist()
        assert got == fresh.tolist()
        return got[8:]

    assert fill([table]) == [4, 5, 99, 99, 99, 99]
    table.extend([6, 7])
    assert fill([table]) == [4, 5, 6, 99, 99, 99]
    assert fill([[1, 2, 3, 8], table]) == [1, 2, 3, 4, 5, 6]
