"""Tiny model configs the tests load with random weights (``load_format="dummy"``): one copy of
each model that several test files share, and ``write_config`` to save one as a config.json.

- ``TINY_LLAMA_CONFIG``: Llama, 2 layers, hidden 64, 4 query / 2 KV heads of 16, a 300-token
  vocabulary (eos 299), 128 positions: the engine core, engine process and canary tests' model.
- ``TP_LLAMA_CONFIG``: Llama, 2 layers, hidden 96, 12 query / 6 KV heads of 16 (N = 1, 2, 3 and 6
  divide them), intermediate size 200, untied head: odd sizes give tensor parallel uneven slices.
- ``MICRO_LLAMA_CONFIG``: Llama, 1 layer, hidden 32, 4 query / 2 KV heads of 8, a 64-token
  vocabulary, 64 positions: the smallest model, for tests of everything but the numbers.
- ``TINY_BERT_CONFIG``: BERT, 1 layer, hidden 32, 2 heads, a 100-token vocabulary, 40 positions.
"""

from __future__ import annotations

import json
from pathlib import Path

TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 128, "eos_token_id": 299}
TP_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 500, "hidden_size": 96,
    "intermediate_size": 200, "num_hidden_layers": 2, "num_attention_heads": 12,
    "num_key_value_heads": 6, "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 256, "tie_word_embeddings": False, "eos_token_id": 499}
MICRO_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64}
TINY_BERT_CONFIG = {
    "architectures": ["BertModel"], "vocab_size": 100, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
    "max_position_embeddings": 40}


def write_config(directory: Path, config: dict) -> Path:
    """``config`` saved as ``directory``/config.json (the directory exists); returns that path."""
    path = directory / "config.json"
    path.write_text(json.dumps(config))
    return path
