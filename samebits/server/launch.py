"""What ``samebits serve`` settles before the app exists: the port (free and in range, checked
before the model loads), the names the model is served under, the engine (with vLLM's
``--tokenizer``), and a one-line note for each vLLM flag that has no effect here."""

from __future__ import annotations

import argparse
import errno
import socket

from samebits.config import EngineConfig
from samebits.engine.engine import LLMEngine
from samebits.server.engine_process import EngineProcess, engine_with_tokenizer

# vLLM flags samebits accepts with no effect, and why (each is logged once at start)
NO_EFFECT = {
    "trust_remote_code": "--trust-remote-code has no effect: samebits runs no model code from "
                         "checkpoints (its architectures are its own)",
    "disable_log_requests": "--disable-log-requests has no effect: samebits does not log "
                            "requests",
    "enable_auto_tool_choice": "--enable-auto-tool-choice has no effect: tool calls are always "
                               "parsed (tool_choice 'auto' is the default with tools)",
    "tool_call_parser": "--tool-call-parser has no effect: samebits always parses Hermes "
                        "<tool_call> blocks",
    "enable_tokenizer_info_endpoint": "--enable-tokenizer-info-endpoint has no effect: "
                                      "GET /tokenizer_info is always served",
    "enable_expert_parallel": "--enable-expert-parallel has no effect: under tensor parallel "
                              "samebits always splits a mixture's experts by expert (each rank "
                              "holds E/N whole experts), with one device's bits either way",
}


def check_port(host: str, port: int) -> None:
    """``ValueError`` naming the port when it is out of range or already in use."""
    if not 0 < port < 65536:
        raise ValueError(f"--port {port} is not a port number (1 to 65535)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
        try:
            s.bind((host, port))
        except OSError as e:
            why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e})"
            raise ValueError(f"port {port} on {host} {why}: pick another with --port") from None


def no_effect_notes(args: argparse.Namespace) -> list[str]:
    """The note of each no-effect vLLM flag that was given."""
    return [note for name, note in NO_EFFECT.items() if getattr(args, name, None)]


def served_names(args: argparse.Namespace, derived: str, default: str) -> tuple[str, ...]:
    """The names clients may send, the first one answered with when a request names none:
    every ``--served-model-name``, then the model as given to serve (path or id) and
    ``derived`` (its short name); ``default`` when serve was given neither."""
    names = list(args.served_model_name or ())
    if args.model is not None:
        names += [args.model, derived]
    return tuple(dict.fromkeys(names or [default]))


def load_engine(args: argparse.Namespace) -> LLMEngine | EngineProcess:
    """The generation engine: in a process of its own (samebits.server.engine_process), or with
    ``--no-engine-process`` in this one; with ``--tokenizer``, that tokenizer instead of the
    model's."""
    config = EngineConfig.from_cli_args(args, seed=args.seed)
    tokenizer = getattr(args, "tokenizer", None)
    if tokenizer is not None and config.tensor_parallel_size > 1:
        raise ValueError("--tokenizer cannot be combined with --tensor-parallel-size > 1")
    if getattr(args, "no_engine_process", False):
        return engine_with_tokenizer(config, tokenizer)
    return EngineProcess(config, args.log_level, tokenizer)
