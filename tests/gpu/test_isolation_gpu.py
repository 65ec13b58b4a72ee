"""Failure isolation on CUDA (bf16, Triton kernels, decode steps in CUDA graphs, async scheduling:
the step after a failing request is launched before its failure is known): each poison of
tests/unit/test_isolation.py -- a raising logits processor, a grammar mask that raises or allows
nothing, a grammar refusing the token, a raising detokenizer, NaN and infinite logits through the
model -- fails its request alone, and six neighbours keep the bits they get alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from samebits.config import EngineConfig  # noqa: E402
from samebits.engine.engine import LLMEngine  # noqa: E402
from samebits.engine.logits_processor import LogitBias  # noqa: E402
from tests.unit.test_isolation import (  # noqa: E402
    INF_TOKEN,
    NAN_TOKEN,
    PLAIN,
    POISONS,
    _raising_bias,
    _run,
)

CONFIG = str(Path(__file__).parents[2] / "benchmarks" / "configs" / "qwen3-tiny.json")


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    eng = LLMEngine(EngineConfig(CONFIG, load_format="dummy", device="cuda", dtype="bfloat16",
                                 kv_cache_memory_bytes=1 << 29, seed=0))
    with torch.no_grad():
        eng.loaded.model.embed_tokens.weight[NAN_TOKEN] = float("nan")
        eng.loaded.model.embed_tokens.weight[INF_TOKEN] = float("inf")
    return eng


@pytest.fixture(scope="module")
def solo(engine) -> list:
    return [(s.output_token_ids, s.logprobs)
            for s in (_run(engine, [request])["plain-0"] for request in PLAIN)]


@pytest.mark.parametrize("kind", list(POISONS))
def test_a_failing_request_fails_alone_on_cuda_and_neighbours_keep_their_solo_bits(
        engine, solo, kind, monkeypatch):
    poison, message, invalid_request = POISONS[kind]
    monkeypatch.setattr(LogitBias, "apply", _raising_bias(LogitBias.apply))
    done = _run(engine, PLAIN, poison)
    bad = done["poison"]
    assert bad.finish_reason == "error" and message in bad.error.message, bad.error
    assert bad.error.invalid_request is invalid_request
    for i, (tokens, logprobs) in enumerate(solo):
        seq = done[f"plain-{i}"]
        assert seq.finish_reason == "length" and seq.output_token_ids == tokens
        assert torch.equal(torch.tensor(seq.logprobs), torch.tensor(logprobs))
