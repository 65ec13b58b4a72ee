"""The OpenAI wire format: what every endpoint shares, as pydantic models. The endpoints' own
bodies live beside it, one module per noun: ``protocol_completion`` (``/v1/completions``),
``protocol_chat`` (``/v1/chat/completions``), ``protocol_tools`` (tools and tool calls),
``protocol_embedding`` (``/v1/embeddings``); the Responses API's in ``responses_protocol``.

Requests are parsed strictly (``"16"`` is not an integer) and an unknown field is a 400 naming it
(never silently ignored: it might have changed the answer). These modules check the wire format
(types, shapes, which fields go together, the server's own size caps); the ranges of sampling
values are checked once, by ``SamplingParams`` (``SamplingFields.to_sampling_params`` maps a request
onto it, vLLM's field names; the server turns its ``ValueError`` into a 400 naming the field).
Fields with no effect on the output (``user``, ``metadata``, ``store``, ``service_tier``,
``parallel_tool_calls``) are accepted. vLLM's request extensions are honoured:
``return_token_ids``, ``return_tokens_as_token_ids``, ``allowed_token_ids``, ``bad_words``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``spaces_between_special_tokens``,
``truncate_prompt_tokens``, ``stream_options.continuous_usage_stats`` (with ``include_usage``),
and on chat ``echo``, ``add_generation_prompt``, ``continue_final_message``,
``prompt_logprobs``. samebits adds ``seed`` to each choice and to the
response: the seed a choice was sampled with, drawn by the engine when the request gave none, so
any answer can be replayed.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from samebits.sampling_params import SamplingParams
from samebits.structured_outputs import StructuredOutputsParams

MAX_N = 64  # choices per prompt; each choice is one engine request
MAX_CHOICES = 256  # choices per request, over all prompts of a completion request
MAX_TOP_LOGPROBS = 20
MAX_EMBEDDING_INPUTS = 2048  # inputs per embedding request, as OpenAI


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Request):
    include_usage: bool | None = False  # a last chunk with the request's usage (None: no)
    # vLLM: with include_usage, every chunk carries its choice's usage so far
    continuous_usage_stats: bool | None = False
    include_obfuscation: bool | None = None  # no effect: samebits adds no obfuscation padding


# ---- structured output (the logic: server/structured.py) --------------------------------------
class JsonSchemaSpec(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(_Request):
    """Fields both endpoints share. ``None`` means the default. ``n`` and ``best_of`` are capped
    at ``MAX_N`` (the server's limit on work per request); their ranges are SamplingParams'."""

    model: str | None = None
    n: int = Field(1, le=MAX_N)
    best_of: int | None = Field(None, le=MAX_N)  # >= n; > n only without streaming
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (as vLLM): 0 or -1 is off
    min_p: float | None = None  # extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension
    min_tokens: int = 0  # extension
    logit_bias: dict[str, float] | None = None  # token id (a string in JSON) -> [-100, 100]
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (as vLLM)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # accepted, no effect on the output:
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # honoured:
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM; guided_*: older aliases
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: prefix cache shared per salt
    # vLLM's extensions (SamplingParams fields of the same names, but return_token_ids):
    return_token_ids: bool = False  # prompt_token_ids and each choice's token_ids
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens (-1: the context)

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[int, float] | None:
        return token_id_keys(value)

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo
                                    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return value

    def num_candidates(self) -> int:
        """Engine requests per prompt: best_of when given, else n."""
        return self.n if self.best_of is None else self.best_of

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                           structured: StructuredOutputsParams | None = None, **extra: Any
                           ) -> SamplingParams:
        """The request's ``SamplingParams`` (choice 0's seed; ``extra``: fields an endpoint sets
        itself, such as ``prompt_logprobs``). Raises ``ValueError`` naming a bad field first
        (SamplingParams' names; ``max_tokens`` is whichever field an endpoint maps onto it)."""
        if self.stream and self.num_candidates() > self.n:
            raise ValueError("best_of > n cannot be streamed (the best are known only at the "
                             "end): set stream=false or best_of=n")
        given = {name: getattr(self, name) for name in _SAMPLING_FIELDS
                 if getattr(self, name) is not None}
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                              structured_outputs=structured, **given, **extra)


def token_id_keys(value: dict[str, float] | None) -> dict[int, float] | None:
    """``logit_bias`` with its JSON string keys as token ids; keys that are not are all named."""
    if value is None:
        return None
    bad = [k for k in value if not (k.isascii() and k.isdigit())]
    if bad:
        keys = ", ".join(repr(k) for k in bad[:10]) + (f" (and {len(bad) - 10} more)"
                                                      if len(bad) > 10 else "")
        raise ValueError(f"key{'s' if len(bad) > 1 else ''} {keys} "
                         f"{'are not token ids' if len(bad) > 1 else 'is not a token id'} "
                         "(a non-negative integer, as a string)")
    return {int(k): v for k, v in value.items()}


_SAMPLING_FIELDS = (  # request fields that are SamplingParams fields of the same name
    "n", "best_of", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "ignore_eos", "min_tokens", "logit_bias", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "allowed_token_ids", "bad_words", "include_stop_str_in_output",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens")


# ---- responses ------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens read from the prefix cache (never changes the bits)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # with --enable-prompt-tokens-details (vLLM's flag), else null as vLLM's
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(BaseModel):
    """vLLM's Logprob: rank is 1-based in the raw distribution (tokens with logprob >= this)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: null, then {"<token id>": PromptLogprob} per prompt token
VllmPromptLogprobs = list[dict[str, PromptLogprob] | None]


def omitted_when_none():
    """A field left out of the JSON when None (extensions the request did not ask for)."""
    return Field(None, exclude_if=lambda v: v is None)


class BaseResponse(BaseModel):
    """What every completion response and chunk carries."""

    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str
    seed: int  # the request's seed; choice i used seed + i (per prompt)
    # streams only, on the last chunk: samebits.server.output_hash of all choices (the
    # X-Samebits-Output-Hash header of a non-streamed response); absent elsewhere
    output_hash: str | None = Field(None, exclude_if=lambda v: v is None)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "samebits"
    root: str  # what the model was loaded from (the path or id given to serve), as vLLM
    parent: str | None = None
    max_model_len: int
    system_fingerprint: str
    task: Literal["generate", "embed"] = "generate"  # extension: which endpoints serve it


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
