"""Real ``samebits serve`` processes on loopback (a free port each), shared by the server tests.

``server``: the batch-invariant numerics, behind two API keys, reporting cached prompt tokens
(``--enable-prompt-tokens-details``). ``standard_server``: ``--standard``,
no key (the negative control). Both use the default SmolLM2-135M model with a 1024-token context.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-key-123"
SECOND_API_KEY = "second-key-456"  # the server fixture accepts both
MAX_MODEL_LEN = 1024
START_TIMEOUT_S = 300


@dataclass
class Server:
    url: str
    api_key: str | None
    proc: subprocess.Popen
    log_path: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, timeout: float = 600.0) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none",
                             max_retries=0, timeout=timeout)

    def async_client(self, timeout: float = 900.0) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none",
                                  max_retries=0, timeout=timeout)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics (0 when absent)."""
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=30).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0

    def wait_idle(self, timeout: float = 120.0) -> None:
        """Until no request runs or waits and no KV block is in use (bounded in time)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (self.metric("samebits_kv_blocks_in_use") == 0
                    and self.metric("samebits_num_requests_running") == 0
                    and self.metric("samebits_num_requests_waiting") == 0):
                return
            time.sleep(0.5)
        raise AssertionError(f"server not idle after {timeout}s: "
                             f"{self.metric('samebits_kv_blocks_in_use')} KV blocks in use")

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*extra: str, api_key: str | None = None,
                 max_model_len: int | None = MAX_MODEL_LEN) -> Iterator[Server]:
    """``samebits serve *extra`` on a free loopback port, until the generator is closed."""
    port = _free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="samebits-serve-", suffix=".log", delete=False)
    args = [sys.executable, "-m", "samebits.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", *extra]
    if max_model_len is not None:
        args += ["--max-model-len", str(max_model_len)]
    if api_key:
        args += ["--api-key", api_key]
    env = {k: v for k, v in os.environ.items() if k != "SAMEBITS_API_KEY"}
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(f"http://127.0.0.1:{port}", api_key, proc, log.name)
    try:
        _wait_ready(server)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def _wait_ready(server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"samebits serve exited ({server.proc.returncode}):\n"
                               f"{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"samebits serve not ready after {START_TIMEOUT_S}s:\n{server.log_tail()}")


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    yield from start_server("--api-key", SECOND_API_KEY, "--enable-prompt-tokens-details",
                            api_key=API_KEY)


@pytest.fixture(scope="session")
def standard_server() -> Iterator[Server]:
    yield from start_server("--standard")


@pytest.fixture(scope="session")
def offline_llm():
    """The offline API on the servers' model and context (a small KV cache)."""
    from samebits import LLM
    return LLM(max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)
