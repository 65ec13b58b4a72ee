"""The server's engine core on CUDA: in a process of its own (CUDA initialized there alone, decode
steps replaying CUDA graphs, async scheduling) it hands back bit for bit what the core on a
thread of the server process hands back, and what ``LLM.generate`` returns for the same requests
in the same batches; then it stops and exits cleanly."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from samebits import LLM  # noqa: E402
from samebits.config import EngineConfig  # noqa: E402
from samebits.engine.engine import LLMEngine  # noqa: E402
from samebits.server.engine_process import EngineProcess  # noqa: E402
from tests.server.test_engine_process import GREEDY, SAMPLED, _serve  # noqa: E402

CONFIG = str(Path(__file__).parents[2] / "benchmarks" / "configs" / "qwen3-tiny.json")


def test_engine_process_on_cuda_gives_the_thread_cores_and_offline_bits():
    config = EngineConfig(CONFIG, load_format="dummy", device="cuda", dtype="bfloat16",
                          kv_cache_memory_bytes=1 << 28)
    in_thread = asyncio.run(_serve(LLMEngine(config)))
    torch.cuda.empty_cache()
    process = EngineProcess(config)
    in_process = asyncio.run(_serve(process))
    assert in_process == in_thread  # seeds, every delta, every output, bit for bit
    assert process._process.exitcode == 0
    seeds, (streamed, whole) = in_process
    offline = LLM(**vars(config)).generate(  # the same requests in the same batches
        [[5, 6, 7, 8], [9] * 12],
        [SAMPLED, replace(GREEDY, n=2, seed=seeds[1][0])],
        use_tqdm=False)
    for served, expected in ((streamed[-1].output, offline[0].outputs[0]),
                             *zip((d.output for d in sorted(whole, key=lambda d: d.index)),
                                  offline[1].outputs, strict=True)):
        assert (served.token_ids, served.token_logprobs, served.seed) == \
            (expected.token_ids, expected.token_logprobs, expected.seed)
