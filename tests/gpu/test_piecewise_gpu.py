"""Piecewise CUDA graphs for prefill and mixed steps (``engine.piecewise_graph``) on CUDA: the
tokens, logprobs and prompt logprobs of an engine whose prefill, chunked-prefill and mixed
steps replay the chains equal the eager engine's (``enforce_eager``) bit for bit -- a dense
Qwen3, a Qwen3-MoE and (2 GPUs) tensor parallel 2, with steps of up to 256 tokens and at the default
2048 (T just above every bucket boundary; dense and MoE), and with steps above
``max_piecewise_tokens`` running eagerly between replays -- and the chains did run. Control:
padding rows written to a real block instead of the scratch block change the outputs (the
comparison sees a wrong padding). The memory the chains hold fits what the KV budget sets
aside for them. The other GPU engine tests (test_engine_gpu.py) compare batched runs,
which now replay these chains, with the eager engine too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from samebits import LLM, SamplingParams  # noqa: E402

CONFIGS = Path(__file__).parents[2] / "benchmarks" / "configs"
DENSE, MOE = str(CONFIGS / "qwen3-tiny.json"), str(CONFIGS / "qwen3-30b-a3b-4layers.json")
PROMPTS = [[(13 * i + j) % 8000 + 2 for j in range(7 + 61 * i)] for i in range(12)]
PARAMS = [SamplingParams(max_tokens=12, temperature=0.8 * (i % 2), seed=i, logprobs=2,
                         prompt_logprobs=1 if i % 5 == 0 else None, ignore_eos=True)
          for i in range(12)]


def _run(config: str, eager: bool, tp: int = 1, pad_slot: int | None = None,
         prompts: list = PROMPTS, **options) -> tuple[list, int]:
    """Outputs and the forwards the piecewise chains ran (``pad_slot``: padding rows' K/V slot,
    the control)."""
    options = dict(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024) | options
    llm = LLM(config, load_format="dummy", device="cuda", dtype="bfloat16", seed=0,
              kv_cache_memory_bytes=1 << 30, tensor_parallel_size=tp, enforce_eager=eager,
              **options)
    runner = llm.engine.runner
    try:
        if pad_slot is not None:
            runner.piecewise.pad = np.array([0, 0, pad_slot], dtype=np.int64)[:, None]
        outs = llm.generate(prompts, PARAMS[:len(prompts)], use_tqdm=False)
        steps = 0 if runner.piecewise is None else runner.piecewise.steps
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs)
                for o in outs], steps
    finally:
        runner.shutdown()


@pytest.fixture(scope="module")
def dense_eager():
    return _run(DENSE, eager=True)[0]


def test_dense_piecewise_chains_have_the_eager_bits(dense_eager):
    got, steps = _run(DENSE, eager=False)
    assert steps >= 8
    assert got == dense_eager


def test_negative_control_padding_written_to_a_real_block_differs(dense_eager):
    got, _ = _run(DENSE, eager=False, pad_slot=0)
    assert got != dense_eager


def test_moe_piecewise_chains_have_the_eager_bits():
    want, _ = _run(MOE, eager=True)
    got, steps = _run(MOE, eager=False)
    assert steps >= 8
    assert got == want


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tensor_parallel_piecewise_chains_have_the_eager_bits():
    want, _ = _run(DENSE, eager=True, tp=2)
    got, steps = _run(DENSE, eager=False, tp=2)
    assert steps >= 8
    assert got == want


# steps of T just above each bucket boundary up to the default 2048 (and decodes joining them)
LONG = [[(17 * i + j) % 8000 + 2 for j in range(n)]
        for i, n in enumerate((17, 257, 513, 1025, 1537, 2000))]
DEFAULT_STEP = dict(max_num_batched_tokens=2048, max_model_len=4096)


@pytest.mark.parametrize("config", [DENSE, MOE], ids=["dense", "moe"])
def test_default_step_buckets_up_to_2048_have_the_eager_bits(config):
    want, _ = _run(config, eager=True, prompts=LONG, **DEFAULT_STEP)
    got, steps = _run(config, eager=False, prompts=LONG, **DEFAULT_STEP)
    assert steps >= 4
    assert got == want


def test_steps_alternating_piecewise_and_eager_have_the_eager_bits():
    """``max_piecewise_tokens`` below the step budget: steps above it run eagerly, the rest
    replay the chains, in one run."""
    want, _ = _run(DENSE, eager=True, prompts=LONG, **DEFAULT_STEP)
    got, steps = _run(DENSE, eager=False, prompts=LONG, max_piecewise_tokens=512, **DEFAULT_STEP)
    assert steps >= 4
    assert got == want


def test_the_piecewise_pool_fits_what_the_kv_budget_sets_aside():
    """The memory a set of chains holds (its pool, outputs and buffers; eager warm-up memory
    released) is at most what ``KVBudget`` keeps out of the KV cache for them: the reserve with
    them less the reserve without."""
    import dataclasses

    from samebits.engine.memory import KVBudget
    llm = LLM(DENSE, load_format="dummy", device="cuda", dtype="bfloat16", seed=0,
              kv_cache_memory_bytes=1 << 30, max_num_seqs=8, **DEFAULT_STEP)
    runner = llm.engine.runner
    try:
        config, model, max_len = runner.config, runner.model, runner.max_model_len
        with torch.inference_mode():
            reserve = KVBudget(model, config, max_len)._activation_reserve() - KVBudget(
                model, dataclasses.replace(config, max_piecewise_tokens=0),
                max_len)._activation_reserve()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved()
            extra = runner._new_piecewise()
            torch.cuda.empty_cache()
            held = torch.cuda.memory_reserved() - before
        assert len(extra.chains) == 9 and 0 < held <= reserve, (held, reserve)
        extra.release()
    finally:
        runner.shutdown()
