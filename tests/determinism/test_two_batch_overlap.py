"""Two-batch overlap keeps the bits: a forward run as two micro-batches interleaved layer by layer
(``samebits.models.two_batch_overlap``) gives the whole forward's hidden states bit for bit.

What they prove, on CPU: on one device, every kind of cut (the middle of a sequence, a sequence
boundary, one-token edges, a sequence with cached context, a decode row) gives the whole
forward's bits in the invariant mode; at TP 2 over gloo, prefills of 600 tokens split inside a
sequence and between sequences return the same tokens, logprobs, top logprobs and prompt logprobs
with the overlap on, off, and on one device, and the ranks' collective traces show that both
ranks ran the micro-batches (every layer's gathers at 300 rows, never 600; 600 with it off).
Negative controls: the standard mode's stock ops give other bits when the same forward is cut
inside a sequence, on one device and at TP 2."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch

from samebits import LLM, SamplingParams
from samebits.engine.micro_batch import split_at
from samebits.engine.step import ForwardInputs
from samebits.models.two_batch_overlap import forward_two_batch
from tests.tiny_models import TP_LLAMA_CONFIG, write_config

BLOCKS_PER_SEQ = 16  # 16 blocks of 16 tokens: TP_LLAMA_CONFIG's 256 positions
# (cached context, new tokens): a prefill, a chunk after context, a decode row, a prefill
SEQS = [(0, 200), (40, 200), (70, 1), (0, 150)]  # rows 0-199, 200-399, 400, 401-550
CUTS = {"middle": 275, "boundary": 200, "decode-row-opens-b": 400, "decode-row-closes-a": 401,
        "one-token-in-a": 1, "one-token-in-b": 550}


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> str:
    return str(write_config(tmp_path_factory.mktemp("tbo"), TP_LLAMA_CONFIG))


def _inputs(seqs: list[tuple[int, int]], block_size: int) -> ForwardInputs:
    """Sequence b in blocks [16 b, 16 b + 16), token ids a function of (b, position)."""
    ids, pos, slots, seq_lens, qsl, tables = [], [], [], [], [0], []
    for b, (ctx, n) in enumerate(seqs):
        table = list(range(BLOCKS_PER_SEQ * b, BLOCKS_PER_SEQ * (b + 1)))
        ids += [(7 * p + 31 * b) % 498 + 1 for p in range(ctx, ctx + n)]
        pos += range(ctx, ctx + n)
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(ctx, ctx + n)]
        seq_lens.append(ctx + n)
        qsl.append(qsl[-1] + n)
        tables.append(table)
    return ForwardInputs(ids, pos, slots, seq_lens, qsl, tables)


def _whole_and_cut(path: str, batch_invariant: bool, cuts: list[int]
                   ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The hidden states of ``SEQS`` (their contexts cached first) as one forward and as two
    micro-batches at each cut, on one device."""
    llm = LLM(path, load_format="dummy", num_kv_blocks=BLOCKS_PER_SEQ * len(SEQS),
              batch_invariant=batch_invariant)
    runner = llm.engine.runner
    model, caches, bs = runner.model, runner.kv_caches, runner.block_size

    def run(inputs: ForwardInputs) -> torch.Tensor:
        batch = runner._device_inputs(inputs)
        return model(batch.input_ids, batch.positions, caches, batch.meta)

    def run_cut(inputs: ForwardInputs, cut: int) -> torch.Tensor:
        _forget(caches, inputs.slots)  # the second micro-batch must read the first's K/V
        return forward_two_batch(model, tuple(map(runner._device_inputs, split_at(inputs, cut))),
                                 caches)

    with torch.inference_mode():
        run(_inputs([(0, ctx) for ctx, _ in SEQS if ctx], bs))  # their cached context
        inputs = _inputs(SEQS, bs)
        whole = run(inputs)
        halves = [run_cut(inputs, cut) for cut in cuts]
    return whole, halves


def _forget(caches: list[tuple[torch.Tensor, torch.Tensor]], slots: list[int]) -> None:
    """Zero every layer's K and V at ``slots``."""
    for cache in (c for pair in caches for c in pair):
        cache.view(-1, *cache.shape[2:])[slots] = 0


def test_micro_batches_give_the_whole_forwards_bits_on_one_device(config_path):
    whole, halves = _whole_and_cut(config_path, True, list(CUTS.values()))
    for name, two in zip(CUTS, halves, strict=True):
        assert torch.equal(two, whole), name


def test_negative_control_standard_mode_differs_when_a_sequence_is_cut(config_path):
    whole, (two,) = _whole_and_cut(config_path, False, [CUTS["middle"]])
    assert not torch.equal(two, whole)


# 600-token prefills, split at row 300: inside the second prompt, or between prompts 2 and 3
WORKLOADS = {"cut": [200, 250, 150], "boundary": [200, 100, 150, 150]}
PARAMS = SamplingParams(max_tokens=4, temperature=0.8, seed=5, logprobs=2, prompt_logprobs=2,
                        ignore_eos=True)


def _prompts(lengths: list[int], salt: int) -> list[list[int]]:
    return [[(13 * i + 7 * j + salt) % 498 + 1 for j in range(n)] for i, n in enumerate(lengths)]


def _generate(path: str, **options) -> list:
    """Every workload's outputs (each workload's first step a 600-token prefill)."""
    llm = LLM(path, load_format="dummy", num_kv_blocks=128, long_prefill_token_threshold=1024,
              **options)
    try:
        got = []
        for salt, lengths in enumerate(WORKLOADS.values()):
            for out in llm.generate(_prompts(lengths, salt), PARAMS, use_tqdm=False):
                c = out.outputs[0]
                got.append((c.token_ids, c.token_logprobs, c.logprobs, out.prompt_logprobs))
        return got
    finally:
        llm.engine.runner.shutdown()


def _gather_rows(trace: Path) -> tuple[collections.Counter, list[str]]:
    """(how many all_gathers of each row count rank 0 issued, each rank's trace lines)."""
    ranks = [(trace / f"rank-{r}.jsonl").read_text().splitlines() for r in range(2)]
    entries = [json.loads(line) for line in ranks[0]]
    return collections.Counter(e["shape"][1] for e in entries if e["op"] == "all_gather"
                               and len(e["shape"]) == 3), ranks


def test_tp_2_overlap_on_equals_off_and_one_device_bitwise(config_path, tmp_path, monkeypatch):
    one_device = _generate(config_path)
    runs = {}
    for on in (True, False):
        monkeypatch.setenv("SAMEBITS_TP_TRACE", str(tmp_path / str(on)))
        runs[on] = _generate(config_path, tensor_parallel_size=2, enable_two_batch_overlap=on)
        rows, (rank0, rank1) = _gather_rows(tmp_path / str(on))
        assert rank0 == rank1  # both ranks issued the same collectives, in the same order
        # per workload: the embedding's gather and two per layer, per micro-batch
        assert (rows[300], rows[600]) == ((2 * 2 * 5, 0) if on else (0, 2 * 5)), rows
    assert runs[True] == runs[False] == one_device
    assert len(one_device) == 7 and all(o[3] is not None for o in one_device)


def test_negative_control_standard_mode_tp_2_overlap_changes_the_bits(config_path):
    """The same prefills in the standard mode: the sequence cut in two gets other prompt
    logprobs."""
    on, off = (_generate(config_path, tensor_parallel_size=2, batch_invariant=False,
                         enable_two_batch_overlap=overlap) for overlap in (True, False))
    assert on != off
