"""The engine core in a process of its own: the same bits and results as the core on a thread, a
start-up failure raised in the server as the engine raised it, a departed stream aborted, weights
swapped through the pipe, and the process gone when the server stops (SIGTERM), dies
(``kill -9``) or fails before it serves."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from safetensors.torch import save_file

from samebits.config import EngineConfig, ModelFormatError
from samebits.engine.engine import LLMEngine
from samebits.sampling_params import SamplingParams
from samebits.server.async_engine import AsyncEngine, Delta, RequestGroup
from samebits.server.engine_process import EngineProcess
from samebits.server.metrics import Metrics
from tests.server.conftest import Server, start_server
from tests.tiny_models import TINY_LLAMA_CONFIG, write_config

SAMPLED = SamplingParams(max_tokens=6, temperature=0.9, seed=4, ignore_eos=True, logprobs=2)
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> str:
    path = write_config(tmp_path_factory.mktemp("proc"), TINY_LLAMA_CONFIG)
    return str(path)


async def _serve(engine: LLMEngine | EngineProcess) -> tuple[list, list[list[Delta]]]:
    """A streamed sampled request and an unseeded n=2 one, together: (seeds, deltas) per group."""
    core = AsyncEngine(engine, Metrics("tiny", engine.fingerprint, True))
    core.start()
    groups = [RequestGroup(["s-0"], [[5, 6, 7, 8]], [SAMPLED], [0], stream=True),
              RequestGroup(["w-0", "w-1"], [[9] * 12] * 2, [GREEDY] * 2, [0, 1], stream=False)]
    try:
        await asyncio.gather(*(core.submit(g) for g in groups))
        return [g.seeds for g in groups], [await _drain(g) for g in groups]
    finally:
        core.stop()


async def _drain(group: RequestGroup) -> list[Delta]:
    out, remaining = [], len(group.request_ids)
    while remaining:
        delta = await asyncio.wait_for(group.queue.get(), 120)
        assert delta.error is None, delta.error
        remaining -= delta.output is not None
        out.append(delta)
    return out


def test_engine_process_serves_the_thread_cores_bits_and_exits_when_stopped(config_path):
    config = EngineConfig(config_path, load_format="dummy", num_kv_blocks=32)
    in_thread = asyncio.run(_serve(LLMEngine(config)))
    process = EngineProcess(config)
    assert process.fingerprint and process.max_model_len == 128 and process.tokenizer is None
    in_process = asyncio.run(_serve(process))
    assert in_process == in_thread  # seeds, every delta (tokens, logprobs, outputs), bit for bit
    assert [len(d) for d in in_process[1]] == [6, 2]
    assert process._process.exitcode == 0 and not process.alive


def test_engine_process_start_failure_is_the_engines_error(tmp_path):
    path = write_config(tmp_path, {**TINY_LLAMA_CONFIG, "architectures": ["NoSuchForCausalLM"]})
    with pytest.raises(ModelFormatError, match="unsupported architecture"):
        EngineProcess(EngineConfig(str(path), load_format="dummy", num_kv_blocks=32))


def test_departed_stream_is_aborted_in_the_engine_process(server: Server):
    before = server.metric("samebits_engine_requests_finished_total", reason="abort")
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Count to one thousand:",
            "max_tokens": 500, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers,
                      timeout=300) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 2:
                break  # the client leaves mid-stream
    server.wait_idle()
    assert server.metric("samebits_engine_requests_finished_total", reason="abort") == before + 1


def test_a_server_failing_after_the_engine_started_exits_without_waiting_for_it(config_path,
                                                                            tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(
        "from samebits.config import EngineConfig\n"
        "from samebits.server.engine_process import EngineProcess\n"
        "if __name__ == '__main__':\n"
        f"    EngineProcess(EngineConfig({config_path!r}, load_format='dummy', num_kv_blocks=32))\n"
        "    raise SystemExit('the app failed to build')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(script)], env=env, timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 1 and "the app failed to build" in done.stderr


def _serve_tiny(config_path: str, *extra: str, api_key: str | None = None) -> Iterator[Server]:
    return start_server("--model", config_path, "--load-format", "dummy", "--num-kv-blocks", "32",
                        "--canary-rate", "0", *extra, api_key=api_key, max_model_len=None)


def test_weights_are_swapped_in_the_engine_process(config_path, tmp_path):
    (tmp_path / "norm").mkdir()
    save_file({"model.norm.weight": torch.full((TINY_LLAMA_CONFIG["hidden_size"],), 1.7)},
              str(tmp_path / "norm" / "model.safetensors"))
    servers = _serve_tiny(config_path, "--enable-weight-updates", "--weight-update-root",
                          str(tmp_path), api_key="k-1")
    server = next(servers)
    try:
        def complete() -> dict:
            body = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "logprobs": 0}
            r = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers,
                           timeout=60)
            assert r.status_code == 200, r.text
            return r.json()
        before = complete()
        r = httpx.post(f"{server.url}/v1/update_weights", json={"path": "norm"},
                       headers=server.headers, timeout=60)
        assert r.status_code == 200, r.text
        after = complete()
        assert after["system_fingerprint"] == r.json()["system_fingerprint"]
        assert after["system_fingerprint"] != before["system_fingerprint"]
        assert after["choices"][0]["logprobs"] != before["choices"][0]["logprobs"]
    finally:
        servers.close()


def _engine_pid(server: Server) -> int:
    pid = server.proc.pid
    children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    engines = [int(c) for c in children if "spawn_main" in open(f"/proc/{c}/cmdline").read()]
    assert len(engines) == 1, children
    return engines[0]


def _gone(pid: int, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True  # exited; its parent has not reaped it yet
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc (Linux)")
def test_engine_process_writes_its_stacks_on_sigusr1_and_stops_with_the_server(config_path):
    servers = _serve_tiny(config_path)
    server = next(servers)
    engine_pid = _engine_pid(server)
    os.kill(engine_pid, signal.SIGUSR1)  # a hang can be read: every thread's stack to the log
    deadline = time.monotonic() + 30
    while "engine_core.py" not in server.log_tail(20_000) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "most recent call first" in server.log_tail(20_000), server.log_tail()
    assert "engine_core.py" in server.log_tail(20_000), server.log_tail()
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text  # it goes on serving
    servers.close()  # SIGTERM: the server drains, stops the engine process, exits
    assert server.proc.returncode is not None
    assert _gone(engine_pid, timeout=5)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc (Linux)")
def test_engine_process_exits_when_the_server_is_killed(config_path):
    servers = _serve_tiny(config_path)
    server = next(servers)
    engine_pid = _engine_pid(server)
    os.kill(server.proc.pid, signal.SIGKILL)
    try:
        assert _gone(engine_pid, timeout=30)
    finally:
        servers.close()
