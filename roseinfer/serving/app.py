"""The FastAPI application: OpenAI's endpoints over one engine thread.

A request's life: the handler checks and tokenizes it, turns its fields into
`SamplingParams`, and hands one engine request per choice to the engine thread; the
engine schedules it into blocks and steps; each output comes back through the
request's asyncio queue and leaves as a JSON response or a server-sent event. If the
client goes away first, leaving the output loop aborts the engine requests, and their
blocks return to the pool at once.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.engine.outputs import RequestOutput
from roseinfer.request.sampling_params import SamplingParams
from roseinfer.serving import live
from roseinfer.serving.chat_template import ChatTemplate
from roseinfer.serving.engine_thread import EngineClient, EngineThread, QueueFull
from roseinfer.serving.metrics import ServerMetrics
from roseinfer.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    error_response,
)
from roseinfer.serving.responses import ResponseBuilder, usage
from rosetrainer.errors import RoseError
from rosetrainer.tokenizer import Tokenizer

T = TypeVar("T")

# Open without the API key: liveness probes and Prometheus scrapers carry no token; the
# live page's files hold no data (it asks for the key, then sends it).
OPEN_PATHS = ("/health", "/metrics", *live.OPEN_PATHS)
# How often a handler waiting for the engine checks whether its client is still there.
DISCONNECT_POLL_S = 0.2
RETRY_AFTER_S = 1  # what a 503 tells the client to wait


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    max_waiting: int = 256  # choices admitted but without a first token, at most
    api_key: str | None = None
    chat_template: ChatTemplate | None = None
    live_page: bool = True  # the page at / and its /live/* state endpoints


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


def build_app(engine: LLMEngine, tokenizer: Tokenizer, settings: ServerSettings) -> FastAPI:
    engine_thread = EngineThread(engine)
    metrics = ServerMetrics(lambda: engine_thread.stats)
    engine_thread.on_finished = metrics.observe_finished
    client = EngineClient(engine_thread, settings.max_waiting)
    chat_template = settings.chat_template or ChatTemplate()
    block_size = engine.model.config.block_size
    vocab_size = engine.model.config.vocab_size

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine_thread.start()
        yield
        engine_thread.stop()

    app = FastAPI(title="rose", lifespan=lifespan)
    if settings.live_page:
        app.state.live = live.LiveState(engine)
        engine_thread.on_step = app.state.live.after_step
        app.include_router(live.live_router(app.state.live))

    # -- errors, all in OpenAI's shape --

    @app.exception_handler(RequestValidationError)
    async def invalid_fields(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = [str(part) for part in first["loc"] if part != "body"]
        param = ".".join(where) or None
        message = f"{param}: {first['msg']}" if param else first["msg"]
        return error_response(400, message, param=param)

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        code = "model_not_found" if exc.status == 404 else None
        return error_response(exc.status, str(exc), param=exc.param, code=code)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):  # noqa: ANN202 (starlette's types)
        if settings.api_key is None or request.url.path in OPEN_PATHS:
            return await call_next(request)
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {settings.api_key}".encode()):
            return error_response(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        return await call_next(request)

    # -- checking a request --

    def check_model(name: str | None) -> None:
        if name is not None and name != settings.model_name:
            raise BadRequest(
                f"model {name!r} does not exist here; this server serves {settings.model_name!r}",
                param="model",
                status=404,
            )

    def check_prompt(ids: list[int]) -> list[int]:
        if any(t >= vocab_size for t in ids):
            raise BadRequest(f"token ids must be below the vocabulary size {vocab_size}", "prompt")
        if len(ids) > block_size:
            raise BadRequest(
                f"the prompt has {len(ids)} tokens but the model's context window is "
                f"{block_size}: shorten the prompt",
                param="prompt",
            )
        return ids

    def sampling_params(body: SamplingFields, logprobs: int | None, choice: int) -> SamplingParams:
        """The request's fields as the engine's SamplingParams; choice j of n > 1 with a
        seed samples with seed + j, so the choices differ yet repeat under one seed."""
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_k=max(body.top_k, 0),
                top_p=body.top_p,
                seed=None if body.seed is None else body.seed + choice,
                stop=body.stop or (),
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
            )
        except RoseError as err:
            raise BadRequest(str(err)) from None

    # -- running it --

    async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
        """Await the engine's answer, but give up (and abort) if the client goes away."""
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise ClientGone
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def run(
        request: Request,
        body: SamplingFields,
        prompts: list[list[int]],
        logprobs: int | None,
        builder: ResponseBuilder,
    ) -> Response:
        jobs = [(ids, sampling_params(body, logprobs, j)) for ids in prompts for j in range(body.n)]
        prompt_tokens = sum(map(len, prompts))
        outputs = client.generate(builder.request_id, jobs)
        try:
            if not body.stream:
                finals = await unless_disconnected(request, last_outputs(outputs, len(jobs)))
                return JSONResponse(builder.response(finals, prompt_tokens))
            first = await unless_disconnected(request, anext(outputs))
        except QueueFull as err:
            metrics.rejected.inc()
            return error_response(
                503,
                f"the server is at capacity ({err}); retry after {RETRY_AFTER_S} s",
                type="server_overloaded",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        except RoseError as err:  # what the engine refused at admission
            raise BadRequest(str(err)) from None
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; nginx's "client closed"
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        usage_tokens = prompt_tokens if include_usage else None
        events = stream_events(builder, first, outputs, len(jobs), usage_tokens)
        return StreamingResponse(events, media_type="text/event-stream")

    # -- endpoints --

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        check_model(body.model)
        if body.echo and body.logprobs is not None:
            raise BadRequest("echo with logprobs is not supported (no prompt logprobs)", "echo")
        prompts = [check_prompt(ids) for ids in prompt_ids(body.prompt)]
        echo = [
            tokenizer.decode(ids) if body.echo else "" for ids in prompts for _ in range(body.n)
        ]
        builder = ResponseBuilder(
            f"cmpl-{uuid.uuid4().hex}", settings.model_name, tokenizer, chat=False, echo=echo
        )
        return await run(request, body, prompts, body.logprobs, builder)

    def prompt_ids(prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            return [tokenizer.encode(prompt)]
        if not prompt:
            raise BadRequest("prompt is an empty list: give a string or token ids", "prompt")
        if isinstance(prompt[0], str):
            return [tokenizer.encode(text) for text in prompt]
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return [list(ids) for ids in prompt]

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        check_model(body.model)
        try:
            text = chat_template.render([m.model_dump(exclude_none=True) for m in body.messages])
        except RoseError as err:
            raise BadRequest(str(err), "messages") from None
        prompt = check_prompt(tokenizer.encode(text))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        builder = ResponseBuilder(
            f"chatcmpl-{uuid.uuid4().hex}",
            settings.model_name,
            tokenizer,
            chat=True,
            echo=[""] * body.n,
        )
        return await run(request, body, [prompt], logprobs, builder)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": settings.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "rose",
            "max_model_len": block_size,
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

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(body.model)
        ids = tokenizer.encode(body.prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": block_size}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(body.model)
        if any(t >= vocab_size for t in body.tokens):
            raise BadRequest(f"token ids must be below the vocabulary size {vocab_size}", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    return app


async def last_outputs(
    outputs: AsyncIterator[tuple[int, RequestOutput]], n: int
) -> list[RequestOutput]:
    """Run every choice to its end; each one's final output, in order."""
    finals: list[RequestOutput | None] = [None] * n
    async with aclosing(outputs):
        async for index, output in outputs:
            finals[index] = output
    return finals


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n"


async def stream_events(
    builder: ResponseBuilder,
    first: tuple[int, RequestOutput],
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    n: int,
    usage_prompt_tokens: int | None,
) -> AsyncIterator[str]:
    """One event per output that adds text or finishes a choice, then (when asked for)
    usage, then [DONE]. Closing this generator (the client went away) closes `outputs`,
    which aborts every choice still running."""
    sent_text = [0] * n  # characters of each choice's text already sent
    sent_logprobs = [0] * n
    completion_tokens = [0] * n
    async with aclosing(outputs):
        if builder.chat:
            yield sse(builder.chunk([builder.role_choice(i) for i in range(n)]))
        elif any(builder.echo):
            echoed = [builder.delta_choice(i, builder.echo[i], None, 0, None) for i in range(n)]
            yield sse(builder.chunk(echoed))
        sent_text = [len(e) for e in builder.echo]
        item: tuple[int, RequestOutput] | None = first
        while item is not None:
            index, out = item
            completion_tokens[index] = len(out.token_ids)
            if out.new_text or out.finished:
                new_logprobs = None
                if out.logprobs is not None:
                    new_logprobs = out.logprobs[sent_logprobs[index] :]
                    sent_logprobs[index] = len(out.logprobs)
                choice = builder.delta_choice(
                    index,
                    out.new_text,
                    new_logprobs,
                    sent_text[index],
                    out.finish_reason if out.finished else None,
                )
                sent_text[index] += len(out.new_text)
                yield sse(builder.chunk([choice]))
            item = await anext(outputs, None)
    if usage_prompt_tokens is not None:
        yield sse(builder.chunk([], usage(usage_prompt_tokens, sum(completion_tokens))))
    yield sse("[DONE]")
