"""The API key, checked as a dependency of every route (not as an HTTP middleware:
Starlette's `BaseHTTPMiddleware` sits between the handler and the connection, and
hides a client's disconnect from `request.is_disconnected()`, so a non-streamed
request whose client left would run to its end)."""

from __future__ import annotations

import secrets
from collections.abc import Callable

from fastapi import Request

from roseinfer.serving.errors import BadRequest

# Open without the API key: liveness probes and Prometheus scrapers carry no token.
OPEN_PATHS = ("/health", "/metrics")


def api_key_check(
    api_key: str | None, open_paths: tuple[str, ...] = OPEN_PATHS
) -> Callable[[Request], None]:
    """A FastAPI dependency: a request without `Authorization: Bearer <api_key>` -> 401,
    except on `open_paths`."""
    expected = f"Bearer {api_key}".encode()

    def check(request: Request) -> None:
        # The path as routed: behind a proxy's prefix (--root-path), without it.
        path = request.scope["path"].removeprefix(request.scope.get("root_path", ""))
        if api_key is None or path in open_paths:
            return
        given = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(given, expected):
            raise BadRequest(
                "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                status=401,
                code="invalid_api_key",
            )

    return check
