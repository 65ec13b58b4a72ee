"""The OpenAI wire format: request and response bodies as pydantic models.

Requests are parsed strictly (``"16"`` is not an integer), an unknown field is a 400 naming it
(never silently ignored: it might have changed the answer), and every range the engine does not
check itself is checked here, so a bad request fails before it reaches the engine. Fields with no
effect on the output (``user``, ``metadata``, ``store``, ``stream_options``, ``service_tier``,
``parallel_tool_calls``) are accepted. samebits adds ``seed`` to each choice and to the response:
the seed a choice was sampled with, drawn by the engine when the request gave none, so any answer
can be replayed.
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

MAX_N = 64  # choices per prompt; each choice is one engine request
MAX_CHOICES = 256  # choices per request, over all prompts of a completion request
MAX_TOP_LOGPROBS = 20
MAX_EMBEDDING_INPUTS = 2048  # inputs per embedding request, as OpenAI


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False
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
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)  # >= n; > n only without streaming
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension (as vLLM): 0 or -1 is off
    min_p: float | None = Field(None, ge=0, le=1)  # extension
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension
    min_tokens: int = Field(0, ge=0)  # extension
    logit_bias: dict[str, float] | None = None  # token id (a string in JSON) -> [-100, 100]
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)  # extension (as vLLM)
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

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[int, float] | None:
        if value is None:
            return None
        if not all(k.isascii() and k.isdigit() for k in value):
            raise ValueError("keys must be token ids (non-negative integers as strings)")
        if not all(-100 <= v <= 100 for v in value.values()):
            raise ValueError("values must be in [-100, 100]")
        return {int(k): v for k, v in value.items()}

    @field_validator("best_of")
    @classmethod
    def _best_of_at_least_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value < n:
            raise ValueError(f"best_of ({value}) must be >= n ({n})")
        return value

    def num_candidates(self) -> int:
        """Engine requests per prompt: best_of when given, else n."""
        return self.n if self.best_of is None else self.best_of


class CompletionRequest(SamplingFields):
    """``echo`` puts the prompt (and, with ``logprobs``, its logprobs: the first one null) before
    the generated text; ``max_tokens: 0`` generates nothing (scoring). ``prompt_logprobs`` (vLLM)
    returns each prompt token's logprob, rank and top-k in vLLM's per-choice shape."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # extension (as vLLM)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls (then content may be null)
    tool_call_id: str | None = None  # a tool message: the call it answers
    # what the openai SDK's message.model_dump() adds to an assistant message sent back: accepted
    # only empty, since they would change nothing
    refusal: None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("each message needs a content (a string or a list of text parts); "
                             "only an assistant message with tool_calls may have none")
        return self

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content or ())


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; several calls are always allowed
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return value


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


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    seed: int
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


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


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    seed: int


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    seed: int


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


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
