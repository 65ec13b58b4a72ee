"""Sleep mode on CPU (the bits; tests/gpu/test_sleep_gpu.py measures the memory): after
``sleep`` / ``wake_up`` the outputs are bitwise those of before; weights updated while asleep give
bitwise what a fresh engine with those weights gives; nothing runs while asleep."""

from __future__ import annotations

import json

import pytest

from samebits import LLM, SamplingParams
from tests.conftest import TINY_LLAMA

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [7]]
PARAMS = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=5, temperature=1.0, seed=4, logprobs=2, ignore_eos=True),
          SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9, seed=9, ignore_eos=True)]


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("sleep") / "config.json"
    path.write_text(json.dumps({**TINY_LLAMA, "architectures": ["LlamaForCausalLM"]}))
    return str(path)


def _llm(config_file: str, seed: int) -> LLM:
    return LLM(config_file, load_format="dummy", seed=seed, num_kv_blocks=16,
               enable_sleep_mode=True)


def _bits(llm: LLM) -> list:
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].token_logprobs, o.outputs[0].logprobs)
            for o in outs]


@pytest.mark.parametrize("level", [1, 2])
def test_outputs_after_waking_are_bitwise_those_before_sleeping(config_file, level):
    llm = _llm(config_file, seed=0)
    before = _bits(llm)
    llm.sleep(level=level)
    assert llm.is_sleeping() and llm.engine.runner.kv_caches == []  # the KV cache is freed
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping() and _bits(llm) == before


def test_weights_updated_while_asleep_equal_a_fresh_engine_with_those_weights(config_file):
    llm, other = _llm(config_file, seed=0), _llm(config_file, seed=1)
    before, want = _bits(llm), _bits(other)
    assert want != before  # the control: the new weights do change the outputs
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])  # vLLM's RL order: weights, update, then the KV cache
    with pytest.raises(ValueError, match="weights"):
        llm.engine.wake_up(tags=["bogus"])
    llm.update_weights(other.named_weights())
    llm.wake_up(tags=["kv_cache"])
    assert _bits(llm) == want
    llm.sleep(level=2)
    llm.update_weights(dict(_llm(config_file, seed=0).named_weights()))  # written while offloaded
    llm.wake_up()
    assert _bits(llm) == before


@pytest.mark.smoke
def test_sleep_needs_sleep_mode_and_a_valid_level(config_file):
    plain = LLM(config_file, load_format="dummy", num_kv_blocks=16)
    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        plain.sleep()
    with pytest.raises(ValueError, match="level"):
        _llm(config_file, seed=0).sleep(level=3)
