"""Bounds on the request body, as a plain ASGI wrapper around the app.

A body is read into memory and parsed as JSON before any handler runs, and what it
holds (prompts, stop strings) is work for the event loop and the engine: a client
must not be able to send megabytes. The wrapper reads at most `max_bytes` (refusing a
larger declared Content-Length before reading anything) and answers 413 in OpenAI's
shape; below the bound it hands the body on untouched. Nor may a client take as long as
it likes to send it (a slow body holds a connection as a slow head does, see
connections.py): a body not whole within `timeout` seconds gets 408. Being plain ASGI,
the wrapper passes the connection's later messages (a disconnect) straight through.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from roseinfer.serving.errors import error_response

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a full context of prompt text is a few KiB
DEFAULT_BODY_TIMEOUT_S = 30.0  # a few KiB of JSON, even over a slow link


class BodyLimit:
    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int = DEFAULT_MAX_BODY_BYTES,
        timeout: float = DEFAULT_BODY_TIMEOUT_S,
    ) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        body, more = bytearray(), True
        deadline = asyncio.get_running_loop().time() + self.timeout
        while more:
            try:
                message = await asyncio.wait_for(
                    receive(), deadline - asyncio.get_running_loop().time()
                )
            except asyncio.TimeoutError:
                return await self._too_slow(scope, receive, send)
            if message["type"] != "http.request":  # the client left while sending
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self._refuse(scope, receive, send)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # what comes after the body: a disconnect
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        return await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413,
            f"the request body is larger than {self.max_bytes} bytes: send a shorter request",
            code="request_too_large",
        )
        await response(scope, receive, send)

    async def _too_slow(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            408,
            f"the request body did not arrive within {self.timeout:g} s: send it at once",
            code="request_timeout",
            headers={"Connection": "close"},
        )
        await response(scope, receive, send)
