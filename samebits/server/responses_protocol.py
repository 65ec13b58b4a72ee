"""The Responses API wire format (``POST /v1/responses``): the request, its input items, the
response object and the stream's events, as OpenAI's, with samebits' ``seed`` and
``system_fingerprint`` beside them.

samebits serves it statelessly: nothing is stored (``store`` is accepted, ``previous_response_id``
is a 400 saying so). Fields that would change the answer and that samebits does not honour are
400s naming them (``reasoning``, ``truncation: "auto"``, non-function tools, media input, ...);
fields with no effect on the output are accepted. vLLM's extensions of this endpoint that are
``SamplingParams`` fields are honoured (``top_k``, ``repetition_penalty``, ``logit_bias``,
``stop``, ``ignore_eos``, ``skip_special_tokens``, ``include_stop_str_in_output``). Input content
is text only (a list of text parts is joined as chat joins it: ``join_text_parts``).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)

from samebits.server.protocol import token_id_keys
from samebits.server.protocol_chat import TokenLogprob
from samebits.text.chat_template import join_text_parts

LOGPROBS = "message.output_text.logprobs"  # the one ``include`` value (the output's logprobs)


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Item(_Request):
    """An input item; ``id`` and ``status`` are what a response's output items carry when sent
    back as input (accepted, no effect)."""

    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class InputText(_Request):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an output_text sent back
    logprobs: list[Any] | None = None


def _text_part(value: Any) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("input_text", "output_text"):
        raise ValueError(f"a content part of type {kind!r}: this model takes text only (send "
                         "parts of type 'input_text')")
    return value


class Message(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return [_text_part(p) for p in value] if isinstance(value, list) else value

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return join_text_parts([p.text for p in self.content])


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutput(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]

    @field_validator("output", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return [_text_part(p) for p in value] if isinstance(value, list) else value

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return join_text_parts([p.text for p in self.output])


def _item_type(value: Any) -> str | None:
    return value.get("type", "message") if isinstance(value, dict) else None


InputItem = Annotated[
    Annotated[Message, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutput, Tag("function_call_output")],
    Discriminator(_item_type, custom_error_type="input_item_type", custom_error_message=(
        "this item type is not supported: samebits takes message, function_call and "
        "function_call_output items "
        "(it stores nothing and runs no built-in tools)"))]


class FunctionTool(_Request):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        if value != "function":
            raise ValueError(f"tools of type {value!r} are not supported: samebits runs no "
                             "built-in tools (give function tools)")
        return value


class FunctionChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    """``text.format``: plain text, any JSON object, or JSON valid against ``schema``."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the model's own; others would change it


class ResponsesStreamOptions(_Request):
    include_obfuscation: bool | None = None  # no effect: samebits adds no obfuscation padding


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None  # a system message before the input
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None  # samebits (as vLLM): choice 0's seed, reported back
    top_logprobs: int | None = None
    include: list[Literal["message.output_text.logprobs"]] | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = None  # accepted: nothing is stored either way
    previous_response_id: str | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: None = None
    background: Literal[False] | None = None
    parallel_tool_calls: bool | None = None  # accepted; several calls are always allowed
    max_tool_calls: None = None
    # accepted, no effect on the output:
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: prefix cache shared per salt
    # vLLM's extensions, SamplingParams fields of the same names (what guidellm sends):
    top_k: int | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string in JSON) -> [-100, 100]
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[int, float] | None:
        return token_id_keys(value)

    @field_validator("reasoning", "max_tool_calls", "background", "truncation", mode="before")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        allowed = {"background": (None, False), "truncation": (None, "disabled")}
        if value not in allowed.get(info.field_name, (None,)):
            raise ValueError(_UNSUPPORTED[info.field_name])
        return value

    @field_validator("input", mode="wrap")
    @classmethod
    def _input_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of input items")
        try:
            return handler(value)
        except ValidationError as e:  # pydantic would report the string branch too
            err = next(x for x in e.errors(include_url=False, include_input=False)
                       if x["loc"][:1] != ("str",))
            where = ".".join(str(x) for x in err["loc"][1:] if x not in _TAGS)
            raise ValueError(f"{where}: {err['msg'].removeprefix('Value error, ')}") from None

    @field_validator("previous_response_id")
    @classmethod
    def _stateless(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("samebits stores no responses (store: false), so it cannot continue "
                             "one: send the whole conversation as input instead")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return value


_TAGS = ("message", "function_call", "function_call_output")  # union tags in error locations
_UNSUPPORTED = {
    "reasoning": "not supported: this model does not reason (leave reasoning out)",
    "max_tool_calls": "not supported: every tool call the model writes is returned",
    "background": "not supported: samebits answers in the foreground (background: false)",
    "truncation": "only 'disabled' is supported: an input over the context is a 400, never cut",
}


# ---- the response ---------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprob] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    model: str
    instructions: str | None = None
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    tool_choice: Any = "auto"
    tools: list[FunctionTool] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    top_logprobs: int | None = None
    previous_response_id: None = None
    store: bool = False
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str] | None = None
    user: str | None = None
    usage: ResponseUsage | None = None
    system_fingerprint: str  # samebits
    seed: int  # samebits: the seed it was sampled with (send it back to replay)
    # a stream's last event only: samebits.server.output_hash (the non-streamed response's
    # X-Samebits-Output-Hash header)
    output_hash: str | None = Field(None, exclude_if=lambda v: v is None)


class StreamEvent(BaseModel):
    """One server-sent event: ``type``, ``sequence_number`` and the type's own fields."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int
