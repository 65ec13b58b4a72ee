"""``samebits serve --tensor-parallel-size 2`` on two GPUs (NCCL, bf16, CUDA graphs); skipped
without 2 CUDA devices.

What it proves, through the openai SDK on the Qwen3-tiny shapes (dummy weights): 48 concurrent
mixed requests (greedy and seeded sampled, top logprobs, token ids, some with two choices) equal
the same requests sent one by one, bitwise; a weight update of every weight reaches both ranks:
afterwards the server answers, concurrent and alone, bitwise what a fresh TP 2 server loaded from
a checkpoint of the new weights answers (and no longer what it answered before); when rank 1's
process is killed (SIGKILL) while the server is idle, /health turns 503 naming the rank within
30 s, a request gets a 503 naming it, and the server then stops on SIGTERM with its engine
process and ranks gone. Negative control: the standard numerics (``--standard``) at TP 2 give
other bits to the same 48 concurrent requests than to each alone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

pytestmark = [pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
              pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc")]

from safetensors.torch import save_file  # noqa: E402

from samebits import LLM  # noqa: E402
from tests.server.conftest import Server, start_server  # noqa: E402
from tests.server.test_engine_process import _engine_pid, _gone  # noqa: E402
from tests.server.test_serve_tensor_parallel import (  # noqa: E402
    KEY,
    MODEL,
    _mismatches,
    _rank_pids,
    _together_and_alone,
    _token_ids_present,
    _update,
    _wait_unhealthy,
    requests,
)
from tests.server.workload import send_one_by_one  # noqa: E402

CONFIG = Path(__file__).parents[2] / "benchmarks" / "configs" / "qwen3-tiny.json"
VOCAB = json.loads(CONFIG.read_text())["vocab_size"]
GPU = ("--device", "cuda", "--dtype", "bfloat16", "--tensor-parallel-size", "2",
       "--num-kv-blocks", "2048", "--max-model-len", "1024", "--canary-rate", "0",
       "--served-model-name", MODEL)
STOP_TIMEOUT_S = 90.0  # SIGTERM -> exit: drain, stop the engine process, release NCCL


def _serve(model: str | Path, *extra: str) -> Iterator[Server]:
    return start_server("--model", str(model), *GPU, *extra, api_key=KEY, max_model_len=None)


def _stop(servers: Iterator[Server], server: Server) -> None:
    """SIGTERM, then wait for the server to exit by itself (uvicorn re-raises the signal)."""
    server.proc.terminate()
    try:
        server.proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    servers.close()  # kills it if it did not exit
    assert server.proc.returncode == -signal.SIGTERM, server.log_tail()


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory) -> Iterator[Path]:
    """``new/``: a checkpoint (config.json, model.safetensors) of every weight of the dummy
    model, moved a little."""
    root = tmp_path_factory.mktemp("serve-tp-gpu")
    llm = LLM(str(CONFIG), load_format="dummy", device="cuda", dtype="bfloat16", seed=0,
              kv_cache_memory_bytes=1 << 26)
    gen = torch.Generator(device="cuda").manual_seed(7)
    new = {n: (w.float() + 0.01 * torch.randn(w.shape, device="cuda", generator=gen))
           .to(w.dtype).cpu() for n, w in llm.named_weights()}
    llm.engine.runner.shutdown()
    del llm
    torch.cuda.empty_cache()
    (root / "new").mkdir()
    (root / "new" / "config.json").write_text(CONFIG.read_text())
    save_file(new, str(root / "new" / "model.safetensors"), metadata={"format": "pt"})
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def tp2(weights_root) -> Iterator[Server]:
    yield from _serve(CONFIG, "--load-format", "dummy", "--enable-weight-updates",
                      "--weight-update-root", str(weights_root))


def _requests() -> list:
    return requests(48, vocab_size=VOCAB, longest=300, most_tokens=32)


def test_tp2_server_48_concurrent_requests_equal_each_alone(tp2):
    assert len(_rank_pids(_engine_pid(tp2))) == 1
    together, alone = _together_and_alone(tp2, _requests())
    _token_ids_present(together)
    assert _mismatches(together, alone) == []
    tp2.wait_idle()


def test_negative_control_standard_tp2_differs_and_the_server_stops_with_its_ranks():
    servers = _serve(CONFIG, "--load-format", "dummy", "--standard")
    server = next(servers)
    engine = _engine_pid(server)
    ranks = _rank_pids(engine)
    try:
        together, alone = _together_and_alone(server, _requests())
        assert _mismatches(together, alone), "standard numerics should change bits with the batch"
    finally:
        _stop(servers, server)
    assert len(ranks) == 1 and all(_gone(p, timeout=10) for p in [engine, *ranks])


def test_weight_update_reaches_both_ranks_equals_fresh_tp2_server_of_new_weights(tp2,
                                                                                 weights_root):
    reqs = _requests()
    before = send_one_by_one(tp2.client(), reqs)
    _update(tp2)
    together, alone = _together_and_alone(tp2, reqs)
    assert _mismatches(together, alone) == []
    assert _mismatches(alone, before) != []  # the update moved the answers
    servers = _serve(weights_root / "new")
    fresh = next(servers)
    try:
        want = send_one_by_one(fresh.client(), reqs)
    finally:
        servers.close()
    choices = [[json.loads(a)["choices"] for a in answers] for answers in (alone, want)]
    bad = [i for i, (a, w) in enumerate(zip(*choices, strict=True)) if a != w]
    assert bad == []


def test_killed_rank_turns_health_503_naming_it_within_30s(weights_root):
    servers = _serve(CONFIG, "--load-format", "dummy")
    server = next(servers)
    engine = _engine_pid(server)
    ranks = _rank_pids(engine)
    try:
        assert len(ranks) == 1 and send_one_by_one(server.client(), _requests()[:4])
        os.kill(ranks[0], signal.SIGKILL)
        health, waited = _wait_unhealthy(server, 30.0)
        assert health.status_code == 503 and waited < 30.0, (waited, health.text)
        assert f"rank 1 (pid {ranks[0]}) was killed by signal 9" in health.json()["status"]
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError, match="rank 1") as failed:
            send_one_by_one(server.client(timeout=60), _requests()[:1])
        assert failed.value.status_code == 503 and time.monotonic() - start < 10
    finally:
        _stop(servers, server)
    assert _gone(engine, timeout=10) and _gone(ranks[0], timeout=10)
