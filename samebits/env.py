"""Every environment variable samebits reads, typed, in one place.

Read them through the functions below (never ``os.environ`` elsewhere), so a reader can see the
whole surface at a glance. Values are read at call time: set them before constructing an ``LLM``.
"""

from __future__ import annotations

import os
from pathlib import Path


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r}: expected 0 or 1")


def batch_invariant() -> bool:
    """SAMEBITS_BATCH_INVARIANT=0|1 (default 1): the default of ``EngineConfig.batch_invariant``."""
    return _bool("SAMEBITS_BATCH_INVARIANT", True)


def cache_dir() -> Path:
    """SAMEBITS_CACHE_DIR: where converted models (GGUF -> HF format) are kept.

    Default: ``$XDG_CACHE_HOME/samebits`` or ``~/.cache/samebits``.
    """
    raw = os.environ.get("SAMEBITS_CACHE_DIR")
    if raw:
        return Path(raw).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "samebits"


def api_keys() -> list[str] | None:
    """SAMEBITS_API_KEY: the bearer token(s) the server requires when ``--api-key`` is not given;
    several are separated by commas. None when unset; set but empty gives ``[""]``, which the
    server refuses at startup (an empty key must never mean "no authentication")."""
    raw = os.environ.get("SAMEBITS_API_KEY")
    return None if raw is None else [k.strip() for k in raw.split(",")]


def faulthandler_seconds() -> float | None:
    """SAMEBITS_FAULTHANDLER_S: every tensor-parallel rank process (ranks 1..N-1) writes every
    thread's stack to its stderr each that many seconds (``faulthandler``), to see where a
    rank waits. None (off) when unset or empty."""
    raw = os.environ.get("SAMEBITS_FAULTHANDLER_S")
    if raw is None or raw == "":
        return None
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"SAMEBITS_FAULTHANDLER_S={raw!r}: expected seconds") from None
    if not seconds > 0:
        raise ValueError(f"SAMEBITS_FAULTHANDLER_S={raw!r}: expected seconds > 0")
    return seconds


def tp_trace_dir() -> Path | None:
    """SAMEBITS_TP_TRACE: a directory where every tensor-parallel rank writes the collectives it
    issues, in order, one JSON line each (``rank-R.jsonl``), to find where ranks diverge. None
    (off) when unset or empty."""
    raw = os.environ.get("SAMEBITS_TP_TRACE")
    return Path(raw).expanduser() if raw else None


def tp_push() -> int | None:
    """SAMEBITS_TP_PUSH=0|1|2, None where unset or empty (the caller's default): CUDA ranks
    exchange their row-parallel layers' fp32 sums by writing them into each other's
    symmetric-memory buffer and meeting at a device-side barrier
    (``samebits.distributed.symmetric``) instead of NCCL's gather: the same values in the same
    slots, so the same bits. 1: the GEMM writes this rank's slot, a copy sends it to the peers;
    2: with two ranks the GEMM's kernel stores each tile into the peer's slot too (no copy; more
    ranks copy as 1). ``true``/``false`` read as 1/0. Read by every rank when it connects."""
    raw = os.environ.get("SAMEBITS_TP_PUSH", "").strip()
    if not raw:
        return None
    if raw == "2":
        return 2
    try:
        return int(_bool("SAMEBITS_TP_PUSH", False))
    except ValueError:
        raise ValueError(f"SAMEBITS_TP_PUSH={raw!r}: expected 0, 1 or 2") from None


def keep_torch_multicast_off() -> None:
    """The one variable samebits sets, for torch, before allocating symmetric memory:
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 unless already set. samebits never uses NVLink multicast
    (its pushes are plain stores or copies into the peer's buffer, its barrier its own kernel),
    so the rendezvous need not create a multicast object."""
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
