"""The OpenAI wire format: request and response bodies as pydantic models.

Requests are parsed strictly (``"16"`` is not an integer) and an unknown field is a 400 naming it
(never silently ignored: it might have changed the answer). This module checks the wire format
(types, shapes, which fields go together); the ranges of sampling values are checked once, by
``SamplingParams`` (``to_sampling_params`` maps a request onto it, vLLM's field names), whose
``ValueError`` names the field. Fields with no effect on the output (``user``, ``metadata``,
``store``, ``service_tier``, ``parallel_tool_calls``) are accepted. vLLM's request extensions are
honoured: ``return_token_ids``, ``allowed_token_ids``, ``bad_words``, ``include_stop_str_in_output``,
``skip_special_tokens``, ``spaces_between_special_tokens``, ``truncate_prompt_tokens``,
``stream_options.continuous_usage_stats``, and on chat ``echo``, ``add_generation_prompt``,
``continue_final_message``, ``prompt_logprobs``. samebits adds ``seed`` to each choice and to the
response: the seed a choice was sampled with, drawn by the engine when the request gave none, so
any answer can be replayed.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from samebits.sampling_params import SamplingParams
from samebits.structured_outputs import StructuredOutputsParams

MAX_N = 64  # choices per prompt; each choice is one engine request
MAX_CHOICES = 256  # choices per request, over all prompts of a completion request
MAX_TOP_LOGPROBS = 20
MAX_EMBEDDING_INPUTS = 2048  # inputs per embedding request, as OpenAI


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False  # a last chunk with the request's usage
    continuous_usage_stats: bool = False  # vLLM: every chunk carries its choice's usage so far
    include_obfuscation: bool | None = None  # no effect: samebits adds no obfuscation padding


# ---- structured output and tools (the logic: server/structured.py, server/tools.py) -----------
class _Strict(_Request):
    """A constraint's fields: one samebits does not know would change the output, so it is a 400."""

    model_config = ConfigDict(strict=True, extra="forbid")


class JsonSchemaSpec(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDef(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Request):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's shape)


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class SamplingFields(_Request):
    """Fields both endpoints share. ``None`` means the default."""

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
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens (-1: the context)

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[int, float] | None:
        if value is None:
            return None
        for k in value:
            if not (k.isascii() and k.isdigit()):
                raise ValueError(f"key {k!r} is not a token id (a non-negative integer, as a "
                                 "string)")
        return {int(k): v for k, v in value.items()}

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

    def to_sampling_params(self, max_tokens: int, logprobs: int | None,
                           structured: StructuredOutputsParams | None = None, **extra: Any
                           ) -> SamplingParams:
        """The request's ``SamplingParams`` (choice 0's seed; ``extra``: fields an endpoint sets
        itself, such as ``prompt_logprobs``). Raises ``ValueError`` naming a bad field."""
        if self.stream and self.num_candidates() > self.n:
            raise ValueError("best_of > n cannot be streamed (the best are known only at the "
                             "end): set stream=false or best_of=n")
        given = {name: getattr(self, name) for name in _SAMPLING_FIELDS
                 if getattr(self, name) is not None}
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                              structured_outputs=structured, **given, **extra)


_SAMPLING_FIELDS = (  # request fields that are SamplingParams fields of the same name
    "n", "best_of", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "ignore_eos", "min_tokens", "logit_bias", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "allowed_token_ids", "bad_words", "include_stop_str_in_output",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens")


class CompletionRequest(SamplingFields):
    """``echo`` puts the prompt (and, with ``logprobs``, its logprobs: the first one null) before
    the generated text (streamed: in each choice's first chunk); ``max_tokens: 0`` generates
    nothing (scoring). ``prompt_logprobs`` (vLLM) returns each prompt token's logprob, rank and
    top-k in vLLM's per-choice shape."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None  # extension (as vLLM)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    """A message; ``function`` (a result) and an assistant's ``function_call`` are the legacy
    forms of ``tool`` and ``tool_calls``."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls (then content may be null)
    tool_call_id: str | None = None  # a tool message: the call it answers
    function_call: FunctionCall | None = None  # legacy: an assistant's one call
    # what the openai SDK's message.model_dump() adds to an assistant message sent back: accepted
    # only empty, since they would change nothing
    refusal: None = None
    annotations: list[Any] | None = None
    audio: None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        for part in value if isinstance(value, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"a content part of type {kind!r}: this model takes text only "
                                 "(send parts of type 'text')")
        return value

    @model_validator(mode="after")
    def _has_content(self):
        calls = self.tool_calls or self.function_call
        if self.content is None and not (self.role == "assistant" and calls):
            raise ValueError("each message needs a content (a string or a list of text parts); "
                             "only an assistant message with tool_calls may have none")
        return self

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content or ())


class ChatCompletionRequest(SamplingFields):
    """vLLM's chat extensions: ``echo`` starts the reply with the last message's content when
    that message has the reply's role; ``add_generation_prompt: false`` with
    ``continue_final_message: true`` continues the last message instead of starting a new one;
    ``prompt_logprobs`` as on completions. ``functions`` / ``function_call`` (legacy) are
    ``tools`` / ``tool_choice``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: list[FunctionDef] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None  # accepted; several calls are always allowed
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    prompt_logprobs: int | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return value

    @field_validator("functions", "function_call")
    @classmethod
    def _legacy_or_tools(cls, value: Any, info: ValidationInfo) -> Any:
        modern = {"functions": "tools", "function_call": "tool_choice"}[info.field_name]
        if value is not None and info.data.get(modern) is not None:
            raise ValueError(f"give {modern} or {info.field_name} (its legacy form), not both")
        return value

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_generation_prompt(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt"):
            raise ValueError("continue_final_message needs add_generation_prompt=false (a reply "
                             "either continues the last message or starts a new one)")
        return value

    def tool_list(self) -> list[Tool]:
        """``tools``, or the legacy ``functions`` as tools."""
        if self.functions is not None:
            return [Tool(type="function", function=f) for f in self.functions]
        return list(self.tools or ())

    def tool_choice_value(self) -> str | NamedToolChoice | None:
        """``tool_choice``, or the legacy ``function_call`` as one."""
        fc = self.function_call
        if isinstance(fc, NamedFunction):
            return NamedToolChoice(type="function", function=fc)
        return fc if fc is not None else self.tool_choice


class EmbeddingRequest(_Request):
    """``POST /v1/embeddings``. An input over the model's token limit (sentence-transformers'
    max_seq_length) is a 400 unless the request asks for truncation, as sentence-transformers
    truncates: ``truncate: true`` (samebits) or vLLM's ``truncate_prompt_tokens`` (-1: the model's
    limit; k: k tokens). ``dimensions`` is accepted only as the model's own."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = None  # None: "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=-1)

    @field_validator("input", mode="wrap")
    @classmethod
    def _input_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:  # pydantic would report each union member's failure
            raise ValueError("must be a string, a list of strings, a list of token ids "
                             "(integers) or a list of token-id lists") from None


# ---- responses ------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens read from the prefix cache (never changes the bits)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    """With ``echo``, the prompt's first token has no logprob: null in token_logprobs and
    top_logprobs (as vLLM)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob: rank is 1-based in the raw distribution (tokens with logprob >= this)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def _omitted_when_none():
    """A field left out of the JSON when None (extensions the request did not ask for)."""
    return Field(None, exclude_if=lambda v: v is None)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    seed: int
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    # vLLM's return_token_ids (a stream: prompt_token_ids on each choice's first chunk)
    prompt_token_ids: list[int] | None = _omitted_when_none()
    token_ids: list[int] | None = _omitted_when_none()


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str
    seed: int  # the request's seed; choice i used seed + i (per prompt)
    # streams only, on the last chunk: samebits.server.output_hash of all choices (the
    # X-Samebits-Output-Hash header of a non-streamed response); absent elsewhere
    output_hash: str | None = Field(None, exclude_if=lambda v: v is None)


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = _omitted_when_none()  # a legacy functions request's


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    seed: int
    token_ids: list[int] | None = _omitted_when_none()  # vLLM's return_token_ids


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = _omitted_when_none()
    prompt_token_ids: list[int] | None = _omitted_when_none()  # vLLM's return_token_ids


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    function_call: DeltaFunctionCall | None = _omitted_when_none()  # legacy functions request


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    seed: int
    token_ids: list[int] | None = _omitted_when_none()  # vLLM's return_token_ids


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = _omitted_when_none()  # return_token_ids: first chunk


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 bytes


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
    system_fingerprint: str


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
