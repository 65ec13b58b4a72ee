"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status.

A message never echoes a large input: every quoted (``'...'``, ``"..."``) or bracketed
(``[...]``, ``{...}``) piece longer than ``QUOTE_LIMIT`` characters is cut to its first
characters and its length, as are field names from the input, and a message is at most
``MESSAGE_LIMIT`` characters.
"""

from __future__ import annotations

import dataclasses
import re

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from samebits.sampling_params import SamplingParams
from samebits.server.protocol import ErrorInfo, ErrorResponse

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error",
          503: "server_error"}
QUOTE_LIMIT = 40  # the longest quoted or bracketed piece a message keeps whole
MESSAGE_LIMIT = 300
_PIECE = re.compile(r"'[^']*'|\"[^\"]*\"|\[[^\[\]]*\]|\{[^{}]*\}")


def bounded(message: str) -> str:
    """``message`` with its long quoted or bracketed pieces cut, at most ``MESSAGE_LIMIT``
    characters (see the module docstring)."""
    message = _PIECE.sub(_shorten, message)
    if len(message) > MESSAGE_LIMIT:
        message = f"{message[:MESSAGE_LIMIT - 30]}... ({len(message)} characters)"
    return message


def _shorten(match: re.Match) -> str:
    piece = match.group(0)
    if len(piece) <= QUOTE_LIMIT:
        return piece
    return f"{piece[:QUOTE_LIMIT - 8]}...{piece[-1]} ({len(piece)} characters)"


def cut(text: str) -> str:
    """A bare piece of input (a field name) at most about ``QUOTE_LIMIT`` characters long."""
    if len(text) <= QUOTE_LIMIT:
        return text
    return f"{text[:QUOTE_LIMIT - 8]}... ({len(text)} characters)"


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        message = bounded(message)
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # e.g. Allow on a 405, Retry-After on a 503
        self.type = type or _TYPES.get(status, "server_error" if status >= 500
                                       else "invalid_request_error")

    def info(self) -> ErrorInfo:
        return ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info()).model_dump(), status_code=self.status,
                            headers=self.headers)


def from_validation_error(e: ValidationError) -> APIError:
    """The first problem pydantic found, as a 400 naming the field (never echoing the input)."""
    err = e.errors(include_url=False, include_input=False)[0]
    if err["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON (UTF-8): {err['msg']}",
                        code="invalid_json")
    loc = [cut(str(x)) for x in err["loc"]]  # a field name may be any input
    where = ".".join(loc)
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        message = ("unknown field: samebits does not support it, and does not ignore a field "
                   "that might change the answer")
    return APIError(400, f"{where}: {message}" if where else message,
                    param=loc[0] if loc else None, code=err["type"])


_FIELD = re.compile(r"^([a-z_]+)\b")
_PARAMS = {f.name for f in dataclasses.fields(SamplingParams)} | {"prompt", "messages"}


def from_value_error(e: ValueError) -> APIError:
    """Engine-side validation (SamplingParams, LLMEngine.add_request) names the field first."""
    message = str(e)
    m = _FIELD.match(message)
    return APIError(400, message, param=m.group(1) if m and m.group(1) in _PARAMS else None)
