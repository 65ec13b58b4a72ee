"""Turn an ``EngineConfig`` into a loaded decoder: resolve the model (embedded default, GGUF file,
HF directory, or a config.json for dummy weights), build this rank's shard of it on its device,
load its part of the weights (safetensors slices: nothing else is read), and derive the numerics
fingerprint."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from samebits.config import EngineConfig, ModelConfig, ModelFormatError, read_json
from samebits.distributed.group import TPGroup
from samebits.loader import dummy, hf, hub
from samebits.models import registry
from samebits.models.llama import LlamaForCausalLM
from samebits.ops.backend import get_backend
from samebits.text.tokenizer import Tokenizer

ENGINE_VERSION = "0.1.0"


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    model_dir: Path
    max_model_len: int
    fingerprint: str  # weights digest + dtype + engine version + kernel config
    weights_digest: str = ""  # what ``fingerprint`` was derived from (numerics_fingerprint)


def resolve_model_dir(spec: str | None) -> Path:
    """The HF-format directory for a model spec; GGUF files are converted once into the cache."""
    if spec is None:
        from samebits.loader import gguf
        return gguf.convert_gguf(gguf.default_model_path())
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from samebits.loader import gguf
        return gguf.convert_gguf(path)
    if path.is_file() and path.suffix == ".json":
        return path.parent
    if not path.exists() and hub.is_repo_id(spec):  # "org/name": the Hugging Face cache
        return hub.resolve(spec)
    hf.check_model_dir(path)
    if path.is_file():
        raise ModelFormatError(f"{path}: expected a model directory or a .gguf file")
    return path


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The device of tensor-parallel rank ``rank``: under CUDA tensor parallel ``cuda:K+rank``
    for a configured ``cuda:K`` (``cuda``: K = 0), else the configured device."""
    device = config.torch_device
    if device.type == "cuda" and config.tensor_parallel_size > 1:
        return torch.device("cuda", (device.index or 0) + rank)
    return device


def load(config: EngineConfig, group: TPGroup | None = None) -> LoadedModel:
    """This rank's model (``group``: its rank of ``config.tensor_parallel_size``; rank 0 of one
    by default)."""
    group = group or TPGroup(0, 1, rank_device(config, 0))
    model_dir = resolve_model_dir(config.model)
    config_file = model_dir / "config.json"
    if config.model and config.model.endswith(".json"):  # a config file of any name (dummy)
        config_file = Path(config.model).expanduser()
    raw_cfg = read_json(config_file)
    model_config = registry.model_config(raw_cfg, str(config_file))
    limit = model_config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} is over the model's limit of "
                         f"{limit} tokens (max_position_embeddings in {config_file})")
    max_len = config.max_model_len or limit
    device, dtype = group.device, config.torch_dtype
    ops = get_backend(device, config.batch_invariant)
    model = build_model(model_config, ops, max_len, device, dtype, group)
    if config.load_format == "dummy":
        dummy.init_dummy_weights(model, config.seed)
        digest = dummy.dummy_digest(raw_cfg, config.seed)
    else:
        files = hf.safetensors_files(model_dir)
        weights = tqdm(hf.iter_safetensors_slices(files), desc="loading weights",
                       unit="tensor", total=hf.count_tensors(files), leave=False,
                       disable=group.rank > 0)
        model.load_weights(weights)
        digest = hf.weights_digest(files)
    tokenizer = Tokenizer.from_dir(model_dir, model_config.eos_token_ids)
    return LoadedModel(model, model_config, tokenizer, model_dir, max_len,
                       numerics_fingerprint(config, model_config, ops, digest), digest)


def numerics_fingerprint(config: EngineConfig, model_config: ModelConfig, ops, digest: str
                         ) -> str:
    """A decoder's fingerprint from its weights digest: at load, and after an in-place update."""
    chains = ops.row_parallel_chains(model_config.num_key_value_heads,
                                     config.tensor_parallel_size)
    return fingerprint(digest, config.torch_dtype, config, ops.name, model_config, chains)


def build_model(model_config: ModelConfig, ops, max_len: int, device: torch.device | str,
                dtype: torch.dtype, group: TPGroup | None = None) -> LlamaForCausalLM:
    """The registry's class for the architecture, this rank's parameters (``group``; the whole
    model by default) uninitialised on ``device``."""
    default_dtype = torch.get_default_dtype()
    try:  # parameters in the target dtype; the rope tables are built in explicit fp32
        torch.set_default_dtype(dtype)
        with torch.device(device):
            return registry.model_class(model_config.architecture)(model_config, ops, max_len,
                                                          group or TPGroup(0, 1, device))
    finally:
        torch.set_default_dtype(default_dtype)


def fingerprint(digest: str, dtype: torch.dtype, config: EngineConfig, backend: str,
                model_config: ModelConfig | None = None, chains: int = 1) -> str:
    """``fp_`` + 16 hex: everything that decides the bits of a token's KV and logits. A backend's
    own constants (the CPU tile and kernel arithmetic, the Triton block sizes) arrive in its name;
    a decoder's (``model_config``) row-parallel K chains (``OpBackend.row_parallel_chains``) in
    ``k-chains``; the standard mode's tensor-parallel size, which changes its bits, in ``tp``."""
    parts = [digest, str(dtype), ENGINE_VERSION, backend, f"split={config.attention_split_size}",
             f"invariant={config.batch_invariant}"]
    if model_config is not None:
        parts.append(f"k-chains={chains}")
        if not config.batch_invariant:
            parts.append(f"tp={config.tensor_parallel_size}")
    return "fp_" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def updated_digest(digest: str, items: list[tuple[str, torch.Tensor]]) -> str:
    """The weights digest after an in-place update: the old digest chained with every updated
    (name, tensor bytes), in name order."""
    h = hashlib.sha256(digest.encode())
    for name, tensor in sorted(items, key=lambda it: it[0]):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
