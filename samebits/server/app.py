"""The OpenAI-compatible HTTP server (``samebits serve``): FastAPI routes over the engine loop.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/embeddings``,
``GET /v1/models`` (these behind ``--api-key`` when one is set), ``GET /health``, ``GET /metrics``
(Prometheus), and vLLM's ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``,
``GET /version`` (samebits.server.tokenization). Every response carries ``system_fingerprint``,
and a generation the seed of each choice. A server serves a generation model, an embedding model
(``--task embed``), or both (``--embed-model``); ``ServedModels`` routes each request to the model
it names.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from samebits.embedder import Embedder
from samebits.engine.engine import LLMEngine
from samebits.server import tokenization
from samebits.server.async_engine import AsyncEngine
from samebits.server.chat import create_chat_completion
from samebits.server.completions import create_completion
from samebits.server.embeddings import EmbeddingService, create_embedding
from samebits.server.errors import APIError, from_validation_error
from samebits.server.metrics import Metrics
from samebits.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ModelList,
)
from samebits.server.served_models import ServedModels
from samebits.server.serving import ServingContext
from samebits.server.tokens import TokenText

log = logging.getLogger("samebits.server")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_EMBED_MODEL_NAME = "all-MiniLM-L6-v2"
M = TypeVar("M", bound=BaseModel)


def build_app(engine: LLMEngine | None, model_name: str | None, api_key: str | None = None, *,
                embedder: Embedder | None = None,
                embed_model_name: str = DEFAULT_EMBED_MODEL_NAME) -> FastAPI:
    """The app over a generation engine, an embedder, or both; the engine loop and the embedding
    worker run while the app does (its lifespan)."""
    if engine is not None:
        metrics = Metrics(model_name or DEFAULT_MODEL_NAME, engine.fingerprint,
                          engine.config.batch_invariant)
    elif embedder is not None:
        metrics = Metrics(embed_model_name, embedder.fingerprint, embedder.config.batch_invariant)
    else:
        raise ValueError("build_app needs an engine, an embedder or both")
    loop = ctx = svc = None
    if engine is not None:
        loop = AsyncEngine(engine, metrics)
        ctx = ServingContext(loop, model_name or DEFAULT_MODEL_NAME, engine.tokenizer,
                             engine.max_model_len, engine.fingerprint,
                             TokenText(engine.tokenizer))
    if embedder is not None:
        svc = EmbeddingService(embedder, embed_model_name, metrics)
        if engine is not None:
            metrics.add_model(embed_model_name, embedder.fingerprint)
    served = ServedModels(ctx, svc)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for worker in (loop, svc):
            if worker is not None:
                worker.start()
        yield
        for worker in (svc, loop):
            if worker is not None:
                worker.stop()

    app = FastAPI(title="samebits", lifespan=lifespan)
    app.state.ctx, app.state.embeddings, app.state.metrics = ctx, svc, metrics
    app.include_router(_v1_router(served, api_key))
    app.include_router(tokenization.router(served, _parse))
    _add_open_routes(app, served, metrics)
    _add_error_handlers(app)
    app.add_middleware(StatusCounter, metrics=metrics)
    return app


def _v1_router(served: ServedModels, api_key: str | None) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(_auth(api_key))])

    @router.post("/completions")
    async def completions(request: Request) -> Any:
        req = await _parse(request, CompletionRequest)
        ctx = served.for_generation(req.model, "completions")
        return _json(await create_completion(ctx, req, request))

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Any:
        req = await _parse(request, ChatCompletionRequest)
        ctx = served.for_generation(req.model, "chat completions")
        return _json(await create_chat_completion(ctx, req, request))

    @router.post("/embeddings")
    async def embeddings(request: Request) -> Any:
        req = await _parse(request, EmbeddingRequest)
        return _json(await create_embedding(served.for_embedding(req.model), req))

    @router.get("/models")
    async def models() -> Any:
        return _json(ModelList(data=served.cards()))

    return router


def _add_open_routes(app: FastAPI, served: ServedModels, metrics: Metrics) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        if served.generation is not None and not served.generation.engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        if served.embedding is not None and not served.embedding.alive:
            return JSONResponse({"status": "embedding worker stopped"}, status_code=503)
        return JSONResponse({"status": "ok", "system_fingerprint": served.fingerprint})

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

        embedding = scope["path"] == "/v1/embeddings"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = str(message["status"])
                self.metrics.requests.labels(status=status).inc()
                if embedding:
                    self.metrics.embedding_requests.labels(status=status).inc()
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


def embed_model_name(model: str | None) -> str:
    return DEFAULT_EMBED_MODEL_NAME if model is None else model_name(model)


def load_embedder(args: argparse.Namespace, model: str | None, load_format: str = "auto",
                  max_model_len: int | None = None) -> Embedder:
    """The embedding model, through ``LLM(task="embed")`` so that it is exactly the offline one."""
    from samebits.llm import LLM
    config = EngineConfig.from_cli_args(args, task="embed", model=model, load_format=load_format,
                                        max_model_len=max_model_len, seed=args.seed)
    return LLM(**dataclasses.asdict(config)).embedder


def build_served_app(args: argparse.Namespace, api_key: str | None) -> FastAPI:
    """``--task embed``: only the embedding model ``--model``; otherwise the generation model,
    and beside it the embedding model ``--embed-model`` (DEFAULT or a path) when given."""
    if args.task == "embed":
        if args.embed_model is not None:
            raise ValueError("--embed-model goes with --task generate; with --task embed, --model "
                             "names the embedding model")
        embedder = load_embedder(args, args.model, args.load_format, args.max_model_len)
        name = args.served_model_name or embed_model_name(args.model)
        return build_app(None, None, api_key, embedder=embedder, embed_model_name=name)
    engine = LLMEngine(EngineConfig.from_cli_args(args, seed=args.seed))
    embedder, embed_name = None, DEFAULT_EMBED_MODEL_NAME
    if args.embed_model is not None:
        path = None if args.embed_model == "DEFAULT" else args.embed_model
        embedder, embed_name = load_embedder(args, path), embed_model_name(path)
    return build_app(engine, args.served_model_name or model_name(args.model), api_key,
                     embedder=embedder, embed_model_name=embed_name)


def serve(args: argparse.Namespace) -> int:
    import uvicorn
    api_key = args.api_key or env.api_key()
    app = build_served_app(args, api_key)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0
