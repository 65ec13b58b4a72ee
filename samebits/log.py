"""samebits' loggers: children of ``samebits``. When the application has configured no logging
(the root logger has no handler), the ``samebits`` logger gets one stderr handler at INFO, so
one-time notices (the CPU kernels' first build and its time, CUDA-graph capture) are seen, as
vLLM's are; an application that configures logging decides for itself."""

from __future__ import annotations

import logging
import sys

_ROOT = "samebits"


def get_logger(name: str) -> logging.Logger:
    """The logger ``samebits.<name>``, with the default handler installed on first use."""
    root = logging.getLogger(_ROOT)
    if not root.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("samebits: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
    return logging.getLogger(f"{_ROOT}.{name}")
