"""Sleep mode on CUDA, for colocated RL: ``sleep(level=1)`` gives the KV cache's memory back to
the device (and the CUDA graphs'), ``sleep(level=2)`` the weights' too; ``wake_up`` restores them
(graphs captured anew) and the outputs -- token ids and logprobs, greedy and sampled, in a batch
of 16 -- are bitwise those of before sleeping; weights updated while asleep give bitwise what a
fresh engine with those weights gives (negative control: the update does change the outputs)."""

from __future__ import annotations

import gc
import random
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from samebits import LLM, SamplingParams  # noqa: E402

CONFIG = Path(__file__).parents[2] / "benchmarks" / "configs" / "qwen3-0.6b.json"
rng = random.Random(2)
PROMPTS = [[rng.randrange(2, 8192) for _ in range(10 + 23 * i)] for i in range(16)]
PARAMS = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True) if i % 2 else
          SamplingParams(max_tokens=32, temperature=0.9, top_p=0.95, seed=70 + i, ignore_eos=True)
          for i in range(16)]
KV_BYTES = 1 << 30


def _llm(seed: int) -> LLM:
    return LLM(str(CONFIG), load_format="dummy", device="cuda", dtype="bfloat16", seed=seed,
               max_num_seqs=16, max_model_len=1024, kv_cache_memory_bytes=KV_BYTES,
               enable_sleep_mode=True)


def _run(llm: LLM) -> list:
    return [(o.outputs[0].token_ids, o.outputs[0].token_logprobs)
            for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _used() -> int:
    """Device memory this process holds (allocated by torch, after a collection)."""
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _weight_bytes(llm: LLM) -> int:
    return sum(p.numel() * p.element_size() for p in llm.engine.loaded.model.parameters())


def test_gpu_sleep_frees_the_kv_cache_then_the_weights_and_waking_keeps_the_bits():
    llm = _llm(seed=0)
    before, kv = _run(llm), llm.engine.runner.num_blocks
    awake, free_awake = _used(), torch.cuda.mem_get_info()[0]
    llm.sleep(level=1)
    freed_1 = awake - _used()
    llm.wake_up()
    assert _run(llm) == before
    llm.sleep(level=2)
    freed_2, free_asleep = awake - _used(), torch.cuda.mem_get_info()[0]
    llm.wake_up()
    assert _run(llm) == before
    print({"kv_blocks": kv, "freed_level1_gib": freed_1 / 2**30,
           "freed_level2_gib": freed_2 / 2**30, "weights_gib": _weight_bytes(llm) / 2**30,
           "device_free_gain_gib": (free_asleep - free_awake) / 2**30})
    assert freed_1 >= KV_BYTES * 0.95  # the KV cache (and the graphs' pool) went back
    assert freed_2 >= freed_1 + _weight_bytes(llm) * 0.95
    assert free_asleep - free_awake >= freed_2 * 0.9  # and the device sees it free


def test_gpu_weights_updated_while_asleep_equal_a_fresh_engine():
    llm, fresh = _llm(seed=0), _llm(seed=1)
    before, want = _run(llm), _run(fresh)
    assert want != before  # negative control: the new weights change the outputs
    new = {n: w.detach().clone() for n, w in fresh.named_weights()}
    del fresh
    llm.sleep(level=2)
    llm.update_weights({n: w.cpu() for n, w in new.items()})  # host copies while offloaded
    llm.wake_up()
    assert _run(llm) == want
    llm.sleep(level=1)
    llm.wake_up(tags=["weights"])
    llm.wake_up(tags=["kv_cache"])
    assert _run(llm) == want
