"""Write the sentence-transformers files (modules.json, 1_Pooling/config.json) that tell samebits
how an embedding model pools, for test models built on the fly."""

from __future__ import annotations

import json
from pathlib import Path


def write_st_files(path: Path, dim: int, pooling: str, normalize: bool = True) -> None:
    """``pooling`` is a Pooling config key without its prefix, e.g. ``mean_tokens``, ``lasttoken``."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": dim, f"pooling_mode_{pooling}": True}))
