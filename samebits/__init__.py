"""samebits: reproducible LLM inference -- the same request returns the same bits at any batch size.

The public names load on first use (``samebits.LLM`` imports the engine), so ``import samebits``
and light submodules (``samebits.env``, ``samebits.config``) stay cheap.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "EmbeddingRequestOutput", "GuidedDecodingParams", "Logprob",
           "PoolingRequestOutput", "RequestOutput", "SamplingParams", "StructuredOutputsParams",
           "batch_invariant"]

_LAZY = {
    "LLM": "samebits.llm",
    "CompletionOutput": "samebits.outputs",
    "EmbeddingRequestOutput": "samebits.outputs",
    "Logprob": "samebits.outputs",
    "PoolingRequestOutput": "samebits.outputs",
    "RequestOutput": "samebits.outputs",
    "SamplingParams": "samebits.sampling_params",
    "GuidedDecodingParams": "samebits.sampling_params",
    "StructuredOutputsParams": "samebits.structured_outputs",
    "batch_invariant": "samebits.models.hf_route",
}

if TYPE_CHECKING:
    from samebits.llm import LLM
    from samebits.models.hf_route import batch_invariant
    from samebits.outputs import (
        CompletionOutput,
        EmbeddingRequestOutput,
        Logprob,
        PoolingRequestOutput,
        RequestOutput,
    )
    from samebits.sampling_params import GuidedDecodingParams, SamplingParams
    from samebits.structured_outputs import StructuredOutputsParams


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'samebits' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
