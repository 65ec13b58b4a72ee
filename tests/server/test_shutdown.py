"""Startup and shutdown: SIGTERM drains running streams (each ends with its last chunk and [DONE],
or, past the grace period, an error event and [DONE]); an engine that cannot step turns /health
503 and refuses new work; a stream the client leaves is counted as 499; the CPU kernels are built
before the server listens, and a builder killed with -9 never blocks the next build."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from samebits.server.app import build_app
from samebits.server.lifecycle import FINAL_EVENTS_S
from samebits.server.limits import ServerLimits
from tests.server.live import AUTH, CONFIG, KEY, live, tiny_engine

GRACE_S = 1.0
LONG = 8000  # tokens: far more than the tiny model generates in the grace period


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_engine(tmp_path_factory.mktemp("tiny"))


class Stream(threading.Thread):
    """A streamed completion read in a thread: ``events`` (the data lines) and ``started``."""

    def __init__(self, url: str, max_tokens: int, leave_after: int | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.leave_after = url, max_tokens, leave_after
        self.events: list[str] = []
        self.started = threading.Event()

    def run(self) -> None:
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, headers=AUTH,
                          timeout=120) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    self.started.set()
                if self.leave_after is not None and len(self.events) >= self.leave_after:
                    return  # the client goes away mid-stream


def test_sigterm_drains_streams_within_the_grace_period(engine):
    with live(engine, ServerLimits(shutdown_grace_s=GRACE_S)) as srv:
        short, long = Stream(srv.url, 40), Stream(srv.url, LONG)
        for s in (short, long):
            s.start()
            assert s.started.wait(60)
        start = time.monotonic()
        srv.server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler does
        for s in (short, long):
            s.join(GRACE_S + FINAL_EVENTS_S + 5)
        srv.thread.join(GRACE_S + FINAL_EVENTS_S + 5)
        took = time.monotonic() - start
    assert not srv.thread.is_alive() and took < GRACE_S + FINAL_EVENTS_S
    assert short.events[-1] == "[DONE]"
    assert json.loads(short.events[-2])["choices"][0]["finish_reason"] == "length"
    assert long.events[-1] == "[DONE]"
    error = json.loads(long.events[-2])["error"]
    assert "shutting down" in error["message"]
    assert len(long.events) - 2 < LONG  # it was cut, and said so


def _metric(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_a_stream_the_client_leaves_is_counted_as_499(engine):
    with live(engine) as srv:
        s = Stream(srv.url, LONG, leave_after=3)
        s.start()
        s.join(60)
        deadline = time.monotonic() + 10
        while _metric(srv.url, "samebits_requests_total", status="499") < 1:
            assert time.monotonic() < deadline, "the abandoned stream was not counted as 499"
            time.sleep(0.1)
        assert _metric(srv.url, "samebits_requests_total", status="200") == 0


def _fail_step(engine) -> None:
    def step():
        raise RuntimeError("device lost")
    engine.step = step


def _kill_thread(engine) -> None:
    def stats():
        raise SystemExit  # escapes the loop: the engine thread ends
    engine.stats = stats


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("fault, why", [(_fail_step, "an engine step failed"),
                                        (_kill_thread, "the engine thread stopped")])
def test_an_engine_that_cannot_step_turns_health_503_and_refuses_work(tmp_path, fault, why):
    engine = tiny_engine(tmp_path)
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}
    with TestClient(build_app(engine, "tiny", KEY)) as client:
        assert client.get("/health").status_code == 200
        fault(engine)
        client.post("/v1/completions", json=body, headers=AUTH)  # meets the fault
        deadline = time.monotonic() + 10
        while client.get("/health").status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        health = client.get("/health")
        assert health.status_code == 503 and why in health.json()["status"]
        r = client.post("/v1/completions", json=body, headers=AUTH)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_unavailable"
        assert why in r.json()["error"]["message"]


def test_the_cpu_kernels_are_built_before_the_server_listens(tmp_path, monkeypatch):
    from samebits import cli
    from samebits.ops import cpu_kernels
    from samebits.server import app as app_module
    built = []
    monkeypatch.setattr(cpu_kernels, "load", lambda: built.append(True))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    args = cli.build_parser().parse_args(["serve", "--model", str(tmp_path / "config.json"),
                                          "--load-format", "dummy", "--device", "cpu",
                                          "--num-kv-blocks", "16", "--max-model-len", "256"])
    app_module.build_served_app(args, (KEY,))
    assert built == [True]


BUILDER = """
import fcntl, os, sys, time
from pathlib import Path
lock, torch_dir, work_dir, marker = sys.argv[1:]
fd = os.open(lock, os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)  # what a builder holds while it compiles
for d in (torch_dir, work_dir):  # torch's lock file and a half-built object, as a kill leaves them
    os.makedirs(d, exist_ok=True)
    Path(d, "lock").write_text("")
    Path(d, "tiny_op.o").write_bytes(b"partial")
Path(marker).write_text("building")
time.sleep(3600)
"""


def test_a_builder_killed_with_sigkill_never_blocks_the_next_build(tmp_path, monkeypatch):
    """A process holding the build lock mid-build (the layout ``cpu_kernels.build`` documents)
    is killed with -9; the next build neither waits for it nor reuses its files."""
    from torch.utils import cpp_extension

    from samebits.ops import cpu_kernels
    source = tmp_path / "tiny_op.cpp"
    source.write_text("int samebits_tiny_op() { return 7; }\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    name = f"samebits_test_{os.getpid()}"
    torch_dir = Path(cpp_extension._get_build_directory(name, False))
    root, marker = torch_dir.parent, tmp_path / "building"
    proc = subprocess.Popen([sys.executable, "-c", BUILDER, str(root / f"{name}.lock"),
                             str(torch_dir), str(root / f"{name}.build-dead"), str(marker)])
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the builder did not start"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    start = time.monotonic()
    library = cpu_kernels.build(name, [source], [], [])  # must not wait on the dead builder
    assert library.exists() and time.monotonic() - start < 120
    assert not list(root.glob(f"{name}.build-*"))  # the dead build's leftovers are gone


@pytest.mark.slow
def test_the_real_kernels_build_after_a_builder_is_killed_mid_compile(tmp_path):
    """The real source, a real compiler, killed while it compiles; a new process then builds."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path),
           "PYTHONPATH": str(Path(__file__).parents[2])}
    load = [sys.executable, "-c", "from samebits.ops import cpu_kernels; cpu_kernels.load()"]
    proc = subprocess.Popen(load, env=env)
    deadline = time.monotonic() + 120
    while not list(tmp_path.rglob("*.ninja")) and not list(tmp_path.rglob("build.ninja")):
        assert proc.poll() is None and time.monotonic() < deadline, "the build did not start"
        time.sleep(0.1)
    time.sleep(2.0)  # inside the compile
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    done = subprocess.run(load, env=env, timeout=900, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_sigterm_to_samebits_serve_drains_its_streams(tmp_path):
    """The real command and the real signal: a stream running at SIGTERM gets an error event
    and [DONE] after the grace period, and the process exits within it plus FINAL_EVENTS_S."""
    from tests.server.conftest import start_server
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    servers = start_server("--model", str(tmp_path / "config.json"), "--load-format", "dummy",
                           "--shutdown-grace-period", str(GRACE_S), "--served-model-name",
                           "tiny", api_key=KEY,
                           max_model_len=None)
    server = next(servers)
    s = Stream(server.url, LONG)
    s.start()
    assert s.started.wait(60)
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    # uvicorn re-raises the signal once it has shut down: the status says "ended by SIGTERM"
    assert server.proc.wait(GRACE_S + FINAL_EVENTS_S + 10) in (0, -signal.SIGTERM)
    assert time.monotonic() - start < GRACE_S + FINAL_EVENTS_S + 2
    s.join(10)
    assert s.events[-1] == "[DONE]" and "error" in json.loads(s.events[-2])
    servers.close()
