"""The OpenAI-compatible HTTP server (``samebits serve``): FastAPI routes over the engine loop.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (these
three behind ``--api-key`` when one is set), ``GET /health``, ``GET /metrics`` (Prometheus).
Every response carries ``system_fingerprint`` and the seed of each choice.
"""

from __future__ import annotations

import argparse
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from samebits import env
from samebits.config import EngineConfig
from samebits.engine.engine import LLMEngine
from samebits.server.async_engine import AsyncEngine
from samebits.server.chat import create_chat_completion
from samebits.server.completions import create_completion
from samebits.server.errors import APIError, from_validation_error
from samebits.server.metrics import Metrics
from samebits.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from samebits.server.serving import ServingContext
from samebits.server.tokens import TokenText

log = logging.getLogger("samebits.server")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
M = TypeVar("M", bound=BaseModel)


def build_app(engine: LLMEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The app over an engine; the engine loop runs while the app does (its lifespan)."""
    metrics = Metrics(model_name, engine.fingerprint, engine.config.batch_invariant)
    loop = AsyncEngine(engine, metrics)
    ctx = ServingContext(loop, model_name, engine.tokenizer, engine.max_model_len,
                         engine.fingerprint, TokenText(engine.tokenizer))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loop.start()
        yield
        loop.stop()

    app = FastAPI(title="samebits", lifespan=lifespan)
    app.state.ctx, app.state.metrics = ctx, metrics
    app.include_router(_v1_router(ctx, api_key))
    _add_open_routes(app, ctx, metrics)
    _add_error_handlers(app)
    app.add_middleware(StatusCounter, metrics=metrics)
    return app


def _v1_router(ctx: ServingContext, api_key: str | None) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(_auth(api_key))])

    @router.post("/completions")
    async def completions(request: Request) -> Any:
        return _json(await create_completion(ctx, await _parse(request, CompletionRequest),
                                             request))

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return _json(await create_chat_completion(
            ctx, await _parse(request, ChatCompletionRequest), request))

    @router.get("/models")
    async def models() -> Any:
        card = ModelCard(id=ctx.model_name, max_model_len=ctx.max_model_len,
                         system_fingerprint=ctx.fingerprint)
        return _json(ModelList(data=[card]))

    return router


def _add_open_routes(app: FastAPI, ctx: ServingContext, metrics: Metrics) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        if not ctx.engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok", "system_fingerprint": ctx.fingerprint})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)


def _auth(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(),
                                                                 api_key.encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
    return check


async def _parse(request: Request, model: type[M]) -> M:
    """Parse the body ourselves: malformed JSON, invalid UTF-8 and wrong types are all 400s."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        raise from_validation_error(e) from None


def _json(result: Any) -> Any:
    if isinstance(result, BaseModel):
        return Response(result.model_dump_json(), media_type="application/json")
    return result


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        return APIError(e.status_code, str(e.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return APIError(400, str(e.errors()[0].get("msg", "invalid request"))).response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(e).__name__}").response()


class StatusCounter:
    """Pure ASGI middleware (safe for streaming): counts /v1/* requests by response status."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


# ---- samebits serve ----------------------------------------------------------------------
def model_name(model: str | None) -> str:
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    if path.name == "config.json":
        return path.parent.name
    return path.stem if path.suffix == ".gguf" else path.name


def engine_config(args: argparse.Namespace) -> EngineConfig:
    kwargs: dict[str, Any] = dict(
        load_format=args.load_format, device=args.device, dtype=args.dtype,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks, seed=args.seed)
    if args.standard:
        kwargs["batch_invariant"] = False
    return EngineConfig(model=args.model, **kwargs)


def serve(args: argparse.Namespace) -> int:
    import uvicorn
    api_key = args.api_key or env.api_key()
    engine = LLMEngine(engine_config(args))
    app = build_app(engine, args.served_model_name or model_name(args.model), api_key)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0
