"""The OpenAI-compatible HTTP server (``samebits serve``): FastAPI routes over the engine loop.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses``,
``POST /v1/embeddings``, ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``,
``GET /metrics`` (Prometheus), and vLLM's ``POST /tokenize``, ``POST /detokenize``,
``GET /tokenizer_info``, ``GET /version`` (samebits.server.tokenization). With ``--api-key``,
every path but ``/health`` (and ``/metrics`` with ``--metrics-public``) needs the key, checked
before anything else (samebits.server.auth). Every response carries ``system_fingerprint``, and a
generation the seed of each choice. A server serves a generation model, an embedding model
(``--task embed``), or both (``--embed-model``); ``ServedModels`` routes each request to the model
it names. The security limits are ``ServerLimits`` (samebits.server.limits; docs/SECURITY.md).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import pydantic_core
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from samebits import env
from samebits.config import EngineConfig
from samebits.engine.engine import LLMEngine
from samebits.ops import cpu_kernels
from samebits.server import lifecycle, tokenization, weight_updates
from samebits.server.async_engine import AsyncEngine
from samebits.server.auth import APIKeyAuth
from samebits.server.chat import create_chat_completion
from samebits.server.completions import create_completion
from samebits.server.embeddings import EmbeddingContext, create_embedding
from samebits.server.engine_process import EngineProcess
from samebits.server.errors import APIError, from_validation_error
from samebits.server.guard import RequestGuard
from samebits.server.launch import load_engine, served_names
from samebits.server.lifecycle import Readiness, ReadinessGate
from samebits.server.limits import ServerLimits
from samebits.server.memory import GiveBackMemory
from samebits.server.metrics import Metrics
from samebits.server.openapi import document_bodies
from samebits.server.protocol import MAX_TOP_LOGPROBS, ModelList
from samebits.server.protocol_chat import ChatCompletionRequest
from samebits.server.protocol_completion import CompletionRequest
from samebits.server.protocol_embedding import EmbeddingRequest
from samebits.server.responses import create_response
from samebits.server.responses_protocol import ResponsesRequest
from samebits.server.served_models import ServedModels
from samebits.server.serving import ServingContext
from samebits.server.tokens import TokenText

log = logging.getLogger("samebits.server")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_EMBED_MODEL_NAME = "all-MiniLM-L6-v2"
M = TypeVar("M", bound=BaseModel)
DEFAULT_LIMITS = ServerLimits()


def build_app(engine: LLMEngine | EngineProcess | None, model_name: str | Sequence[str] | None,
              api_key: str | Sequence[str] | None = None, *,
              embed_engine: LLMEngine | None = None,
              embed_model_name: str | Sequence[str] = DEFAULT_EMBED_MODEL_NAME,
              max_queued_requests: int | None = None, canary_rate: float = 0.0,
              limits: ServerLimits = DEFAULT_LIMITS,
              max_logprobs: int = MAX_TOP_LOGPROBS,
              prompt_tokens_details: bool = False) -> FastAPI:
    """The app over a generation engine, an embedding model's engine (``embed_engine``), or
    both; their engine loops run while the app does (its lifespan). A model name may be several
    names (the first is its name, the others aliases). ``api_key``: one key or several (any of
    them is accepted). ``max_queued_requests``: requests that may wait beyond those running (None: no
    limit); past it, 503 with Retry-After. ``canary_rate``: the share of finished requests the
    determinism canary replays alone (samebits.server.canary). ``max_logprobs``: the most
    logprobs a request may ask for. ``prompt_tokens_details``: completion and chat usage report
    ``prompt_tokens_details.cached_tokens`` (vLLM's ``--enable-prompt-tokens-details``).
    ``app.state.readiness`` is what /health reports and what a shutdown drains
    (samebits.server.lifecycle)."""
    keys = _keys(api_key)
    limits.check_auth(keys)
    gen_names = _names(model_name, DEFAULT_MODEL_NAME)
    emb_names = _names(embed_model_name, DEFAULT_EMBED_MODEL_NAME)
    if engine is not None:
        metrics = Metrics(gen_names[0], engine.fingerprint, engine.config.batch_invariant,
                          engine.max_model_len)
    elif embed_engine is not None:
        metrics = Metrics(emb_names[0], embed_engine.fingerprint,
                          embed_engine.config.batch_invariant)
    else:
        raise ValueError("build_app needs a generation engine, an embedding engine or both")
    loop = ctx = emb = None
    if engine is not None:
        loop = AsyncEngine(engine, metrics, max_queued_requests, canary_rate)
        metrics.cache_config(engine.config.block_size, metrics.kv_blocks_total.value)
        ctx = ServingContext(loop, gen_names[0], engine.tokenizer,
                             engine.max_model_len, engine.fingerprint,
                             TokenText(engine.tokenizer), engine.grammars,
                             max_logprobs=max_logprobs, aliases=gen_names[1:],
                             prompt_tokens_details=prompt_tokens_details)
    if embed_engine is not None:
        emb = EmbeddingContext.serve(embed_engine, emb_names[0], metrics, max_queued_requests)
        if engine is not None:
            metrics.add_model(emb_names[0], embed_engine.fingerprint)
    served = ServedModels(ctx, emb, embedding_aliases=emb_names[1:])
    loops = [x for x in (loop, emb.engine if emb is not None else None) if x is not None]
    readiness = _readiness(loops)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for engine_loop in loops:
            engine_loop.start()
        yield
        for engine_loop in reversed(loops):
            engine_loop.stop()

    # redirect_slashes=False: a trailing-slash path is a 404, never a redirect built from Host
    app = FastAPI(title="samebits", lifespan=lifespan, redirect_slashes=False)
    app.state.ctx, app.state.embeddings, app.state.metrics = ctx, emb, metrics
    app.state.readiness = readiness
    router = _v1_router(served)
    if limits.enable_weight_updates and ctx is not None:
        weight_updates.add_route(router, ctx, metrics, limits.weight_update_root,
                                 limits.weight_update_timeout_s, _parse)
    app.include_router(router)
    app.include_router(tokenization.router(served, _parse))
    _add_open_routes(app, served, metrics, readiness)
    _add_error_handlers(app)
    document_bodies(app, REQUEST_BODIES)
    # outermost last: StatusCounter, then the key, then readiness, then the body checks; after
    # a large body, free heap goes back to the system (GiveBackMemory)
    app.add_middleware(RequestGuard, limits=limits)
    app.add_middleware(GiveBackMemory)
    app.add_middleware(ReadinessGate, readiness=readiness)
    open_paths = ("/health", "/metrics") if limits.metrics_public else ("/health",)
    app.add_middleware(APIKeyAuth, api_keys=keys, open_paths=open_paths)
    app.add_middleware(StatusCounter, metrics=metrics)
    return app


def _readiness(loops: list[AsyncEngine]) -> Readiness:
    """Ready while every engine loop (the generation model's, the embedding model's) runs."""
    def check(loop: AsyncEngine) -> Callable[[], str | None]:
        return lambda: loop.error or (None if loop.alive else "the engine is stopped")

    def stop() -> None:
        for loop in loops:
            loop.stop()
    return Readiness([check(loop) for loop in loops], stop=stop)


REQUEST_BODIES: dict[str, type[BaseModel]] = {  # what /openapi.json documents for each POST
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/tokenize": tokenization.TokenizeRequest,
    "/detokenize": tokenization.DetokenizeRequest,
    "/v1/update_weights": weight_updates.UpdateWeightsRequest,
}


def _names(names: str | Sequence[str] | None, default: str) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else tuple(names or ()) or (default,)


def _keys(api_key: str | Sequence[str] | None) -> tuple[str, ...]:
    keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
    if any(not k for k in keys):
        raise ValueError("an API key is empty: give a non-empty --api-key (or SAMEBITS_API_KEY), "
                         "or none at all to serve without authentication")
    return keys


def _v1_router(served: ServedModels) -> APIRouter:
    router = APIRouter(prefix="/v1")

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

    @router.post("/responses")
    async def responses(request: Request) -> Any:
        req = await _parse(request, ResponsesRequest)
        return await create_response(served.for_generation(req.model, "responses"), req, request)

    @router.post("/embeddings")
    async def embeddings(request: Request) -> Any:
        req = await _parse(request, EmbeddingRequest)
        return _json(await create_embedding(served.for_embedding(req.model), req, request))

    @router.get("/models")
    async def models() -> Any:
        return _json(ModelList(data=served.cards()))

    @router.get("/models/{model_id:path}")
    async def model(model_id: str) -> Any:
        return _json(served.card(model_id))

    return router


def _add_open_routes(app: FastAPI, served: ServedModels, metrics: Metrics,
                     readiness: Readiness) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        problem = readiness.problem()
        if problem is not None:
            return JSONResponse({"status": problem}, status_code=503)
        return JSONResponse({"status": "ok", "system_fingerprint": served.fingerprint})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)


async def _parse(request: Request, model: type[M]) -> M:
    """Parse the body ourselves: malformed JSON, invalid UTF-8, wrong types and non-finite
    numbers (NaN, Infinity: not JSON) are all 400s."""
    body = await request.body()
    _finite_numbers_only(body)
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _finite_numbers_only(body: bytes) -> None:
    """A 400 if any number in ``body`` is NaN or +-Infinity (JSON has no such numbers). The
    second, strict parse runs only when such a token can occur, so it costs nothing otherwise."""
    if b"NaN" not in body and b"Infinity" not in body:
        return
    try:
        pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError as e:
        try:
            pydantic_core.from_json(body)
        except ValueError:
            return  # malformed otherwise: the model's parse reports it
        raise APIError(400, f"the request body is not valid JSON: NaN and Infinity are not "
                       f"numbers in JSON ({e})", code="invalid_json") from None


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
        return APIError(e.status_code, str(e.detail), headers=e.headers).response()  # 405: Allow

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return APIError(400, str(e.errors()[0].get("msg", "invalid request"))).response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(e).__name__}").response()


class StatusCounter:
    """Pure ASGI middleware (safe for streaming): counts /v1/* requests by final status, once
    the response has ended: a response (a stream) the client left before its end counts as 499,
    one the app failed after starting as 500."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        status, ended = None, False

        async def watching_send(message: Message) -> None:
            nonlocal status, ended
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        except BaseException:
            self._count(scope, 500)
            raise
        self._count(scope, status if ended else 499)

    def _count(self, scope: Scope, status: int | None) -> None:
        label = str(status if status is not None else 499)
        self.metrics.requests.labels(status=label).inc()
        if scope["path"] == "/v1/embeddings":
            self.metrics.embedding_requests.labels(status=label).inc()


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


def load_embed_engine(args: argparse.Namespace, model: str | None, load_format: str = "auto",
                      max_model_len: int | None = None) -> LLMEngine:
    """The embedding model's engine (``task="embed"``): the one ``LLM(task="embed")`` builds."""
    return LLMEngine(EngineConfig.from_cli_args(args, task="embed", model=model,
                                                load_format=load_format,
                                                max_model_len=max_model_len, seed=args.seed))


def read_chat_template(spec: str) -> str:
    """``--chat-template``: a file's text, or the argument itself when it is a jinja template."""
    path = Path(spec)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in spec or "{%" in spec:
        return spec
    raise ValueError(f"--chat-template: {spec!r} is neither a file nor a jinja template")


def build_served_app(args: argparse.Namespace, api_key: str | Sequence[str] | None,
                     limits: ServerLimits = DEFAULT_LIMITS) -> FastAPI:
    """``--task embed``: only the embedding model ``--model``; otherwise the generation model,
    and beside it the embedding model ``--embed-model`` (DEFAULT or a path) when given."""
    if args.task == "embed":
        if args.embed_model is not None:
            raise ValueError("--embed-model goes with --task generate; with --task embed, --model "
                             "names the embedding model")
        embed_engine = load_embed_engine(args, args.model, args.load_format, args.max_model_len)
        names = served_names(args, embed_model_name(args.model), DEFAULT_EMBED_MODEL_NAME)
        _build_kernels(embed_engine.config)
        return build_app(None, None, api_key, embed_engine=embed_engine, embed_model_name=names,
                         max_queued_requests=args.max_queued_requests, limits=limits)
    engine = load_engine(args)  # in a process of its own unless --no-engine-process
    if getattr(args, "chat_template", None) and engine.tokenizer is not None:
        engine.tokenizer.chat_template = read_chat_template(args.chat_template)
    embed_engine, embed_name = None, DEFAULT_EMBED_MODEL_NAME
    if args.embed_model is not None:
        path = None if args.embed_model == "DEFAULT" else args.embed_model
        embed_engine, embed_name = load_embed_engine(args, path), embed_model_name(path)
    _build_kernels(engine.config, *([embed_engine.config] if embed_engine is not None else []))
    return build_app(engine, served_names(args, model_name(args.model), DEFAULT_MODEL_NAME),
                     api_key, embed_engine=embed_engine, embed_model_name=embed_name,
                     max_queued_requests=args.max_queued_requests,
                     canary_rate=args.canary_rate, limits=limits, max_logprobs=args.max_logprobs,
                     prompt_tokens_details=args.enable_prompt_tokens_details)


def _build_kernels(*configs: EngineConfig) -> None:
    """Build (or load) the invariant CPU kernels now, before the server listens, instead of at
    the first request: /health is never green while a build is still due."""
    if any(c.batch_invariant and c.torch_device.type == "cpu" for c in configs):
        cpu_kernels.load()


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """Every ``--api-key`` given, else SAMEBITS_API_KEY's comma-separated keys; an empty key
    raises ``ValueError`` naming the API key (before any model is loaded)."""
    return _keys(args.api_key if args.api_key is not None else env.api_keys())


def serve(args: argparse.Namespace) -> int:
    """``samebits serve``: the limits and keys are checked before any model is loaded."""
    limits, keys = ServerLimits.from_cli_args(args), api_keys(args)
    limits.check_auth(keys)
    app = build_served_app(args, keys, limits)
    lifecycle.run(app, app.state.readiness, limits, args.host, args.port, args.log_level)
    return 0
