"""``samebits serve --tensor-parallel-size 2`` on CPU (gloo): the server's engine process spawns
rank 1 (a spawn inside a spawned process), and the server keeps TP 1's bits and lifecycle.

What it proves, through the openai SDK on a tiny dummy Llama (6 KV heads): 8 concurrent mixed
requests (greedy and seeded sampled, top logprobs, token ids) equal the same requests sent one
by one, bitwise, and equal a TP 1 server's answers; a weight update (row-, column- and vocab-
parallel weights) reaches both ranks: afterwards TP 2 equals a TP 1 server updated the same way;
when rank 1 is killed (SIGKILL) while the server is idle, /health turns 503 naming the rank within
30 s, a request gets a 503 naming it (no hang), and the server still stops cleanly, its engine
process and rank gone; killed mid-stream, the stream ends with an error naming the rank.
A TP 2 server that stops normally exits with code 0 and leaves no process behind. Negative
control: the standard numerics (``--standard``) at TP 2 give other bits to the same concurrent
requests than to each alone.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from safetensors.torch import save_file

from tests.server.conftest import Server, start_server
from tests.server.test_engine_process import _engine_pid, _gone
from tests.server.workload import Request, send_all_at_once, send_one_by_one
from tests.tiny_models import TP_LLAMA_CONFIG, write_config

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc")]
KEY = "tp-key"
MODEL = "tiny-tp"
HEALTH_TIMEOUT_S = 30.0
UPDATED = ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight",
           "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight",
           "lm_head.weight", "model.norm.weight")


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> str:
    path = write_config(tmp_path_factory.mktemp("serve-tp"), TP_LLAMA_CONFIG)
    return str(path)


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory) -> str:
    """``new/model.safetensors``: new values for sharded (row-, column-, vocab-parallel) and
    replicated weights."""
    root = tmp_path_factory.mktemp("serve-tp-weights")
    cfg = TP_LLAMA_CONFIG
    h, q, i, v = cfg["hidden_size"], cfg["num_attention_heads"] * cfg["head_dim"], \
        cfg["intermediate_size"], cfg["vocab_size"]
    shapes = dict(zip(UPDATED, [(h, q), (h, i), (q, h), (i, h), (v, h), (h,)], strict=True))
    gen = torch.Generator().manual_seed(7)
    tensors = {n: torch.randn(s, generator=gen) * 0.2 for n, s in shapes.items()}
    (root / "new").mkdir()
    save_file(tensors, str(root / "new" / "model.safetensors"))
    return str(root)


def _serve(config_path: str, *extra: str, api_key: str | None = KEY) -> Iterator[Server]:
    return start_server("--model", config_path, "--load-format", "dummy", "--num-kv-blocks", "64",
                        "--canary-rate", "0", "--served-model-name", MODEL, *extra,
                        api_key=api_key, max_model_len=None)


def _updatable(config_path: str, weights_root: str, *extra: str) -> Iterator[Server]:
    servers = _serve(config_path, "--enable-weight-updates", "--weight-update-root",
                     weights_root, *extra)
    yield next(servers)
    servers.close()


@pytest.fixture(scope="module")
def tp2(config_path, weights_root) -> Iterator[Server]:
    yield from _updatable(config_path, weights_root, "--tensor-parallel-size", "2")


@pytest.fixture(scope="module")
def tp1(config_path, weights_root) -> Iterator[Server]:
    yield from _updatable(config_path, weights_root)


def requests(count: int = 8, vocab_size: int = TP_LLAMA_CONFIG["vocab_size"], longest: int = 40,
             most_tokens: int = 10) -> list[Request]:
    """Completions of token-id prompts (3 to ``longest`` tokens): greedy and seeded sampled in
    turn, top logprobs and token ids; the sixth of every eight asks for two choices."""
    rng = random.Random(29)
    out: list[Request] = []
    for i in range(count):
        kw: dict[str, Any] = dict(
            model=MODEL, prompt=[rng.randrange(2, vocab_size - 1)
                                 for _ in range(rng.randint(3, longest))],
            max_tokens=rng.randint(4, most_tokens), logprobs=2, seed=rng.randrange(1 << 31),
            temperature=0.0 if i % 2 == 0 else rng.choice([0.8, 1.0]),
            top_p=1.0 if i % 4 != 3 else 0.9,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        if i % 8 == 5:
            kw["n"] = 2
        out.append(("completions", kw))
    return out


def _together_and_alone(server: Server, reqs: list[Request]) -> tuple[list[str], list[str]]:
    together = send_all_at_once(server.async_client(), reqs, timeout=300)
    return together, send_one_by_one(server.client(), reqs)


def _mismatches(a: list[str], b: list[str]) -> list[int]:
    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]


def _token_ids_present(answers: list[str]) -> None:
    for answer in answers:
        choices = json.loads(answer)["choices"]
        assert all(c["token_ids"] and c["logprobs"]["top_logprobs"] for c in choices), answer


def test_tp2_server_concurrent_requests_equal_each_alone_and_tp1_server(tp2, tp1):
    reqs = requests()
    together, alone = _together_and_alone(tp2, reqs)
    _token_ids_present(together)
    assert _mismatches(together, alone) == []
    assert _mismatches(alone, send_one_by_one(tp1.client(), reqs)) == []
    tp2.wait_idle()


def _update(server: Server) -> str:
    r = httpx.post(f"{server.url}/v1/update_weights", json={"path": "new"}, headers=server.headers,
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["system_fingerprint"]


def test_weight_update_reaches_both_ranks_tp2_equals_updated_tp1(tp2, tp1):
    reqs = requests()
    before = send_one_by_one(tp2.client(), reqs)
    assert _update(tp2) == _update(tp1)
    together, alone = _together_and_alone(tp2, reqs)
    assert _mismatches(alone, before) == list(range(len(reqs)))  # the update changed every answer
    assert _mismatches(together, alone) == []
    assert _mismatches(alone, send_one_by_one(tp1.client(), reqs)) == []


def _rank_pids(engine_pid: int) -> list[int]:
    """The engine process's spawned children: its tensor-parallel ranks."""
    children = open(f"/proc/{engine_pid}/task/{engine_pid}/children").read().split()
    return [int(c) for c in children if "spawn_main" in open(f"/proc/{c}/cmdline").read()]


def _stopped_on_sigterm(server: Server) -> None:
    """The server shut down on the SIGTERM it was sent, within the 30 s before it would have been
    killed (uvicorn re-raises the signal once its shutdown is done)."""
    assert server.proc.returncode == -signal.SIGTERM, server.log_tail()


def _wait_unhealthy(server: Server, timeout: float) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    while True:
        r = httpx.get(f"{server.url}/health", timeout=10)
        if r.status_code != 200 or time.monotonic() - start > timeout:
            return r, time.monotonic() - start
        time.sleep(0.2)


def test_killed_rank_turns_health_503_naming_it_and_requests_fail_fast(config_path):
    servers = _serve(config_path, "--tensor-parallel-size", "2")
    server = next(servers)
    try:
        engine = _engine_pid(server)
        ranks = _rank_pids(engine)
        assert len(ranks) == 1, ranks
        assert send_one_by_one(server.client(), requests(1))  # it serves
        os.kill(ranks[0], signal.SIGKILL)
        health, waited = _wait_unhealthy(server, HEALTH_TIMEOUT_S)
        assert health.status_code == 503 and waited < HEALTH_TIMEOUT_S, (waited, health.text)
        assert f"rank 1 (pid {ranks[0]}) was killed by signal 9" in health.json()["status"]
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError, match="rank 1") as failed:
            send_one_by_one(server.client(timeout=60), requests(1))
        assert failed.value.status_code == 503 and time.monotonic() - start < 10
    finally:
        servers.close()
    _stopped_on_sigterm(server)
    assert _gone(engine, timeout=5) and _gone(ranks[0], timeout=5)


def test_rank_killed_mid_stream_ends_the_stream_with_an_error_naming_it(config_path):
    servers = _serve(config_path, "--tensor-parallel-size", "2")
    server = next(servers)
    try:
        rank = _rank_pids(_engine_pid(server))[0]
        stream = server.client(timeout=60).completions.create(
            model=MODEL, prompt=[1, 2, 3], max_tokens=240, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        chunks = 0
        with pytest.raises(openai.APIError, match=r"rank 1 \(pid \d+\) was killed by signal 9"):
            for _ in stream:
                chunks += 1
                if chunks == 2:
                    os.kill(rank, signal.SIGKILL)
        assert 2 <= chunks < 240
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503
    finally:
        servers.close()
    _stopped_on_sigterm(server)


def test_negative_control_standard_tp2_differs_and_the_server_stops_with_its_ranks(config_path):
    servers = _serve(config_path, "--tensor-parallel-size", "2", "--standard")
    server = next(servers)
    try:
        engine = _engine_pid(server)
        ranks = _rank_pids(engine)
        together, alone = _together_and_alone(server, requests())
        assert _mismatches(together, alone), "standard numerics should change bits with the batch"
    finally:
        servers.close()
    _stopped_on_sigterm(server)
    assert len(ranks) == 1 and all(_gone(p, timeout=5) for p in [engine, *ranks])
