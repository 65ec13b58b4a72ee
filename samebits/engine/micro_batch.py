"""One eager forward's inputs as two micro-batches cut at a token row (two-batch overlap: the
model runs them interleaved, so that one's tensor-parallel gathers run while the other computes:
``samebits.models.two_batch_overlap``).

The first micro-batch takes the step's query tokens [0, cut), the second [cut, T). A sequence
whose tokens straddle the cut is prefilled in two chunks: its first part in the first micro-batch
(seq_len: its context plus those tokens), its second in the second (its full seq_len; the first
part's keys and values are then context it reads from the KV cache). Sequences wholly on one side
appear only there; block tables are unchanged. Every op being row-invariant and attention per
sequence, and a chunked prefill the bits of a whole one, the two micro-batches' hidden states,
concatenated, are the whole forward's bit for bit (in the invariant mode; the standard mode
promises nothing across batch shapes).
"""

from __future__ import annotations

from bisect import bisect_right

from samebits.engine.step import ForwardInputs

# Fewest query tokens a forward needs before it is split. The split launches every op twice, at
# half the rows: a small forward is bound by the host's launches (decode-sized steps are), and
# its gathers are short, so there is little to hide and the extra launches cost more. From a few
# hundred rows on, each gather and each half-layer's GEMMs take tens to hundreds of microseconds
# on the device, and one hides the other (benchmarks/tp_profile.py --workloads prefill).
TWO_BATCH_OVERLAP_MIN_TOKENS = 512


def two_batch_split(inputs: ForwardInputs) -> tuple[ForwardInputs, ForwardInputs] | None:
    """``inputs`` cut at its middle token row, or None below ``TWO_BATCH_OVERLAP_MIN_TOKENS``
    query tokens."""
    tokens = len(inputs.input_ids)
    if tokens < TWO_BATCH_OVERLAP_MIN_TOKENS:
        return None
    return split_at(inputs, tokens // 2)


def split_at(inputs: ForwardInputs, cut: int) -> tuple[ForwardInputs, ForwardInputs]:
    """(query tokens [0, cut), query tokens [cut, T)) of ``inputs`` as two forwards; 0 < cut < T."""
    qsl = inputs.query_start_loc
    if not 0 < cut < qsl[-1]:
        raise ValueError(f"split_at: cut {cut} is not inside the {qsl[-1]} query tokens")
    s = bisect_right(qsl, cut) - 1  # the sequence holding token row ``cut``
    seq_lens, qsl_a = inputs.seq_lens[:s], qsl[:s + 1]
    if qsl[s] < cut:  # sequence s straddles the cut: its first chunk ends at row cut
        seq_lens = [*seq_lens, inputs.seq_lens[s] - (qsl[s + 1] - cut)]
        qsl_a = [*qsl_a, cut]
    first = ForwardInputs(inputs.input_ids[:cut], inputs.positions[:cut], inputs.slots[:cut],
                          seq_lens, qsl_a, inputs.block_tables[:len(seq_lens)])
    second = ForwardInputs(inputs.input_ids[cut:], inputs.positions[cut:], inputs.slots[cut:],
                           inputs.seq_lens[s:], [0] + [q - cut for q in qsl[s + 1:]],
                           inputs.block_tables[s:])
    return first, second
