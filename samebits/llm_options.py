"""vLLM's ``LLM(...)`` options that are not ``EngineConfig`` fields, each honoured or refused by
name: hub ids (``revision``, ``download_dir``), ``tokenizer``, ``quantization``,
``trust_remote_code``, and the options that tune vLLM's own machinery without touching the
output (``NO_EFFECT``: accepted, each said once in a log line with the reason)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from samebits.config import EngineConfig
from samebits.log import get_logger

QUANTIZATIONS = (None, "gguf")  # gguf: a .gguf file, dequantized once to ``dtype``
log = get_logger("llm")
_said_no_remote_code = False
NO_EFFECT = {  # vLLM's LLM() options RL frameworks pass that change no output: why not here
    "disable_log_stats": "samebits logs no engine statistics offline",
    "swap_space": "samebits never swaps KV blocks to host memory (a preempted request is "
                  "recomputed, to the same bits)",
    "enable_chunked_prefill": "samebits always chunks long prompts (max_num_batched_tokens), "
                              "and in the invariant mode chunk boundaries never change the bits",
    "disable_custom_all_reduce": "samebits' tensor-parallel sums are its own fixed-order ones",
    "enable_expert_parallel": "under tensor parallel samebits always splits a mixture's experts "
                              "by expert (each rank holds E/N whole experts), with one device's "
                              "bits either way",
}
_said_no_effect: set[str] = set()


def check_options(model: str | None, quantization: str | None, trust_remote_code: bool,
                  kwargs: dict[str, Any]) -> None:
    """vLLM's options samebits takes, each honoured or refused by name."""
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    unknown = sorted(set(kwargs) - names - set(NO_EFFECT))
    if unknown:
        raise TypeError(f"LLM() got unsupported option(s) {unknown}: samebits does not take them "
                        f"(and never ignores an option); it takes {sorted(names)} and tokenizer, "
                        "revision, download_dir, quantization, trust_remote_code, "
                        f"enable_sleep_mode (and, with no effect, {sorted(NO_EFFECT)})")
    gguf = model is None or str(model).endswith(".gguf")
    if quantization not in QUANTIZATIONS or (quantization == "gguf" and not gguf):
        raise ValueError(f"quantization={quantization!r} is not supported: samebits runs "
                         "weights as stored in float32, bfloat16 or float16 (dtype=); supported "
                         "are None and 'gguf' (a .gguf file, dequantized once at load)")
    global _said_no_remote_code
    if trust_remote_code and not _said_no_remote_code:
        _said_no_remote_code = True
        log.info("trust_remote_code=True is accepted and changes nothing: samebits never runs "
                 "code from a checkpoint; it loads only the architectures it implements")


def engine_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without the ``NO_EFFECT`` options, each logged once (with its reason)."""
    for name in sorted(set(kwargs) & set(NO_EFFECT) - _said_no_effect):
        _said_no_effect.add(name)
        log.info("%s is accepted and changes nothing: %s", name, NO_EFFECT[name])
    return {k: v for k, v in kwargs.items() if k not in NO_EFFECT}


def check_chunked_prefill(kwargs: dict[str, Any], config: EngineConfig) -> None:
    """``enable_chunked_prefill=False`` is refused in the standard mode, where a prompt's
    chunking can change its bits and samebits (which always chunks) would not honour it."""
    if kwargs.get("enable_chunked_prefill", True) is False and not config.batch_invariant:
        raise ValueError("enable_chunked_prefill=False is not supported with "
                         "batch_invariant=False: samebits chunks every prompt longer than "
                         "max_num_batched_tokens, and in the standard mode the chunking can "
                         "change the bits; leave it unset, or use the invariant mode (where "
                         "chunking never changes them)")


def local_model(model: str | None, revision: str | None, download_dir: str | None
                 ) -> str | None:
    """A hub id (``org/name``) becomes its snapshot directory in the HF cache."""
    from samebits.loader import hub
    if model is None or Path(model).expanduser().exists() or not hub.is_repo_id(model):
        return model
    return str(hub.resolve(model, revision, download_dir))


def loaded_with_tokenizer(config: EngineConfig, tokenizer: str | None, revision: str | None,
                    download_dir: str | None):
    """The loaded model, with ``tokenizer``'s tokenizer in place of its own (None: its own)."""
    if tokenizer is None:
        return None
    from samebits.loader import load
    from samebits.text.tokenizer import Tokenizer
    path = Path(local_model(tokenizer, revision, download_dir)).expanduser()
    loaded = load(config)
    tok = Tokenizer.from_dir(path.parent if path.is_file() else path,
                             loaded.model_config.eos_token_ids)
    if tok is None:
        raise ValueError(f"tokenizer={tokenizer!r}: no tokenizer.json in {path}")
    loaded.tokenizer = tok
    return loaded

