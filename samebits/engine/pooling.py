"""A pooling request as the engine sees it: a ``Sequence`` that is prefilled and never samples,
finished when its whole prompt is computed, its output the pooled vector."""

from __future__ import annotations

from dataclasses import dataclass

from samebits.engine.sequence import Sequence
from samebits.loader import LoadedModel
from samebits.pooling_params import PoolingParams
from samebits.text.embedding_inputs import EmbeddingInputs


@dataclass(frozen=True)
class PoolingOutput:
    """A finished pooling request's result."""

    embedding: list[float]


@dataclass
class PoolingSequence(Sequence):
    """``score_only`` (nothing is sampled; the engine finishes it once every prompt token is
    computed) without prompt logprobs, and outside the prefix cache. The runner sets
    ``embedding`` in the step that computes its pooled token."""

    embedding: list[float] | None = None  # the pooled vector (exact fp32 values)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return False


def pooling_sequence(request_id: str, prompt_token_ids: list[int], params: PoolingParams,
                     vocab_size: int, max_len: int) -> PoolingSequence:
    """A checked pooling request: a non-empty prompt of token ids in the vocabulary, at most
    ``max_len`` of them (the model's limit, or what one step holds where a prompt cannot be
    chunked); ``ValueError`` naming the problem otherwise."""
    if not isinstance(params, PoolingParams):
        raise ValueError(f"an embedding model takes pooling requests (PoolingParams), not "
                         f"{type(params).__name__}")
    ids = list(prompt_token_ids)
    if not ids:
        raise ValueError("prompt is empty: at least one token is needed")
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    if len(ids) > max_len:
        raise ValueError(f"prompt has {len(ids)} tokens, over the limit of {max_len} tokens")
    return PoolingSequence(request_id, ids, params, seed=0, score_only=True,
                           bypass_prefix_cache=True)


def embedding_inputs(loaded: LoadedModel) -> EmbeddingInputs:
    """The front end of an embedding model's requests: its tokenizer, vocabulary and length
    limit."""
    return EmbeddingInputs.from_model_dir(loaded.model_dir, loaded.model_config.vocab_size,
                                          loaded.max_model_len)
