"""Running a checked request through the engine thread and answering it.

Non-streamed: wait for every choice's last output (giving up, and aborting, if the
client goes away), then one JSON response. Streamed: wait for the first output the
same way, then one server-sent event per output that adds text or ends a choice, then
[DONE]. Whatever ends a request early — its client leaving, the engine failing it, the
server shutting down — its engine requests are aborted, so their blocks go back, and
the client that is still there gets a complete answer: an OpenAI-shaped error (500
JSON, or an error event followed by [DONE] on a stream).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from roseinfer.engine.outputs import RequestOutput, TokenLogprob
from roseinfer.request.structured import Grammar
from roseinfer.serving.checks import Job
from roseinfer.serving.engine_thread import EngineClient, QueueFull
from roseinfer.serving.errors import (
    BadRequest,
    ClientGone,
    error_body,
    error_response,
    server_error,
)
from roseinfer.serving.metrics import ServerMetrics
from roseinfer.serving.protocol import SamplingFields
from roseinfer.serving.responses import ResponseBuilder, usage
from rosetrainer.errors import RoseError

T = TypeVar("T")
Outputs = AsyncIterator[tuple[int, RequestOutput]]

# How often a handler waiting for the engine checks whether its client is still there.
DISCONNECT_POLL_S = 0.2
RETRY_AFTER_S = 1  # what a 503 tells the client to wait


class EngineFailed(Exception):
    """The engine finished a request with an error (RequestOutput.error)."""


async def answer(
    request: Request,
    client: EngineClient,
    metrics: ServerMetrics,
    body: SamplingFields,
    jobs: list[Job],
    prompt_tokens: int,
    builder: ResponseBuilder,
    grammar: Grammar | None = None,
    sender: str | None = None,
) -> Response:
    """Run the request's jobs (one per prompt and choice) and answer: JSON, or a stream.

    grammar: the jobs' structured output, compiled by the handler. The engine finds it
    in the compile cache by its key; holding it here until this returns (the engine has
    made every job's matcher by the first output) keeps the cache from dropping it
    before, so a grammar is never compiled on the engine thread. sender: the client whose
    share of the waiting queue the jobs take (connections.client_of).
    """
    outputs = client.generate(builder.request_id, jobs, sender)
    try:
        if not body.stream:
            finals = await unless_disconnected(request, last_outputs(outputs, len(jobs)))
            return JSONResponse(builder.response(finals, prompt_tokens))
        first = await unless_disconnected(request, anext(outputs))
        if first[1].error is not None:  # nothing sent yet: the error can be the whole answer
            await outputs.aclose()
            raise EngineFailed(first[1].error)
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
    except EngineFailed as err:
        return server_error(str(err))
    except Exception as err:  # the engine thread failed every request in flight (a bug)
        return server_error(f"the engine failed: {err}")
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    usage_tokens = prompt_tokens if include_usage else None
    events = stream_events(builder, first, outputs, len(jobs), usage_tokens)
    return StreamingResponse(events, media_type="text/event-stream")


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


async def last_outputs(outputs: Outputs, n: int) -> list[RequestOutput]:
    """Run every choice to its end; each one's final output, in order. A choice the
    engine failed fails the request (the others are aborted on the way out)."""
    finals: list[RequestOutput | None] = [None] * n
    async with aclosing(outputs):
        async for index, output in outputs:
            if output.error is not None:
                raise EngineFailed(output.error)
            finals[index] = output
    return finals


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n"


async def stream_events(
    builder: ResponseBuilder,
    first: tuple[int, RequestOutput],
    outputs: Outputs,
    n: int,
    usage_prompt_tokens: int | None,
) -> AsyncIterator[str]:
    """One event per output that adds text or finishes a choice, then (when asked for)
    usage, then [DONE]. A choice the engine failed ends the stream with an error event
    and [DONE]. Closing this generator (the client went away) closes `outputs`, which
    aborts every choice still running."""
    sent_text = [len(e) for e in builder.echo]  # characters of each choice already sent
    # Each choice's logprobs not sent yet: an output whose text is held back (a possible
    # stop string, half a character) sends no event; its tokens' logprobs go with the next.
    unsent_logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
    completion_tokens = [0] * n
    async with aclosing(outputs):
        if builder.chat:
            yield sse(builder.chunk([builder.role_choice(i) for i in range(n)]))
        elif any(builder.echo):
            echoed = [builder.delta_choice(i, builder.echo[i], None, 0, None) for i in range(n)]
            yield sse(builder.chunk(echoed))
        item: tuple[int, RequestOutput] | None = first
        while item is not None:
            index, out = item
            if out.error is not None:
                yield sse(error_body(out.error, type="server_error"))
                break
            # (Outputs are deltas: the engine thread adds every request as DELTA.)
            completion_tokens[index] += len(out.new_token_ids)
            if out.new_logprobs is not None:
                unsent_logprobs[index] += out.new_logprobs
            if out.new_text or out.finished:
                new_logprobs = None
                if out.new_logprobs is not None:  # (asked for)
                    new_logprobs, unsent_logprobs[index] = unsent_logprobs[index], []
                choice = builder.delta_choice(
                    index,
                    out.new_text,
                    new_logprobs,
                    sent_text[index],
                    out.finish_reason if out.finished else None,
                )
                sent_text[index] += len(out.new_text)
                yield sse(builder.chunk([choice]))
            try:
                item = await anext(outputs, None)
            except Exception as err:  # the engine thread failed every request (a bug)
                yield sse(error_body(f"the engine failed: {err}", type="server_error"))
                break
        else:
            if usage_prompt_tokens is not None:
                total = sum(completion_tokens)
                yield sse(builder.chunk([], usage(usage_prompt_tokens, total)))
    yield sse("[DONE]")
