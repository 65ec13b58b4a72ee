"""vLLM's tokenizer endpoints, on by default (what lm-eval's remote tokenizer backend uses):
``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info`` and ``GET /version``.

As vLLM, they live outside ``/v1`` and are not behind ``--api-key``; ``model`` is optional. A
prompt's special-token text (``<|im_end|>``) maps to its id; ``add_special_tokens`` decides only
what the tokenizer adds around the text (default true for ``prompt``, false for ``messages``,
whose chat template places them). ``messages`` are rendered as ``/v1/chat/completions`` renders
them (``tools``, ``chat_template_kwargs``, ``add_generation_prompt``, ``continue_final_message``),
so their ids are the chat request's prompt ids.

Bounded work: besides ``--max-request-bytes``, a text or token list may hold at most
``TOKENIZE_LIMIT_FACTOR`` times the context (``--max-model-len``) tokens (lm-eval tokenizes whole
documents and cuts them into windows itself, so the limit is a multiple); past it, a 400. A text
certainly over the limit (``Tokenizer.min_num_tokens``) is refused before tokenizing. Templating,
tokenizing and decoding run in worker threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, model_validator

import samebits
from samebits.server.chat import template_message
from samebits.server.errors import APIError
from samebits.server.protocol import _Request
from samebits.server.protocol_chat import ChatMessage
from samebits.server.protocol_tools import Tool
from samebits.server.serving import ServingContext
from samebits.text.chat_template import render_chat

TOKENIZE_LIMIT_FACTOR = 32  # /tokenize and /detokenize: at most this many contexts of tokens


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: true for prompt, false for messages
    # messages only, rendered as /v1/chat/completions renders them:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt or messages")
        return self

    def chat_fields(self) -> dict[str, Any]:
        """The messages' rendering options, as ``render_chat`` takes them."""
        return dict(tools=[t.model_dump(exclude_none=True) for t in self.tools or ()],
                    template_kwargs=self.chat_template_kwargs,
                    add_generation_prompt=self.add_generation_prompt,
                    continue_final_message=self.continue_final_message)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def token_limit(ctx: ServingContext) -> int:
    """The most tokens /tokenize returns or /detokenize takes."""
    return TOKENIZE_LIMIT_FACTOR * ctx.max_model_len


def tokenize(ctx: ServingContext, req: TokenizeRequest) -> TokenizeResponse:
    """The response (blocking: run it in a worker thread)."""
    tok = _tokenizer(ctx, req.model)
    if req.messages is not None:
        try:
            text = render_chat(tok, [template_message(m) for m in req.messages],
                               **req.chat_fields())
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        special, param = bool(req.add_special_tokens), "messages"
    else:
        text, special, param = req.prompt, req.add_special_tokens is not False, "prompt"
    limit = token_limit(ctx)
    if tok.min_num_tokens(text) > limit:
        raise _too_many(param, f"at least {tok.min_num_tokens(text)}", limit)
    try:
        ids = tok.encode(text, add_special_tokens=special)
    except UnicodeError:
        raise APIError(400, f"{param} is not valid UTF-8", param=param) from None
    if len(ids) > limit:
        raise _too_many(param, str(len(ids)), limit)
    strs = [tok.id_to_piece(t) or "" for t in ids] if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids,
                            token_strs=strs)


def detokenize(ctx: ServingContext, req: DetokenizeRequest) -> DetokenizeResponse:
    """The response (blocking: run it in a worker thread)."""
    tok = _tokenizer(ctx, req.model)
    if len(req.tokens) > token_limit(ctx):
        raise _too_many("tokens", str(len(req.tokens)), token_limit(ctx))
    bad = [t for t in req.tokens if not 0 <= t < tok.vocab_size]
    if bad:
        raise APIError(400, f"tokens: {bad[0]} is not a token id of this model (0 to "
                       f"{tok.vocab_size - 1})", param="tokens")
    return DetokenizeResponse(prompt=tok.decode(req.tokens, skip_special_tokens=False))


def _too_many(param: str, count: str, limit: int) -> APIError:
    return APIError(400, f"{param} has {count} tokens; the limit is {limit} "
                    f"({TOKENIZE_LIMIT_FACTOR} x max_model_len)", param=param,
                    code="context_length_exceeded")


def tokenizer_info(ctx: ServingContext) -> dict[str, Any]:
    """tokenizer_config.json as vLLM serves it: special tokens as their text, file paths
    dropped, ``tokenizer_class``, ``chat_template``, and eos/bos/pad tokens always present."""
    tok = _tokenizer(ctx, None)
    info = {k: _plain(v) for k, v in tok.config.items() if k not in ("vocab_file", "merges_file")}
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    info.update(eos_token=tok.eos_token, bos_token=tok.bos_token, pad_token=tok.pad_token,
                chat_template=tok.chat_template, model_max_length=ctx.max_model_len)
    return info


def _plain(value: Any) -> Any:
    """An AddedToken-like {"content": ...} becomes its text (as vLLM serialises them)."""
    if isinstance(value, dict):
        if "content" in value and isinstance(value["content"], str):
            return value["content"]
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _tokenizer(ctx: ServingContext, model: str | None):
    ctx.check_model(model)
    if ctx.tokenizer is None:
        raise APIError(400, "this model has no tokenizer")
    return ctx.tokenizer


def router(served: Any, parse: Any) -> APIRouter:
    """The four routes over the served generation model (``served.for_generation``)."""
    r = APIRouter()

    @r.post("/tokenize")
    async def tokenize_route(request: Request) -> TokenizeResponse:
        req = await parse(request, TokenizeRequest)
        return await asyncio.to_thread(tokenize, served.for_generation(req.model, "tokenize"), req)

    @r.post("/detokenize")
    async def detokenize_route(request: Request) -> DetokenizeResponse:
        req = await parse(request, DetokenizeRequest)
        return await asyncio.to_thread(detokenize, served.for_generation(req.model, "detokenize"),
                                       req)

    @r.get("/tokenizer_info")
    async def tokenizer_info_route() -> dict[str, Any]:
        return tokenizer_info(served.for_generation(None, "tokenizer_info"))

    @r.get("/version")
    async def version() -> dict[str, str]:
        return {"version": samebits.__version__}

    return r
