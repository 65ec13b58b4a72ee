"""``POST /v1/embeddings`` on the wire: the request and the response."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, ValidatorFunctionWrapHandler, field_validator

from samebits.server.protocol import _Request


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

