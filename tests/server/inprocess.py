"""The server's app in this process: over a small random model that has the default model's
tokenizer and chat template (so structured output, chat templating and stop strings all run),
driven through Starlette's TestClient (the app's lifespan runs: the engine loop is live)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from samebits.config import EngineConfig
from samebits.engine.engine import LLMEngine
from samebits.loader import resolve_model_dir

MODEL = "tiny-smollm-tokenizer"
TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 64, "eos_token_id": 2, "tie_word_embeddings": True}


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
