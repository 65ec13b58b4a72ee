"""``POST /v1/update_weights`` in process (a tiny dummy Llama): the answer is the new fingerprint
and later responses carry it. Only with an API key (or an explicit opt-out) and a weight-update
root; only directories inside the root and regular files inside the directory are read (a FIFO
is refused without being opened, so nothing freezes); every path outside the root gets the same
answer; non-finite or overflowing tensors, oversize files and bad tensors are 400s naming the
problem, after which the old weights serve the same bits."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save_file

from samebits import cli
from samebits.server.app import build_app
from samebits.server.limits import ServerLimits
from samebits.server.weight_updates import OUTSIDE, overflow_limit
from tests.server.live import AUTH, KEY, tiny_engine

BODY = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0,
        "logprobs": 0}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("weight-root")


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """A directory beside the root holding a real safetensors file."""
    d = tmp_path_factory.mktemp("outside")
    save_file({"model.norm.weight": torch.full((64,), 2.0)}, str(d / "model.safetensors"))
    return d


def _client(engine, root, api_key: str | None = KEY, **limits) -> TestClient:
    limits = ServerLimits(enable_weight_updates=True, weight_update_root=str(root), **limits)
    return TestClient(build_app(engine, "tiny", api_key, limits=limits))


@pytest.fixture(scope="module")
def client(tmp_path_factory, root):
    with _client(tiny_engine(tmp_path_factory.mktemp("tiny")), root) as c:
        yield c


def _complete(client: TestClient) -> dict:
    r = client.post("/v1/completions", json=BODY, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def _update(client: TestClient, path) -> dict:
    r = client.post("/v1/update_weights", json={"path": str(path)}, headers=AUTH)
    return {"status": r.status_code, **r.json()}


def _save(directory, tensors: dict) -> str:
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))
    return directory.name


def _index(directory, *shards: str) -> str:
    directory.mkdir()
    weight_map = {f"model.layers.{i}.input_layernorm.weight": s for i, s in enumerate(shards)}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory.name


def _refused(client: TestClient, path, match: str) -> str:
    """The update is a 400 whose message contains ``match``; the served bits are unchanged."""
    before = _complete(client)
    r = _update(client, path)
    assert r["status"] == 400, r
    assert match in r["error"]["message"], r["error"]["message"]
    after = _complete(client)
    assert after["system_fingerprint"] == before["system_fingerprint"]
    assert after["choices"][0]["logprobs"] == before["choices"][0]["logprobs"]
    return r["error"]["message"]


def test_update_weights_swaps_and_answers_the_new_fingerprint(tmp_path_factory, root):
    with _client(tiny_engine(tmp_path_factory.mktemp("tiny")), root) as client:
        before = _complete(client)
        name = _save(root / "swap", {"model.norm.weight": torch.full((64,), 1.7)})
        r = _update(client, root / name)  # absolute inside the root; relative works too
        assert r["status"] == 200, r
        after = _complete(client)
        assert after["system_fingerprint"] == r["system_fingerprint"]
        assert r["system_fingerprint"] != before["system_fingerprint"]
        assert after["choices"][0]["logprobs"] != before["choices"][0]["logprobs"]


@pytest.mark.parametrize("tensor, match", [
    (torch.full((64,), float("inf")), "non-finite"),
    (torch.full((64,), float("nan")), "non-finite"),
    (torch.full((64,), 3e38), "overflow"),
    (torch.full((64,), 2 * overflow_limit(torch.float32)), "overflow"),
])
def test_non_finite_or_overflowing_weights_are_a_400_naming_the_tensor(client, root, tensor,
                                                                       match):
    name = _save(root / f"bad-{len(os.listdir(root))}", {"model.norm.weight": tensor})
    message = _refused(client, name, match)
    assert "model.norm.weight" in message


@pytest.mark.parametrize("tensors, match", [
    ({"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}, "shape"),
    ({"model.nope.weight": torch.zeros(3)}, "model.nope.weight"),
])
def test_tensors_that_do_not_fit_the_model_are_a_400(client, root, tensors, match):
    _refused(client, _save(root / f"misfit-{len(os.listdir(root))}", tensors), match)


def test_every_path_outside_the_root_gets_the_same_answer(client, root, outside):
    (root / "escape").symlink_to(outside)
    for path in (outside, outside / "nothing-here", "/etc", "/", "..", "../" + outside.name,
                 "escape", root / "escape", "a\x00b", "x" * 5000):
        assert _refused(client, path, OUTSIDE) == OUTSIDE
    message = _refused(client, "missing", "not a directory inside the weight-update root")
    assert str(root) not in message  # names relative to the root only


def test_shards_must_be_inside_the_directory(client, root, outside):
    shard = str(outside / "model.safetensors")
    for i, name in enumerate(["../../" + outside.name + "/model.safetensors", shard,
                              "/etc/passwd", "../nothing.safetensors"]):
        _refused(client, _index(root / f"index-out-{i}", name), "is not inside the directory")
    d = root / "link-out"
    d.mkdir()
    (d / "model.safetensors").symlink_to(shard)
    _refused(client, d.name, "is not inside the directory")
    _refused(client, _index(root / "index-missing", "gone.safetensors"), "is missing")


def test_a_fifo_is_refused_without_being_opened(client, root):
    named = root / "fifo-named"
    _index(named, "w.safetensors")
    os.mkfifo(named / "w.safetensors")
    globbed = root / "fifo-globbed"
    globbed.mkdir()
    os.mkfifo(globbed / "model.safetensors")
    index = root / "fifo-index"
    index.mkdir()
    os.mkfifo(index / "model.safetensors.index.json")
    start = time.monotonic()
    for d in (named, globbed, index):
        _refused(client, d.name, "is not a regular file")
    assert time.monotonic() - start < 30  # nothing blocked on a FIFO
    assert client.get("/health").status_code == 200


def test_oversize_or_malformed_files_are_a_400(client, root):
    big = root / "big"
    big.mkdir()
    with open(big / "model.safetensors", "wb") as f:
        f.truncate(1 << 36)  # sparse: 64 GiB declared, nothing read
    _refused(client, big.name, "more than this model's weights")
    junk = root / "junk"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"\xff" * 64)
    _refused(client, junk.name, "not a safetensors file")


def test_reading_past_the_timeout_is_a_400(tmp_path_factory, root):
    engine = tiny_engine(tmp_path_factory.mktemp("tiny"))
    name = _save(root / "slow", {"model.norm.weight": torch.ones(64)})
    with _client(engine, root, weight_update_timeout_s=1e-9) as client:
        _refused(client, name, "could not be read within")


def test_weight_updates_need_an_api_key_unless_explicitly_allowed(root, monkeypatch, capsys,
                                                                  caplog, client):
    monkeypatch.delenv("SAMEBITS_API_KEY", raising=False)
    argv = ["serve", "--enable-weight-updates", "--weight-update-root", str(root)]
    assert cli.main(argv) == 2  # before any model is loaded
    assert "needs an API key" in capsys.readouterr().err
    assert cli.main(["serve", "--enable-weight-updates"]) == 2
    assert "--weight-update-root" in capsys.readouterr().err
    limits = ServerLimits(enable_weight_updates=True, weight_update_root=str(root),
                          allow_unauthenticated_weight_updates=True)
    with caplog.at_level(logging.WARNING, "samebits.server"):
        limits.check_auth(())
    assert "WITHOUT an API key" in caplog.text


def test_update_weights_needs_the_key_and_the_flag(client, tmp_path_factory, root):
    assert client.post("/v1/update_weights", json={"path": "x"}).status_code == 401
    engine = tiny_engine(tmp_path_factory.mktemp("tiny"))
    with TestClient(build_app(engine, "tiny", KEY)) as plain:
        r = plain.post("/v1/update_weights", json={"path": str(root)}, headers=AUTH)
        assert r.status_code == 404
