"""The OpenAI-compatible HTTP server: routes, API key, request size limit, errors as OpenAI's.

Run it with ``pagedllm serve [MODEL]`` (or ``python -m pagedllm serve``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import os
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedllm import __version__
from pagedllm.engine.arg_utils import EMBEDDED_MODEL_FILE, EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.engine_process import StartedEngineCore
from pagedllm.engine.llm_engine import LLMEngine, freeze_startup_heap
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelList,
    TokenizeRequest,
)
from pagedllm.entrypoints.openai.protocol_messages import MessagesCountTokensRequest, MessagesRequest
from pagedllm.entrypoints.openai.protocol_pooling import EmbeddingRequest, RerankRequest, ScoreRequest
from pagedllm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagedllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_engine import REQUEST_ID_HEADER, APIError
from pagedllm.entrypoints.openai.serving_messages import OpenAIServingMessages
from pagedllm.entrypoints.openai.serving_models import (
    LoadLoRAAdapterRequest,
    OpenAIServingModels,
    UnloadLoRAAdapterRequest,
)
from pagedllm.entrypoints.openai.serving_pooling import OpenAIServingPooling, refuse_generation_routes
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.entrypoints.utils import engine_summary
from pagedllm.metrics import ServerMetrics, StatsLogger

logger = logging.getLogger(__name__)

# Seconds uvicorn waits for open responses on shutdown before cancelling them.
GRACEFUL_SHUTDOWN_SECONDS = 5
# A client gets this long between the parts of its request body before a 408 (slow-body attacks).
BODY_READ_TIMEOUT_S = 30.0
# The most bytes of request line and headers uvicorn buffers (h11's limit).
MAX_HEADER_BYTES = 64 * 1024
# Seconds a connection gets to send a request's line and headers, from connecting or from its
# last response: idle and slowloris sockets are closed after it (uvicorn has no such timeout).
HEADER_READ_TIMEOUT_S = 10.0
# Routes outside --limit-concurrency: probes must see a busy server as alive.
_UNLIMITED_PATHS = frozenset({"/health"})


# Seconds between checks that the engine still serves; a dead one stops the server.
HEALTH_CHECK_INTERVAL_S = 1.0


@dataclass
class ServerSettings:
    model_name: str
    # Every /v1 route, /tokenize and /detokenize need "Authorization: Bearer <api_key>" when set.
    api_key: str | None = None
    max_request_body_bytes: int = 1 << 20
    # Seconds between stats log lines; 0 turns them off.
    stats_interval: float = 10.0
    # The most requests in progress at once (streams included); more get 503. None: no limit.
    limit_concurrency: int | None = None
    # Render chat templates that requests bring (chat_template): off, they are refused.
    trust_request_chat_template: bool = False
    # The tool-call parser for tool_choice "auto" (None: auto is refused).
    tool_call_parser: str | None = None
    # LoRA adapters served from the start: (name, path, base model name or None).
    lora_modules: list[tuple[str, str, str | None]] = field(default_factory=list)
    # The reasoning parser that fills reasoning_content (None: all output is content).
    reasoning_parser: str | None = None


def error_response(error: APIError) -> Response:
    return Response(
        error.body().model_dump_json(), status_code=error.status_code, media_type="application/json"
    )


# Routes open without the key: probes and scrapers (vLLM's choice); everything else is the API.
_PUBLIC_PATHS = frozenset({"/health", "/version", "/metrics"})


class ApiKeyMiddleware:
    """401 for an API request (every route but /health, /version and /metrics) without the right
    bearer token (or x-api-key header, as Anthropic's clients send it), before its body is even
    read: /tokenize and /detokenize spend the server's time as completions do. The scheme is
    case-insensitive (RFC 7235)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _PUBLIC_PATHS:
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            # Constant time, so the key cannot be guessed byte by byte from response times.
            bearer = hmac.compare_digest(token.strip(), self.expected) and scheme.lower() == b"bearer"
            # Anthropic's clients send the key as x-api-key (/v1/messages).
            if not (bearer or hmac.compare_digest(headers.get(b"x-api-key", b""), self.expected)):
                error = APIError(401, "Incorrect or missing API key.", code="invalid_api_key")
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for a request body over ``max_bytes``: by its Content-Length before reading, or while
    reading a body sent without one."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        content_length = dict(scope["headers"]).get(b"content-length")
        if content_length is not None and content_length.isdigit() and int(content_length) > self.max_bytes:
            await error_response(self._error())(scope, receive, send)
            return
        num_bytes = 0
        body_done = False

        async def limited_receive() -> Message:
            nonlocal num_bytes, body_done
            if body_done:
                # After the body, the next message is the disconnect: waiting for it is not slow.
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), BODY_READ_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise HTTPException(408, f"no request body for {BODY_READ_TIMEOUT_S:g} s") from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_bytes:
                # FastAPI passes HTTPExceptions raised while reading the body on to the handlers.
                raise HTTPException(413, self._error().info.message)
            return message

        await self.app(scope, limited_receive, send)

    def _error(self) -> APIError:
        return APIError(
            413, f"The request body is larger than {self.max_bytes} bytes.", code="request_too_large"
        )


class RequestLimitMiddleware:
    """503 for a request beyond ``limit`` requests in progress (a stream counts until it ends).

    This is --limit-concurrency, counted here rather than by uvicorn, which counts open
    connections: 1,100 idle sockets made it answer every request and /health with 503."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.num_requests = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _UNLIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.num_requests >= self.limit:
            message = f"more than {self.limit} requests at once (--limit-concurrency); try again later"
            await error_response(APIError(503, message, code="server_busy"))(scope, receive, send)
            return
        self.num_requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_requests -= 1


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request line and
    headers HEADER_READ_TIMEOUT_S after it connected or after its last response (uvicorn's
    keep-alive timeout stops at the first byte, so a slowloris client could hold it for good)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self._header_timer is not None:
            self._header_timer.cancel()

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(HEADER_READ_TIMEOUT_S, self._on_header_timeout, self.cycle)

    def _on_header_timeout(self, cycle_when_armed: object) -> None:
        # A new request's headers make a new cycle; one still being answered is never cut.
        waiting = self.cycle is None or self.cycle.response_complete
        if self.cycle is cycle_when_armed and waiting and not self.transport.is_closing():
            self.transport.close()


def build_app(async_engine: AsyncLLMEngine, settings: ServerSettings) -> FastAPI:
    """The server's app; its lifespan starts the engine loop and stops it on shutdown.

    When the engine dies (a worker gone), /health answers 503 and ``app.state.on_engine_dead``
    (set by run_server) is called once, to stop the server.
    """
    metrics = ServerMetrics(async_engine, settings.model_name)
    async_engine.on_request_finished = metrics.observe_finished
    tokenizer = async_engine.tokenizer
    completions = OpenAIServingCompletion(async_engine, settings.model_name, tokenizer)
    tool_parser = TOOL_PARSERS[settings.tool_call_parser] if settings.tool_call_parser else None
    reasoning_parser = REASONING_PARSERS[settings.reasoning_parser] if settings.reasoning_parser else None
    chat = OpenAIServingChat(
        async_engine,
        settings.model_name,
        tokenizer,
        trust_request_chat_template=settings.trust_request_chat_template,
        tool_parser=tool_parser,
        reasoning_parser=reasoning_parser,
    )
    tokenization = OpenAIServingTokenization(async_engine, settings.model_name, tokenizer, chat=chat)
    models = OpenAIServingModels(async_engine.config, settings.model_name, settings.lora_modules)
    pooling = OpenAIServingPooling(async_engine, settings.model_name, tokenizer)
    for handler in (completions, chat, tokenization, pooling):
        handler.models = models
    responses = OpenAIServingResponses(chat)
    messages = OpenAIServingMessages(chat)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        if async_engine.structured_output_manager is not None:
            async_engine.structured_output_manager.prepare()
        tasks = [asyncio.ensure_future(_watch_health(async_engine, app))]
        if settings.stats_interval > 0:
            tasks.append(asyncio.ensure_future(_log_stats(async_engine, settings.stats_interval)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await async_engine.shutdown()

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan)
    app.state.async_engine = async_engine
    # The last middleware added runs first: the key is checked before any byte of the body is read.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    if settings.limit_concurrency is not None:
        app.add_middleware(RequestLimitMiddleware, limit=settings.limit_concurrency)
    _add_error_handlers(app)

    if async_engine.config.pooler_config is not None:
        refuse_generation_routes(app)  # before the routes they refuse, so they match first

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if not async_engine.is_healthy:
            return error_response(APIError(503, "the engine is not running", code="engine_unavailable"))
        if not async_engine.is_responsive:
            message = f"the engine has not answered for {async_engine.seconds_since_heard:.0f} s"
            return error_response(APIError(503, message, code="engine_unavailable"))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # Served names only: the weights' and adapters' paths on this machine are nobody else's business.
    @app.get("/v1/models")
    async def list_models() -> Response:
        return Response(ModelList(data=models.cards()).model_dump_json(), media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        return Response(models.card(model_id).model_dump_json(), media_type="application/json")

    if async_engine.config.lora_config is not None:

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
            return Response(await models.load_lora_adapter(request), media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
            return Response(models.unload_lora_adapter(request), media_type="text/plain")

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> Response:
        return _respond(await tokenization.tokenize(request), None)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> Response:
        return _respond(await tokenization.detokenize(request), None)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        result = await completions.create_completion(request, raw_request)
        return _respond(result, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        result = await chat.create_chat_completion(request, raw_request)
        return _respond(result, raw_request)

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return _respond(await responses.create_response(request, raw_request), raw_request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        return _respond(responses.retrieve(response_id), None)

    @app.post("/v1/messages")
    async def create_message(request: MessagesRequest, raw_request: Request) -> Response:
        return _respond(await messages.create_message(request, raw_request), raw_request)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: MessagesCountTokensRequest) -> Response:
        return JSONResponse(await messages.count_tokens(request))

    # Pooling models (--runner pooling); a generating server answers them with a 400 saying so.
    @app.post("/v1/embeddings")
    async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
        return _respond(await pooling.create_embedding(request, raw_request), raw_request)

    @app.post("/pooling")
    async def create_pooling(request: EmbeddingRequest, raw_request: Request) -> Response:
        return _respond(await pooling.create_pooling(request, raw_request), raw_request)

    @app.post("/v1/score")
    @app.post("/score")
    async def create_score(request: ScoreRequest, raw_request: Request) -> Response:
        return _respond(await pooling.create_score(request, raw_request), raw_request)

    @app.post("/v1/rerank")
    @app.post("/rerank")
    @app.post("/v2/rerank")
    async def create_rerank(request: RerankRequest, raw_request: Request) -> Response:
        return _respond(await pooling.create_rerank(request, raw_request), raw_request)

    return app


def _respond(result: BaseModel | dict | AsyncIterator[str], raw_request: Request | None) -> Response:
    request_id = None if raw_request is None else raw_request.headers.get(REQUEST_ID_HEADER)
    headers = {REQUEST_ID_HEADER: request_id} if request_id else None
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream", headers=headers)
    if isinstance(result, dict):
        return JSONResponse(result, headers=headers)
    return Response(result.model_dump_json(), media_type="application/json", headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        # The first problem, named by its field: ("body", "messages", 0, "role") -> messages.0.role.
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            return error_response(APIError(400, f"the request body is not valid JSON: {first['msg']}"))
        path = [str(part) for part in first["loc"] if part != "body"]
        param = path[0] if path else None
        if first["type"] == "extra_forbidden":
            message = f"Unsupported parameter: {'.'.join(path)} (this server does not implement it)"
            return error_response(APIError(400, message, param=param, code="unsupported_parameter"))
        message = f"{'.'.join(path)}: {first['msg']}" if path else first["msg"]
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> Response:
        # Whatever escaped still answers as OpenAI does, with JSON.
        logger.exception("request failed")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}"))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        message = str(exc.detail)
        if exc.status_code in (404, 405) and message in ("Not Found", "Method Not Allowed"):
            # Starlette's bare words: say which route, so a client calling an API this server does
            # not implement (e.g. /v1/embeddings) learns that rather than guessing.
            what = "route" if exc.status_code == 404 else "method for the route"
            message = f"{message}: this server has no {what} {request.method} {request.url.path}"
        return error_response(APIError(exc.status_code, message, code=code))


async def _watch_health(engine: AsyncLLMEngine, app: FastAPI) -> None:
    while engine.is_healthy:
        await asyncio.sleep(HEALTH_CHECK_INTERVAL_S)
    logger.error("the engine stopped serving: %s", engine.dead_reason())
    on_engine_dead = getattr(app.state, "on_engine_dead", None)
    if on_engine_dead is not None:
        on_engine_dead()


async def _log_stats(engine: AsyncLLMEngine, interval: float) -> None:
    stats_logger = StatsLogger(interval)
    while True:
        await asyncio.sleep(interval)
        stats_logger.log(engine.stats)


def default_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model:
        # The directory's or file's name, not its path on this machine.
        return os.path.basename(os.path.normpath(args.model)) or args.model
    # The embedded model's name without its quantization and extension.
    return EMBEDDED_MODEL_FILE.split(".")[0]


class _Server(uvicorn.Server):
    """uvicorn's server, ending open streams with an error event as shutdown begins (rather than
    cutting them when the grace period ends)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine) -> None:
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets: list | None = None) -> None:
        self.engine.fail_all_requests("the server is shutting down")
        await super().shutdown(sockets)


def run_server(
    args: argparse.Namespace,
    sock: socket.socket,
    lora_modules: list[tuple[str, str, str | None]],
    started: StartedEngineCore | None,
) -> None:
    """Serve on ``sock`` (bound, not listening) until interrupted: the engine core ``started`` in
    processes of its own (``cli.main`` starts it before importing this module), or with None one
    built here from the EngineArgs flags in ``args``, stepped by a thread of this process."""
    if started is not None:
        async_engine = AsyncLLMEngine.from_started_core(started)
        load_seconds = time.perf_counter() - started.start_time
    else:
        start = time.perf_counter()
        async_engine = AsyncLLMEngine(LLMEngine.from_engine_args(EngineArgs.from_cli_args(args)))
        load_seconds = time.perf_counter() - start
    logger.info("%s", engine_summary(async_engine.config, async_engine.stats.num_gpu_blocks, load_seconds))
    settings = ServerSettings(
        model_name=default_model_name(args),
        api_key=args.api_key,
        max_request_body_bytes=args.max_request_body_bytes,
        stats_interval=args.stats_interval,
        limit_concurrency=args.limit_concurrency,
        trust_request_chat_template=args.trust_request_chat_template,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        lora_modules=lora_modules,
        reasoning_parser=args.reasoning_parser,
    )
    try:
        app = build_app(async_engine, settings)
    except ValueError as e:  # an adapter of --lora-modules that cannot run
        async_engine.close()
        raise SystemExit(f"pagedllm serve: {e}") from e
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        timeout_keep_alive=args.timeout_keep_alive,
        # --limit-concurrency is RequestLimitMiddleware's: uvicorn's would count idle connections.
        http=HeaderTimeoutH11Protocol,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )
    server = _Server(config, async_engine)
    # The server's own heap (FastAPI, pydantic, torch's modules) out of every later collection.
    freeze_startup_heap()
    engine_died = False

    def on_engine_dead() -> None:
        nonlocal engine_died
        engine_died = server.should_exit = True

    app.state.on_engine_dead = on_engine_dead
    logger.info("serving %s on http://%s:%d", settings.model_name, args.host, args.port)
    # uvicorn shuts down gracefully on Ctrl-C, then raises it again: that is a normal exit here.
    try:
        with contextlib.suppress(KeyboardInterrupt):
            server.run(sockets=[sock])
    finally:
        async_engine.close()
    if engine_died:
        raise SystemExit("pagedllm serve: the engine died (see the log above); the server stopped")
