"""Piecewise CUDA graphs for prefill and mixed steps (``engine.piecewise_graph``) on CUDA: the
tokens, logprobs and prompt logprobs of an engine whose prefill, chunked-prefill and mixed
steps replay the chains equal the eager engine's (``enforce_eager``) bit for bit -- a dense
Qwen3, a Qwen3-MoE and (2 GPUs) tensor parallel 2 -- and the chains did run. Control: padding
rows written to a real block instead of the scratch block change the outputs (the comparison
sees a wrong padding). The other GPU engine tests (test_engine_gpu.py) compare batched runs,
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


def _run(config: str, eager: bool, tp: int = 1, pad_slot: int | None = None) -> tuple[list, int]:
    """Outputs and the forwards the piecewise chains ran (``pad_slot``: padding rows' K/V slot,
    the control)."""
    llm = LLM(config, load_format="dummy", device="cuda", dtype="bfloat16", seed=0,
              max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024,
              kv_cache_memory_bytes=1 << 30, tensor_parallel_size=tp, enforce_eager=eager)
    runner = llm.engine.runner
    try:
        if pad_slot is not None:
            runner.piecewise.pad = np.array([0, 0, pad_slot], dtype=np.int64)[:, None]
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
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
