"""What a pooling (embedding) request asks of ``LLMEngine.add_request``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    """A pooling request: its prompt is prefilled, nothing is generated, and its output is the
    pooled vector of the prompt's final hidden states (``PoolingSequence.embedding``). How a model
    pools (mean, CLS or last token; L2-normalised or not) is the model's own
    (``samebits.models.pooler``), so a request has nothing to choose; truncation happens when
    the input is tokenized (``samebits.text.embedding_inputs``)."""
