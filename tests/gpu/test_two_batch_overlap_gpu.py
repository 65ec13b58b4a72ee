"""Two-batch overlap on two GPUs (NCCL, two CUDA streams per rank); skipped without 2 CUDA devices.

What the tests prove, on a Qwen3-8B-shaped model at TP 2: prefill steps run as two overlapped
micro-batches (a sequence cut in the middle, a cut on a sequence boundary, and a step mixing a
prompt's second chunk with a decode row) return bitwise the tokens, logprobs and prompt logprobs
of the same engine with the overlap off, twice in a row (no race between the streams: the second
micro-batch reads the first one's keys and values of a cut sequence); the ranks' collective
traces show both ranks ran the micro-batches (gathers of half the step's rows) and issued the
same collectives in the same order. Negative control: in the standard mode (NCCL all-reduce,
stock GEMMs whose algorithm follows the row count) the same split changes the bits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

from samebits import LLM, SamplingParams  # noqa: E402

QWEN3_8B = str(Path(__file__).parents[2] / "benchmarks" / "configs" / "qwen3-8b.json")
OPTIONS = dict(load_format="dummy", device="cuda", dtype="bfloat16", seed=0, max_num_seqs=8,
               max_model_len=4096, kv_cache_memory_bytes=4 << 30, enable_prefix_caching=False,
               tensor_parallel_size=2)
# first steps of 1901 and 1800 rows, cut at row 950 (inside prompt 2) and 900 (between prompts
# 2 and 3); the third: 2048 rows (prompt 1, the first 1848 tokens of prompt 2), cut at 1024,
# then 1153 (prompt 1's first decode row, prompt 2's last 1152 tokens after its context), cut
# at 576 -- both micro-batches' row counts, and the whole steps'
WORKLOADS = {"cut": [700, 900, 300, 1], "boundary": [500, 400, 600, 300],
             "chunk-beside-decode": [200, 3000]}
HALF_ROWS = {950, 951, 900, 1024, 576, 577}
WHOLE_ROWS = {1901, 1800, 2048, 1153}
PARAMS = SamplingParams(max_tokens=8, temperature=0.8, seed=7, logprobs=2, prompt_logprobs=1,
                        ignore_eos=True)


def _prompts(lengths: list[int], salt: int) -> list[list[int]]:
    return [[(131 * i + 17 * j + salt) % 150_000 + 1 for j in range(n)]
            for i, n in enumerate(lengths)]


def _outputs(llm: LLM) -> list:
    got = []
    for salt, lengths in enumerate(WORKLOADS.values()):
        for out in llm.generate(_prompts(lengths, salt), PARAMS, use_tqdm=False):
            c = out.outputs[0]
            got.append((c.token_ids, c.token_logprobs, c.logprobs, out.prompt_logprobs))
    return got


def _run(rounds: int = 1, **options) -> list[list]:
    llm = LLM(QWEN3_8B, **(OPTIONS | options))
    try:
        return [_outputs(llm) for _ in range(rounds)]
    finally:
        llm.engine.runner.shutdown()


def _gather_rows(trace: Path) -> set[int]:
    """The row counts of rank 0's [1, rows, H] all_gathers; both ranks' traces must match."""
    lines = [(trace / f"rank-{r}.jsonl").read_text().splitlines() for r in range(2)]
    assert lines[0] == lines[1]
    entries = [json.loads(line) for line in lines[0]]
    return {e["shape"][1] for e in entries if e["op"] == "all_gather" and len(e["shape"]) == 3
            and e["shape"][2] == 4096}


def test_overlap_on_equals_off_bitwise_at_tp_2(tmp_path, monkeypatch):
    monkeypatch.setenv("SAMEBITS_TP_TRACE", str(tmp_path / "on"))
    first, second = _run(rounds=2)
    on_rows = _gather_rows(tmp_path / "on")
    monkeypatch.setenv("SAMEBITS_TP_TRACE", str(tmp_path / "off"))
    (off,) = _run(enable_two_batch_overlap=False)
    off_rows = _gather_rows(tmp_path / "off")
    assert HALF_ROWS <= on_rows and not WHOLE_ROWS & on_rows, sorted(on_rows)
    assert WHOLE_ROWS <= off_rows and not HALF_ROWS & off_rows, sorted(off_rows)
    assert first == off
    assert second == off
    assert all(o[3] is not None for o in off)


def test_negative_control_standard_mode_split_changes_the_bits():
    (on,) = _run(batch_invariant=False)
    (off,) = _run(batch_invariant=False, enable_two_batch_overlap=False)
    assert [o[1] for o in on] != [o[1] for o in off]
