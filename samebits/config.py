"""Configuration: the model's shape (from config.json) and the engine's knobs, as frozen dataclasses.

Both are checked in ``__post_init__`` so a bad value fails at construction with a message that names
the field. ``EngineConfig.batch_invariant`` is the one switch between the invariant and the standard
numerics; it is passed down, never read from the environment below this module.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from samebits import env

# CPU default prefill chunk: keeps one chunk of the default model (with a few thousand tokens of
# context before it) near or under a second on 2 cores (benchmarks/RESULTS.md, prefill gap)
CPU_LONG_PREFILL_TOKENS = 128
CPU_KV_CACHE_BYTES = 1 << 30  # the KV cache of a CPU rank without kv_cache_memory_bytes
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelFormatError(ValueError):
    """A model file or directory that cannot be loaded; the message names the file and the problem."""


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape, read from an HF ``config.json``. Which architectures exist and their
    quirks (q/k norm, the defaults of the fields left None here) are the architecture table's
    (``samebits.models.registry``); a subclass adds the fields of its architecture
    (``_fields``)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = None
    # None where config.json does not say: the architecture's default (its registry entry)
    tie_word_embeddings: bool | None = None
    attention_bias: bool | None = None  # q/k/v projections carry a bias
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelFormatError(f"config.json: {name} must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelFormatError(
                f"config.json: num_attention_heads={self.num_attention_heads} is not a multiple "
                f"of num_key_value_heads={self.num_key_value_heads}")

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ModelFormatError(f"{source}: no 'architectures' entry")
        try:
            return cls(**cls._fields(cfg, archs[0]))
        except KeyError as e:
            raise ModelFormatError(f"{source}: missing field {e.args[0]!r}") from None

    @classmethod
    def _fields(cls, cfg: dict[str, Any], arch: str) -> dict[str, Any]:
        """The constructor's arguments from config.json (a subclass adds its own)."""
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                              else None)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return dict(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope_scaling=dict(scaling) if scaling else None,
            tie_word_embeddings=_flag(cfg.get("tie_word_embeddings")),
            attention_bias=_flag(cfg.get("attention_bias")),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        return cls.from_dict(read_json(path), str(path))


def _flag(value: Any) -> bool | None:
    return None if value is None else bool(value)


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON file, turning every failure into a one-line ``ModelFormatError``."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ModelFormatError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return data


def _positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything that decides how the engine runs, and therefore (with the weights) its bits."""

    model: str | None = None  # None: the embedded default for ``task``
    task: str = "generate"  # "generate" | "embed"
    load_format: str = "auto"  # "auto" | "dummy"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    batch_invariant: bool = field(default_factory=env.batch_invariant)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_bytes
    # KV cache bytes per rank; None: sized from gpu_memory_utilization (engine.runner)
    kv_cache_memory_bytes: int | None = None
    # vLLM's meaning, per rank: the share of the device's total memory this engine may use --
    # weights, activations, CUDA graphs and the KV cache, which gets what the others leave.
    # On CPU there is no device to fill: it caps the KV cache (CPU_KV_CACHE_BYTES per rank) at
    # this share of the host memory available when the engine starts
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # KV tokens per attention split (128 measured better on Hopper than 256: decode at batch 1 /
    # 512 tokens 1.41x SDPA at 256, 1.06x at 128 -- benchmarks/RESULTS.md)
    attention_split_size: int = 128
    enforce_eager: bool = False  # CUDA: no CUDA graphs at all (they never change the bits)
    # CUDA: prefill and mixed steps of up to this many tokens (and at most
    # max_num_batched_tokens) replay piecewise CUDA graphs -- every op but attention
    # (engine.piecewise_graph); 0: they run eagerly. Never changes the invariant mode's bits
    max_piecewise_tokens: int = 2048
    # CUDA graphs: a decode step's successor is launched before the step's tokens reach the host
    # (its input ids read on the device), and used when the next step is that very batch; the
    # host's bookkeeping between steps then overlaps the device's work (it never changes the bits)
    async_scheduling: bool = True
    # prompt tokens one sequence may prefill per step (vLLM's name), so a running stream waits at
    # most one such chunk; None: CPU_LONG_PREFILL_TOKENS on CPU, no cap (the step budget) on CUDA
    long_prefill_token_threshold: int | None = None
    seed: int = 0  # seeds dummy weights; per-request seeds are drawn from it when none is given
    # ranks the model is sharded over (samebits.models.parallel; ranks 1.. are spawned
    # processes, samebits.engine.executor); 1: one device. The invariant arithmetic runs the
    # row-parallel linears as the backend's K chains (``OpBackend.row_parallel_chains``), so
    # every N sharing them gives the same bits: on CPU every N dividing the KV heads, on CUDA
    # N = 1 and 2 (where 2 divides the KV heads); the standard mode promises nothing across N
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):  # a pathlib.Path is a path as a str is
            object.__setattr__(self, "model", os.fspath(self.model))
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model must be a path or a name (str), got {self.model!r}")
        if self.task not in ("generate", "embed"):
            raise ValueError(f"task must be 'generate' or 'embed', got {self.task!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                     "attention_split_size"):
            _positive(name, getattr(self, name))
        _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes, allow_none=True)
        _positive("num_kv_blocks", self.num_kv_blocks, allow_none=True)
        _positive("max_model_len", self.max_model_len, allow_none=True)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if isinstance(self.max_piecewise_tokens, bool) or not isinstance(
                self.max_piecewise_tokens, int) or self.max_piecewise_tokens < 0:
            raise ValueError(f"max_piecewise_tokens must be an int >= 0, got "
                             f"{self.max_piecewise_tokens!r}")
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, int | float) or not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}")
        _positive("long_prefill_token_threshold", self.long_prefill_token_threshold,
                  allow_none=True)
        if self.attention_split_size % 16:
            raise ValueError(f"attention_split_size must be a multiple of 16, got "
                             f"{self.attention_split_size}")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def prefill_chunk_tokens(self) -> int:
        """The per-sequence prefill cap in force (``long_prefill_token_threshold`` resolved)."""
        if self.long_prefill_token_threshold is not None:
            return self.long_prefill_token_threshold
        if self.torch_device.type == "cpu":
            return CPU_LONG_PREFILL_TOKENS
        return self.max_num_batched_tokens

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if self.torch_device.type == "cpu" else torch.bfloat16
        return DTYPES[self.dtype]

    # ---- the command line: one declaration of the engine options, one builder ----------------
    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        """The engine options every command that builds an engine takes (generate, verify,
        serve, bench); ``from_cli_args`` turns them into an ``EngineConfig``."""
        p.add_argument("--model", default=None, help="HF directory, Hugging Face id (org/name: "
                       "from the HF cache, downloaded when missing), .gguf file, or config.json "
                       "(with --load-format dummy); None: the embedded SmolLM2-135M-Instruct "
                       "(all-MiniLM-L6-v2 with --task embed)")
        p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                       help="dummy: random weights of the model's real shapes")
        p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                       help="auto: CUDA when available, else CPU")
        p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                       help="auto: float32 on CPU, bfloat16 on CUDA")
        p.add_argument("--standard", action="store_true",
                       help="stock PyTorch ops instead of the batch-invariant ones (the baseline; "
                       "SAMEBITS_BATCH_INVARIANT=0 does the same)")
        p.add_argument("--max-num-seqs", type=int, default=64,
                       help="most requests in one engine step")
        p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                       help="most tokens in one engine step (longer prompts are chunked)")
        p.add_argument("--max-model-len", type=int, default=None,
                       help="context length; None: the model's own limit")
        p.add_argument("--num-kv-blocks", type=int, default=None,
                       help="KV cache blocks; None: sized from --gpu-memory-utilization")
        p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="FRACTION",
                       help="share of each GPU's total memory the engine may use (weights, "
                       "activations, CUDA graphs, KV cache: the cache gets the rest), per rank; "
                       "on CPU the KV cache is 1 GiB per rank, at most this share of the free "
                       "host memory")
        p.add_argument("--no-prefix-caching", action="store_true",
                       help="never reuse cached KV blocks of a shared prefix")
        p.add_argument("--long-prefill-token-threshold", type=int, default=None, metavar="TOKENS",
                       help="prompt tokens prefilled per step (all sequences together), so running "
                       "streams wait at most one such chunk; None: 128 on CPU, no cap on CUDA")
        p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                       help="shard the model over N processes (gloo on CPU, NCCL on GPU); every N "
                       "dividing the KV heads gives the bits of N = 1 (one device)")
        p.add_argument("--enforce-eager", action="store_true",
                       help="CUDA: run every step eagerly instead of replaying CUDA graphs")
        p.add_argument("--max-piecewise-tokens", type=int, default=2048, metavar="TOKENS",
                       help="CUDA: prefill and mixed steps of up to this many tokens replay "
                       "CUDA graphs of every op but attention; 0: eager (never changes the bits)")
        p.add_argument("--no-async-scheduling", action="store_true",
                       help="CUDA graphs: wait for a decode step's tokens before launching the "
                            "next step")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineConfig:
        """The config the options of ``add_cli_args`` describe; ``overrides`` win (a command's
        own choices: ``task``, ``seed``, ``batch_invariant`` for a benchmark's two modes...)."""
        kwargs: dict[str, Any] = dict(
            model=args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=not args.no_prefix_caching, enforce_eager=args.enforce_eager,
            max_piecewise_tokens=args.max_piecewise_tokens,
            async_scheduling=not args.no_async_scheduling,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            tensor_parallel_size=args.tensor_parallel_size)
        if args.standard:
            kwargs["batch_invariant"] = False
        return cls(**{**kwargs, **overrides})
