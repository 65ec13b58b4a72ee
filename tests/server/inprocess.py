"""The server's app in this process: over a small random model that has the default model's
tokenizer and chat template (so structured output, chat templating and stop strings all run),
driven through Starlette's TestClient (the app's lifespan runs: the engine loop is live)."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from pathlib import Path

import uvicorn

from samebits.config import EngineConfig
from samebits.engine.engine import LLMEngine
from samebits.loader import resolve_model_dir

MODEL = "tiny-smollm-tokenizer"
TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1024, "eos_token_id": 2, "tie_word_embeddings": False}


def tiny_model_dir(root: Path) -> Path:
    """config.json of ``TINY`` beside the default model's tokenizer files."""
    (root / "config.json").write_text(json.dumps(TINY))
    source = resolve_model_dir(None)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, root / name)
    return root


def tiny_engine(root: Path, **config) -> LLMEngine:
    """An engine over ``tiny_model_dir(root)`` with random weights (seed 0)."""
    path = tiny_model_dir(root) / "config.json"
    return LLMEngine(EngineConfig(str(path), load_format="dummy", num_kv_blocks=256, **config))


class LiveServer:
    """uvicorn serving ``app`` on a free loopback port, in a thread of this process (so a test
    can reach into the engine it serves), until ``close``."""

    def __init__(self, app) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                     log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.05)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
