"""``gpu_memory_utilization`` (vLLM's name and meaning): checked at construction, taken from the
command line, and on CPU the budget of the KV cache: ``CPU_KV_CACHE_BYTES`` per rank, at most that
share of the host memory available; ``kv_cache_memory_bytes`` overrides it. An engine's block
count follows the budget."""

from __future__ import annotations

import argparse

import pytest
import torch

from samebits.config import CPU_KV_CACHE_BYTES, EngineConfig
from samebits.engine import memory
from tests.tiny_models import MICRO_LLAMA_CONFIG, write_config


@pytest.mark.parametrize("bad", [0, -0.1, 1.01, "0.5", None])
def test_gpu_memory_utilization_outside_0_1_is_rejected(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization=bad)


def test_gpu_memory_utilization_default_and_command_line():
    assert EngineConfig().gpu_memory_utilization == 0.9
    assert EngineConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    args = p.parse_args(["--gpu-memory-utilization", "0.5"])
    assert EngineConfig.from_cli_args(args).gpu_memory_utilization == 0.5


def _budget(monkeypatch, available: int, **options) -> int:
    monkeypatch.setattr(memory, "available_host_memory", lambda: available)
    model = torch.nn.Linear(2, 2)  # on the CPU: the budget does not run it
    return memory.KVBudget(model, EngineConfig(**options), 64).bytes()


def test_cpu_kv_budget_is_capped_by_the_share_of_available_memory(monkeypatch):
    assert _budget(monkeypatch, 64 << 30) == CPU_KV_CACHE_BYTES
    assert _budget(monkeypatch, 1 << 30, gpu_memory_utilization=0.25) == 1 << 28
    assert _budget(monkeypatch, 1 << 20, kv_cache_memory_bytes=1 << 26) == 1 << 26


def test_engine_blocks_follow_the_budget(monkeypatch, tmp_path):
    from samebits import LLM
    path = write_config(tmp_path, MICRO_LLAMA_CONFIG)
    monkeypatch.setattr(memory, "available_host_memory", lambda: 1 << 20)
    llm = LLM(str(path), load_format="dummy", gpu_memory_utilization=0.5)
    per_block = 2 * 1 * 16 * 2 * 8 * 4  # K and V, 1 layer, 16 slots, 2 KV heads of 8, fp32
    assert llm.engine.runner.num_blocks == (1 << 19) // per_block - 1
