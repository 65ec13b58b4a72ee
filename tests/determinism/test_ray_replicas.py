"""Ray Data replicas keep the bits: ``map_batches(LLMPredictor, concurrency=N, batch_size=B)`` on a
local Ray with 2 CPUs returns, row for row, exactly what one local ``LLM.generate`` returns, for
different N and B. The seed column (sampled rows) and the prompt-derived seed are honoured.
Negative control: in standard mode, rows generated one per batch differ from one local batch."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from samebits import LLM, SamplingParams
from samebits.ray import LLMPredictor, prompt_seed

ray = pytest.importorskip("ray")

PROMPTS = ["The sea is", "Three colours:", "Once upon a time there was a small fox who",
           "1, 2, 3,", "Paris is the capital of", "Rain"]
SAMPLING = {"max_tokens": 4, "temperature": 0.9, "top_p": 0.95}
ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT + os.pathsep +
                                       os.environ.get("PYTHONPATH", "")}})
    yield
    ray.shutdown()


def _ray_rows(concurrency: int, batch_size: int, seeded_rows: bool, **llm_options) -> list[dict]:
    items = [{"prompt": p, **({"seed": 100 + i} if seeded_rows else {})}
             for i, p in enumerate(PROMPTS)]
    ds = ray.data.from_items(items).map_batches(
        LLMPredictor, concurrency=concurrency, batch_size=batch_size, num_cpus=1,
        fn_constructor_kwargs={"sampling_params": SAMPLING, "max_num_seqs": 4, **llm_options})
    return sorted(ds.take_all(), key=lambda r: PROMPTS.index(r["prompt"]))


def _local(seeds: list[int], **llm_options):
    llm = LLM(max_num_seqs=16, **llm_options)
    outs = llm.generate(PROMPTS, [SamplingParams(**SAMPLING, seed=s) for s in seeds])
    return [o.outputs[0] for o in outs]


def _assert_rows_equal(rows: list[dict], outs) -> None:
    assert len(rows) == len(outs)
    for row, out in zip(rows, outs, strict=True):
        assert row["generated_text"] == out.text
        assert np.array_equal(np.asarray(row["token_ids"]), np.array(out.token_ids))
        lp = np.asarray(row["logprobs"], dtype=np.float32)
        assert lp.tobytes() == np.array(out.token_logprobs, dtype=np.float32).tobytes()
        assert int(row["seed"]) == out.seed


def test_two_replicas_batch_2_equal_one_local_llm_with_prompt_seeds(local_ray):
    rows = _ray_rows(concurrency=2, batch_size=2, seeded_rows=False)
    _assert_rows_equal(rows, _local([prompt_seed(p) for p in PROMPTS]))


@pytest.mark.slow
def test_one_replica_batch_4_with_seed_column_equals_one_local_llm(local_ray):
    rows = _ray_rows(concurrency=1, batch_size=4, seeded_rows=True)
    _assert_rows_equal(rows, _local([100 + i for i in range(len(PROMPTS))]))


def test_negative_control_standard_rows_alone_differ_from_one_local_batch(local_ray):
    rows = _ray_rows(concurrency=1, batch_size=1, seeded_rows=True, batch_invariant=False)
    outs = _local([100 + i for i in range(len(PROMPTS))], batch_invariant=False)
    with pytest.raises(AssertionError):
        _assert_rows_equal(rows, outs)
