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
