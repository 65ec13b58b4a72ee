"""A ``samebits serve`` subprocess for the server benchmarks: start it on a free loopback port,
read its resident memory and its Prometheus metrics, stop it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*extra: str, timeout: float = 900.0) -> tuple[subprocess.Popen, str]:
    """``samebits serve *extra`` on a free loopback port, once /health answers 200."""
    port = free_port()
    args = [sys.executable, "-m", "samebits.cli", "serve", "--host", "127.0.0.1", "--port",
            str(port), "--log-level", "warning", *extra]
    log = tempfile.NamedTemporaryFile("w", prefix="samebits-bench-", suffix=".log", delete=False)
    env = {k: v for k, v in os.environ.items() if k != "SAMEBITS_API_KEY"}
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"samebits serve exited ({proc.returncode}); see {log.name}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"samebits serve not ready after {timeout} s; see {log.name}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of /metrics (0 when absent)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0
