"""The real server stack in this process, for the connection, auth and shutdown tests: a tiny
dummy Llama (token-id prompts, no tokenizer) behind ``build_app`` and samebits' uvicorn server
(``lifecycle.make_server``: the bounded connection protocol, the draining shutdown), listening on
a free loopback port in a thread of its own."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from samebits.config import EngineConfig
from samebits.engine.engine import LLMEngine
from samebits.server.app import build_app
from samebits.server.lifecycle import DrainingServer, make_server
from samebits.server.limits import ServerLimits
from tests.tiny_models import TINY_LLAMA_CONFIG, write_config

KEY = "live-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# the engine tests' tiny Llama, 8192 positions long
CONFIG = {**TINY_LLAMA_CONFIG, "max_position_embeddings": 8192}


def tiny_engine(directory: Path) -> LLMEngine:
    path = write_config(directory, CONFIG)
    return LLMEngine(EngineConfig(str(path), load_format="dummy", num_kv_blocks=1024))


@dataclass
class Live:
    url: str
    host: str
    port: int
    server: DrainingServer
    thread: threading.Thread

    def connect(self, timeout: float = 10.0) -> socket.socket:
        return socket.create_connection((self.host, self.port), timeout=timeout)


@contextmanager
def live(engine: LLMEngine, limits: ServerLimits | None = None,
         api_key: str | None = KEY) -> Iterator[Live]:
    """The app over ``engine`` served until the block ends (then shut down as on SIGTERM)."""
    limits = limits or ServerLimits()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = build_app(engine, "tiny", api_key, limits=limits)
    server = make_server(app, app.state.readiness, limits, "127.0.0.1", port, "warning")
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield Live(f"http://127.0.0.1:{port}", "127.0.0.1", port, server, thread)
    finally:
        server.should_exit = True
        thread.join(60)


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closes ``sock`` within ``timeout`` (reading whatever it sends)."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False
