"""``POST /v1/update_weights`` in process (a small random Llama): the answer is the new
fingerprint and later responses carry it; bad paths and bad tensors are 400s naming the problem
and change nothing; behind the API key; 404 without ``--enable-weight-updates``."""

from __future__ import annotations

import re

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from samebits.config import EngineConfig  # noqa: E402
from samebits.engine.engine import LLMEngine  # noqa: E402
from samebits.server.app import build_app  # noqa: E402

KEY = "k-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir):
    return tiny_llama_dir


def _client(model_dir, enable: bool) -> TestClient:
    engine = LLMEngine(EngineConfig(model=str(model_dir)))
    return TestClient(build_app(engine, "tiny", KEY, enable_weight_updates=enable))


def _complete(client: TestClient) -> dict:
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0,
            "logprobs": 0}
    r = client.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def _save(directory, tensors: dict) -> str:
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))
    return str(directory)


def test_update_weights_swaps_and_answers_the_new_fingerprint(model_dir, tmp_path):
    with _client(model_dir, enable=True) as client:
        before = _complete(client)
        norm = torch.full((64,), 1.7)
        r = client.post("/v1/update_weights", json={"path": _save(tmp_path / "w", {
            "model.norm.weight": norm})}, headers=AUTH)
        assert r.status_code == 200, r.text
        fp = r.json()["system_fingerprint"]
        assert fp != before["system_fingerprint"]
        after = _complete(client)
        assert after["system_fingerprint"] == fp
        assert after["choices"][0]["logprobs"] != before["choices"][0]["logprobs"]


@pytest.mark.parametrize("tensors, match", [
    (None, "not a directory"),
    ({"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}, "up_proj.weight.*shape"),
    ({"model.nope.weight": torch.zeros(3)}, "model.nope.weight"),
    ({"model.norm.weight": torch.full((64,), float("inf"))}, "non-finite"),
])
def test_bad_update_is_a_400_naming_it_and_changes_nothing(model_dir, tmp_path, tensors, match):
    path = str(tmp_path / "missing") if tensors is None else _save(tmp_path / "w", tensors)
    with _client(model_dir, enable=True) as client:
        before = _complete(client)
        r = client.post("/v1/update_weights", json={"path": path}, headers=AUTH)
        assert r.status_code == 400
        assert re.search(match, r.json()["error"]["message"])
        after = _complete(client)
        assert after["system_fingerprint"] == before["system_fingerprint"]
        assert after["choices"][0]["logprobs"] == before["choices"][0]["logprobs"]


def test_update_weights_needs_the_key_and_the_flag(model_dir, tmp_path):
    with _client(model_dir, enable=True) as client:
        r = client.post("/v1/update_weights", json={"path": str(tmp_path)})
        assert r.status_code == 401
    with _client(model_dir, enable=False) as client:
        r = client.post("/v1/update_weights", json={"path": str(tmp_path)}, headers=AUTH)
        assert r.status_code == 404
