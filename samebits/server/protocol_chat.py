"""``POST /v1/chat/completions`` on the wire: messages (text content only; a list of text parts
is joined as vLLM joins it, samebits.text.chat_template.join_text_parts), the request with vLLM's
chat extensions, and the response and stream chunks."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from samebits.server.protocol import (
    BaseResponse,
    SamplingFields,
    Usage,
    VllmPromptLogprobs,
    _Request,
    omitted_when_none,
)
from samebits.server.protocol_tools import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    FunctionDef,
    NamedFunction,
    NamedToolChoice,
    Tool,
    ToolCall,
)
from samebits.text.chat_template import join_text_parts


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
        return join_text_parts([part.text for part in self.content or ()])


class ChatCompletionRequest(SamplingFields):
    """vLLM's chat extensions: ``echo`` starts the reply with the last message's content when
    that message has the reply's role; ``add_generation_prompt: false`` with
    ``continue_final_message: true`` continues the last message instead of starting a new one;
    ``prompt_logprobs`` as on completions (streamed: on the first chunk). ``functions`` /
    ``function_call`` (legacy) are ``tools`` / ``tool_choice``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None (both): up to the end of the context
    max_completion_tokens: int | None = None  # OpenAI's newer name: wins over max_tokens
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

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(the generated-token limit asked for, None if none; the field that asked)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

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
    function_call: FunctionCall | None = omitted_when_none()  # a legacy functions request's


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    seed: int
    token_ids: list[int] | None = omitted_when_none()  # vLLM's return_token_ids


class ChatCompletionResponse(BaseResponse):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: VllmPromptLogprobs | None = omitted_when_none()
    prompt_token_ids: list[int] | None = omitted_when_none()  # vLLM's return_token_ids


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    function_call: DeltaFunctionCall | None = omitted_when_none()  # legacy functions request


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    seed: int
    token_ids: list[int] | None = omitted_when_none()  # vLLM's return_token_ids


class ChatCompletionChunk(BaseResponse):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = omitted_when_none()  # return_token_ids: first chunk
    prompt_logprobs: VllmPromptLogprobs | None = omitted_when_none()  # first chunk, when asked

