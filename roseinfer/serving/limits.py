"""A bound on the request body, as a plain ASGI wrapper around the app.

A body is read into memory and parsed as JSON before any handler runs, and what it
holds (prompts, stop strings) is work for the event loop and the engine: a client
must not be able to send megabytes. The wrapper reads at most `max_bytes` (refusing a
larger declared Content-Length before reading anything) and answers 413 in OpenAI's
shape; below the bound it hands the body on untouched. Being plain ASGI, it passes
the connection's later messages (a disconnect) straight through.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from roseinfer.serving.errors import error_response

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a full context of prompt text is a few KiB


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        body, more = bytearray(), True
        while more:
            message = await receive()
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
