"""The FastAPI application: OpenAI's endpoints over one engine thread.

A request's life: the handler checks and tokenizes it (checks.py), turns its fields
into one engine job per choice, and hands them to the engine thread; the engine
schedules them into blocks and steps; each output comes back through the request's
asyncio queue and leaves as a JSON response or a server-sent event (handling.py). If
the client goes away first, the engine requests are aborted and their blocks return to
the pool at once. Errors are OpenAI-shaped (errors.py); the API key is a dependency of
every route (auth.py); bodies are bounded before any of this runs (limits.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.request import grammar_process
from roseinfer.serving import live
from roseinfer.serving.auth import OPEN_PATHS, api_key_check
from roseinfer.serving.chat_template import ChatTemplate, ChatTemplateFailed
from roseinfer.serving.checks import TOKENIZING, RequestChecks
from roseinfer.serving.compiles import DEFAULT_PER_CLIENT as DEFAULT_COMPILES_PER_CLIENT
from roseinfer.serving.compiles import Compiles
from roseinfer.serving.connections import DEFAULT_PROXIES, client_of, proxy_set
from roseinfer.serving.engine_thread import EngineClient, EngineThread
from roseinfer.serving.errors import (
    BadRequest,
    error_response,
    install_error_handlers,
    server_error,
)
from roseinfer.serving.handling import answer, unless_disconnected
from roseinfer.serving.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, BodyLimit
from roseinfer.serving.metrics import ServerMetrics
from roseinfer.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from roseinfer.serving.responses import ResponseBuilder
from rosetrainer.errors import RoseError
from rosetrainer.threads import Threads
from rosetrainer.tokenizer import Tokenizer


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    max_waiting: int = 256  # choices admitted but without a first token, at most
    # of them from one client (None: a quarter of max_waiting, at least 1)
    max_waiting_per_client: int | None = None
    max_compiles_per_client: int = DEFAULT_COMPILES_PER_CLIENT  # new constraints at once
    # the proxies uvicorn trusts (its forwarded_allow_ips): many clients, no one's share
    proxies: str = DEFAULT_PROXIES
    api_key: str | None = None
    chat_template: ChatTemplate | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S  # seconds a request body may take to arrive
    live_page: bool = True  # the page at / and its /live/* state endpoints
    max_live_watchers: int = live.MAX_WATCHERS  # /live/events streams at once
    max_live_watchers_per_client: int = live.MAX_WATCHERS_PER_CLIENT  # from one address
    threads: Threads | None = None  # the engine thread's torch threads (see engine_thread.py)


def build_app(engine: LLMEngine, tokenizer: Tokenizer, settings: ServerSettings) -> FastAPI:
    engine_thread = EngineThread(engine, threads=settings.threads)
    metrics = ServerMetrics(lambda: engine_thread.stats)
    engine_thread.on_finished = metrics.observe_finished
    per_client = settings.max_waiting_per_client or max(1, settings.max_waiting // 4)
    client = EngineClient(engine_thread, settings.max_waiting, per_client)
    chat_template = settings.chat_template or ChatTemplate()
    config = engine.model.config
    checks = RequestChecks(
        tokenizer,
        settings.model_name,
        config.block_size,
        config.vocab_size,
        settings.max_waiting,
        speculative=engine.num_speculative_tokens is not None,
        length_limit=engine.length_limit,
        max_waiting_per_client=per_client,
        compiles=Compiles(tokenizer, config.vocab_size, settings.max_compiles_per_client),
    )
    proxies = proxy_set(settings.proxies)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine_thread.start()
        yield
        engine_thread.stop()
        # A constraint still compiling is killed with its worker: the process's exit
        # never waits on it (roseinfer/request/grammar_process.py).
        grammar_process.pool.stop()
        checks.compiles.close()

    # The live page's files hold no data (it asks for the key, then sends it): open too.
    key_check = api_key_check(settings.api_key, (*OPEN_PATHS, *live.OPEN_PATHS))
    # FastAPI's own /docs, /redoc and /openapi.json would skip the app's dependencies, so
    # anyone could read them past --api-key: they are declared below as routes like the rest.
    app = FastAPI(
        title="rose",
        lifespan=lifespan,
        dependencies=[Depends(key_check)],
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.engine_thread = engine_thread  # the server's shutdown aborts what is left
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, timeout=settings.body_timeout)
    install_error_handlers(app)
    if settings.live_page:
        app.state.live = live.LiveState(
            engine, settings.max_live_watchers, settings.max_live_watchers_per_client
        )
        engine_thread.on_step = app.state.live.after_step
        app.include_router(live.live_router(app.state.live))

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        checks.model(body.model)
        if body.echo and body.logprobs is not None:
            raise BadRequest("echo with logprobs is not supported (no prompt logprobs)", "echo")
        sender = client_of(request, proxies)
        given = await checks.prompt_ids(body.prompt)
        prompts = [checks.prompt(ids) for ids in given]
        echo = [tokenizer.decode(ids) if body.echo else "" for ids in given for _ in range(body.n)]
        builder = ResponseBuilder(
            f"cmpl-{uuid.uuid4().hex}", settings.model_name, tokenizer, chat=False, echo=echo
        )
        # (a compile takes seconds: a client that leaves meanwhile gives back its budget)
        constraint, grammar = await unless_disconnected(request, checks.constraint(body, sender))
        jobs = checks.jobs(body, prompts, body.logprobs, constraint, sender)
        prompt_tokens = sum(map(len, prompts))
        return await answer(
            request, client, metrics, body, jobs, prompt_tokens, builder, grammar, sender
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        checks.model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise BadRequest(
                "top_logprobs needs logprobs: true (set both, or neither)", "top_logprobs"
            )
        sender = client_of(request, proxies)
        checks.conversation_fits(body.messages)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            text = await chat_template.render_off_loop(messages)
        except RoseError as err:
            raise BadRequest(str(err), "messages") from None
        except ChatTemplateFailed as err:
            return server_error(str(err))
        prompt = checks.prompt(await checks.encode(text, "messages"))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        builder = ResponseBuilder(
            f"chatcmpl-{uuid.uuid4().hex}",
            settings.model_name,
            tokenizer,
            chat=True,
            echo=[""] * body.n,
        )
        # (a compile takes seconds: a client that leaves meanwhile gives back its budget)
        constraint, grammar = await unless_disconnected(request, checks.constraint(body, sender))
        jobs = checks.jobs(body, [prompt], logprobs, constraint, sender)
        return await answer(
            request, client, metrics, body, jobs, len(prompt), builder, grammar, sender
        )

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": settings.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "rose",
            "max_model_len": config.block_size,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        if engine_thread.alive:
            return JSONResponse({"status": "ok"})
        return error_response(503, "the engine thread is not running", type="server_error")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=openapi_url(request), title="rose API")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        return get_redoc_html(openapi_url=openapi_url(request), title="rose API")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        checks.model(body.model)
        ids = await asyncio.get_running_loop().run_in_executor(
            TOKENIZING, tokenizer.encode, body.prompt
        )
        return {"tokens": ids, "count": len(ids), "max_model_len": config.block_size}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        checks.model(body.model)
        checks.token_ids(body.tokens, "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    return app


def openapi_url(request: Request) -> str:
    """Where the API's description is, as the browser must ask for it (behind a proxy's
    path prefix: --root-path)."""
    return request.scope.get("root_path", "") + "/openapi.json"
