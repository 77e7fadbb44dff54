"""Bounds on connections, below HTTP requests: what uvicorn's settings do not cover.

A request reaches the app (and its API key check) only once its head, the request line
and headers, has arrived whole. Until then the connection costs a file descriptor and
nothing bounds it: a client that opens connections and sends a header byte every few
seconds (slowloris), or nothing at all, holds them as long as it likes, until the
process runs out of file descriptors and no one, not even `/health`, gets in. uvicorn
bounds the idle time between two requests on one connection (`timeout_keep_alive`) and
the size of a head (h11's `max_incomplete_event_size`), but not the time a head takes
to arrive, nor the number of connections (its `limit_concurrency` answers 503 only to
requests, so a connection still holds its descriptor until it sends one).

`bounded_protocol` is uvicorn's h11 protocol with both:

* a connection must deliver a whole request head within `head_timeout` seconds of
  opening, or of its previous response ending; otherwise it is closed;
* past `max_connections` open connections, a new one is answered 503 (in OpenAI's
  error shape) and closed at once;
* past `max_per_client` open connections from one client address, so is a new one from
  there: one client reopening half-sent heads as fast as they are closed held most of
  the connections, and `/health` answered others about half the time. The
  addresses uvicorn trusts as proxies (its `forwarded_allow_ips`: 127.0.0.1 and ::1
  unless told otherwise) are many clients and are not bounded so; a proxy elsewhere
  is one address to this bound: raise it there.

Above HTTP, `client_of` names a request's client the same way (the address a trusted
proxy forwarded for, or None: one of many clients behind a proxy), for the bounds each
client has a share of: its constraints compiling (compiles.py) and its requests waiting
for a first token (engine_thread.py).

When the process does run out of descriptors anyway (a low `ulimit -n`), asyncio logs
every failed accept with a traceback, thousands a second;
`QuietResourceErrors` lets one such line through per interval.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import time

from starlette.requests import Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from roseinfer.serving.errors import error_body

DEFAULT_HEAD_TIMEOUT_S = 10.0  # a request head is a few hundred bytes
DEFAULT_MAX_CONNECTIONS = 512  # well below the usual 1,024 open files of a process
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 64  # from one address (an eighth of the default above)
DEFAULT_PROXIES = "127.0.0.1,::1"  # uvicorn's default forwarded_allow_ips
RESOURCE_LOG_INTERVAL_S = 60.0


def bounded_protocol(
    head_timeout: float,
    max_connections: int,
    max_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
    proxies: str | list[str] = DEFAULT_PROXIES,
) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a time bound on request heads and bounds on open
    connections, overall and per client address, the addresses of `proxies` (uvicorn's
    `forwarded_allow_ips`: a list, or comma-separated) aside (pass it as
    `uvicorn.Config(http=...)`)."""
    per_client: dict[str, int] = {}  # open connections by client address
    trusted = proxy_set(proxies)

    class BoundedH11Protocol(H11Protocol):
        head_timer: asyncio.TimerHandle | None = None
        counted: str | None = None  # the client address it counts against

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            host = one_client(self.client[0] if self.client else None, trusted)
            if len(self.connections) > max_connections:
                refuse = too_many_connections(max_connections)
            elif host is not None and per_client.get(host, 0) >= max_per_client:
                refuse = too_many_connections(max_per_client, per_client=True)
            else:
                if host is not None:
                    self.counted = host
                    per_client[host] = per_client.get(host, 0) + 1
                self._wait_for_a_head()
                return
            transport.write(refuse)
            transport.close()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a whole head arrived: its request runs now
                self._stop_waiting()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (
                self.cycle is None or self.cycle.response_complete
            ):
                self._wait_for_a_head()  # the next request's head is bounded too

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_waiting()
            if self.counted is not None:
                per_client[self.counted] -= 1
                if not per_client[self.counted]:
                    del per_client[self.counted]
                self.counted = None
            super().connection_lost(exc)

        def _wait_for_a_head(self) -> None:
            self._stop_waiting()
            self.head_timer = self.loop.call_later(head_timeout, self.transport.close)

        def _stop_waiting(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

    return BoundedH11Protocol


def proxy_set(proxies: str | list[str]) -> set[str]:
    """uvicorn's `forwarded_allow_ips` (a list, or comma-separated) as a set."""
    names = proxies.split(",") if isinstance(proxies, str) else proxies
    return {name.strip() for name in names}


def one_client(host: str | None, trusted: set[str]) -> str | None:
    """`host`, unless it is a trusted proxy: many clients, bounded by no per-client share."""
    return None if host is None or host in trusted or "*" in trusted else host


def client_of(request: Request, trusted: set[str]) -> str | None:
    """The client a request counts against: its address, as uvicorn read it (behind a
    trusted proxy, the address the proxy forwarded for); None for a trusted proxy's own
    requests, which may be anyone's (a local client without X-Forwarded-For, on the
    default settings)."""
    return one_client(request.client.host if request.client else None, trusted)


def too_many_connections(limit: int, per_client: bool = False) -> bytes:
    """A whole HTTP/1.1 503 response, written before any request was read."""
    held = (
        f"this client holds {limit} connections to the server already "
        "(--max-connections-per-client): close some, or try again later"
        if per_client
        else f"the server holds {limit} connections already (--max-connections): try again later"
    )
    body = json.dumps(error_body(held, type="server_error")).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class QuietResourceErrors(logging.Filter):
    """Out of file descriptors, asyncio logs each failed accept with a traceback: let one
    line through per interval, saying how many were held back, and no traceback."""

    def __init__(self, interval: float = RESOURCE_LOG_INTERVAL_S) -> None:
        super().__init__()
        self.interval, self.last, self.held_back = interval, -float("inf"), 0

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, OSError) or error.errno not in (errno.EMFILE, errno.ENFILE):
            return True
        now = time.monotonic()
        if now - self.last < self.interval:
            self.held_back += 1
            return False
        held_back, self.last, self.held_back = self.held_back, now, 0
        record.msg = (
            f"{error.strerror}: new connections wait (at most one such line every "
            f"{self.interval:.0f} s; {held_back} held back): raise the open-file limit "
            "(ulimit -n) or lower --max-connections"
        )
        record.args, record.exc_info, record.exc_text = (), None, None
        return True
