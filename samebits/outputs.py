"""What ``LLM`` returns, in vLLM's shapes (``vllm.outputs``): ``RequestOutput`` with its
``CompletionOutput`` choices, ``Logprob`` entries, ``RequestMetrics``, and the pooling outputs of
``LLM.embed`` / ``LLM.encode``. samebits adds the exact per-token logprobs (``token_logprobs``),
each choice's ``seed`` and the numerics' ``system_fingerprint``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Logprob:
    """vLLM's per-token entry: the logprob, its 1-based rank in the raw distribution (the number
    of tokens whose logprob is >= this one's), and the token's text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]  # per generated token: itself, then its position's top k
PromptLogprobs = list[dict[int, Logprob] | None]  # None first: the first token has no context


@dataclass
class CompletionOutput:
    """One generated sequence (one choice) of a request, vLLM's shape.

    ``logprobs`` is vLLM's: per generated token a dict {token id: Logprob}, the sampled token
    first, then the ``SamplingParams.logprobs`` most likely tokens (k + 1 entries, or k when the
    sampled token is among them); None when ``logprobs`` was not asked for. ``token_logprobs`` is
    samebits' exact list: the raw-distribution logprob of each generated token (fp32 values),
    always present, bitwise ``LLM.score``'s value for the same tokens."""

    index: int  # its position in RequestOutput.outputs
    text: str
    token_ids: list[int]
    cumulative_logprob: float  # the sum of ``token_logprobs`` (float64, in order)
    logprobs: SampleLogprobs | None
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: int | str | None  # the stop string or stop_token_id that ended it (else None)
    seed: int  # the seed it was sampled with: SamplingParams(seed=seed) replays it alone
    token_logprobs: list[float]  # raw-distribution logprob of each token, exact fp32 values
    top_logprobs: list[dict[int, float]]  # per token, the SamplingParams.logprobs most likely

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When a request arrived, was first scheduled, got its first and last token, and finished
    (``time.time()`` seconds, vLLM's ``RequestMetrics``); None until it happened."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    """One prompt's result, as ``LLM.generate`` returns it (vLLM's shape): ``outputs`` holds its
    n choices; ``metrics`` the timings of its first candidate."""

    request_id: str
    prompt: str | None  # the prompt text; None when it was given as token ids
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None  # None unless SamplingParams.prompt_logprobs is set
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int  # prompt tokens its first sequence took from the prefix cache
    system_fingerprint: str
    metrics: RequestMetrics | None = None


@dataclass
class EmbeddingOutput:
    """vLLM's ``EmbeddingOutput``: one input's vector."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingOutput:
    """vLLM's ``PoolingOutput``: the pooled tensor (fp32, on the CPU)."""

    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """``LLM.encode``'s result per input (vLLM's shape)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    system_fingerprint: str = ""


@dataclass
class EmbeddingRequestOutput:
    """``LLM.embed``'s result per input (vLLM's shape): ``outputs.embedding`` is the vector,
    bitwise the same whatever else is embedded with it."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    system_fingerprint: str = ""
    metrics: RequestMetrics | None = field(default=None, repr=False)
