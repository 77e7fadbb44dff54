"""The server against a hostile client and a careless operator (issue 33): slow request
heads and too many connections, the live page's watchers, the page behind a path prefix,
a windowed request's blocks on the page, and the API docs behind the key.

Real servers on 127.0.0.1 at a free port: a `rose-serve` subprocess where the flags are
under test, an in-process app (roseinfer.serving.background) where the test must look
inside the engine or the page's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import resource
import selectors
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urljoin

import httpx
import pytest
from models import make_test_model
from servers import API_KEY, Server, is_openai_error, running_server, write_test_checkpoint
from starlette.applications import Starlette
from starlette.routing import Mount

from roseinfer.engine.block_manager import FREED
from roseinfer.engine.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.request.sampling_params import SamplingParams
from roseinfer.serving import live
from roseinfer.serving.app import ServerSettings, build_app
from roseinfer.serving.background import BackgroundServer
from rosetrainer.model import GPT
from rosetrainer.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HEAD_TIMEOUT_S = 2
MAX_CONNECTIONS = 8
SLACK_S = 5  # a loaded CI machine's delay on top of a bound
KEY = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT]:
    path = tmp_path_factory.mktemp("hardening") / "tiny.pt"
    return path, write_test_checkpoint(path)


@pytest.fixture(scope="module")
def server(checkpoint: tuple[Path, GPT], tmp_path_factory: pytest.TempPathFactory) -> Server:
    log = tmp_path_factory.mktemp("hardening-log") / "server.log"
    flags = ["--api-key", API_KEY, "--request-head-timeout", str(HEAD_TIMEOUT_S),
             "--request-body-timeout", str(HEAD_TIMEOUT_S), "--max-connections",
             str(MAX_CONNECTIONS), "--root-path", "/rose"]  # fmt: skip
    with running_server(checkpoint[0], log, *flags) as running:
        yield running


def wait_until_served(server: Server) -> None:
    """/health again, once the connections a test held are gone. `Connection: close`: the
    server closes this one itself, so it is not counted among the next test's."""
    deadline = time.monotonic() + HEAD_TIMEOUT_S + SLACK_S
    while True:
        with contextlib.suppress(httpx.HTTPError):
            health = httpx.get(server.url + "/health", headers={"Connection": "close"}, timeout=1)
            if health.status_code == 200:
                return
        assert time.monotonic() < deadline, "the server did not serve again"
        time.sleep(0.1)


# -- class 3: slow and idle connections, and how many the server holds --


def open_connection(server: Server, first_bytes: bytes) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(first_bytes)
    return sock


def read_until_closed(sock: socket.socket) -> str:
    """Everything the server sends before it closes the connection. (One recv may return
    the head alone: the server may write the head and the body in two segments.)"""
    chunks = []
    while chunk := sock.recv(4096):
        chunks.append(chunk)
    return b"".join(chunks).decode()


def seconds_until_closed(socks: list[socket.socket], dribble: bool) -> list[float]:
    """Send one header byte every 0.2 s on each (if `dribble`) until the server closes
    it; how long each stayed open."""
    start, closed = time.monotonic(), {}
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        while len(closed) < len(socks) and time.monotonic() - start < 30:
            for key, _ in selector.select(timeout=0.2):
                with contextlib.suppress(OSError):
                    if key.fileobj.recv(4096):
                        continue  # a response: the server answered (it must not have)
                closed[key.fileobj] = time.monotonic() - start
                selector.unregister(key.fileobj)
            for sock in socks:
                if dribble and sock not in closed:
                    with contextlib.suppress(OSError):
                        sock.sendall(b"x")
    for sock in socks:
        sock.close()
    return [closed.get(sock, float("inf")) for sock in socks]


@pytest.mark.slow
def test_a_head_sent_slowly_or_never_is_closed_in_time_and_health_still_answers(
    server: Server,
) -> None:
    wait_until_served(server)
    dribblers = [open_connection(server, b"GET /health HTTP/1.1\r\nX-Slow: ") for _ in range(4)]
    silent = [open_connection(server, b"") for _ in range(2)]
    health = httpx.get(server.url + "/health", timeout=HEAD_TIMEOUT_S)  # while they are held
    assert health.status_code == 200
    for held in (seconds_until_closed(dribblers, dribble=True),
                 seconds_until_closed(silent, dribble=False)):  # fmt: skip
        assert max(held) < HEAD_TIMEOUT_S + SLACK_S, held


@pytest.mark.slow
def test_a_body_sent_too_slowly_gets_408(server: Server) -> None:
    wait_until_served(server)
    head = ("POST /v1/completions HTTP/1.1\r\nHost: rose\r\ncontent-type: application/json\r\n"
            "content-length: 100\r\n\r\n")  # fmt: skip
    sock = open_connection(server, head.encode() + b'{"prompt": ')  # and the rest never
    sock.settimeout(HEAD_TIMEOUT_S + SLACK_S)
    answer = read_until_closed(sock)
    sock.close()
    assert answer.startswith("HTTP/1.1 408 "), answer
    assert '"code": "request_timeout"' in answer.replace('":"', '": "'), answer


@pytest.mark.slow
def test_past_max_connections_a_new_one_gets_503_and_the_server_recovers(server: Server) -> None:
    wait_until_served(server)
    held = [open_connection(server, b"") for _ in range(MAX_CONNECTIONS)]
    extra = open_connection(server, b"")
    answer = read_until_closed(extra)  # (it returns once the server closed it)
    assert answer.startswith("HTTP/1.1 503 "), answer
    assert '"type": "server_error"' in answer and "--max-connections" in answer
    for sock in [*held, extra]:
        sock.close()
    wait_until_served(server)
    assert "Traceback" not in server.log()


@pytest.mark.slow
def test_out_of_file_descriptors_is_one_log_line_and_the_server_recovers(
    checkpoint: tuple[Path, GPT], tmp_path: Path
) -> None:
    """The server's open-file limit lowered to what it holds plus 16, then 64 clients that
    send nothing: accepts fail for seconds (asyncio retries every second) while the head
    timeout frees places 16 at a time; the log says so once, without a traceback."""
    flags = ["--request-head-timeout", "1"]
    with running_server(checkpoint[0], tmp_path / "server.log", *flags) as server:
        pid = server.process.pid
        _, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        resource.prlimit(
            pid, resource.RLIMIT_NOFILE, (len(os.listdir(f"/proc/{pid}/fd")) + 16, hard)
        )
        clients = [open_connection(server, b"") for _ in range(64)]
        held = seconds_until_closed(clients, dribble=False)  # every one, in turn
        assert max(held) < 30, held
        wait_until_served(server)
        log = server.log()
    assert log.count("Too many open files") == 1, log
    assert "Traceback" not in log, log


# -- class 12: the API's description follows the key --


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_the_api_docs_need_the_key(server: Server, path: str) -> None:
    refused = httpx.get(server.url + path)
    assert is_openai_error(refused, 401)["code"] == "invalid_api_key"
    given = httpx.get(server.url + path, headers=KEY)
    assert given.status_code == 200
    if path == "/openapi.json":
        assert "/v1/completions" in given.json()["paths"]
    else:  # the page asks for the schema where the proxy serves it (--root-path)
        assert '"/rose/openapi.json"' in given.text or "'/rose/openapi.json'" in given.text
    assert httpx.get(server.url + "/health").status_code == 200  # still open


# -- in-process servers: the page and its state --


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer("gpt2")


def in_process(model: GPT, tokenizer: Tokenizer, **settings: object) -> BackgroundServer:
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    return BackgroundServer(build_app(engine, tokenizer, ServerSettings("tiny", **settings)))


# -- class 10: the page behind a path prefix --

ABSOLUTE_URL = re.compile(r"""["'`]/(page|live|v1)/""")


def test_the_page_names_its_resources_relatively_and_they_resolve_under_a_prefix(
    checkpoint: tuple[Path, GPT], tokenizer: Tokenizer
) -> None:
    """The app mounted at /rose (as a proxy serves it): the page, its script and style,
    its event stream and its completions all answer at the URLs the page resolves."""
    engine = LLMEngine(checkpoint[1], tokenizer, EngineConfig(num_kv_blocks=64))
    rose = build_app(engine, tokenizer, ServerSettings("tiny", api_key=API_KEY))
    proxy = Starlette(routes=[Mount("/rose", rose)], lifespan=lambda _: rose.router.lifespan_context(rose))  # fmt: skip

    async def browse(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            page = await http.get("/rose/")
            assert page.status_code == 200
            urls = re.findall(r'(?:src|href)="([^"]+)"', page.text)
            assets = [url for url in urls if not url.startswith("data:")]  # (no favicon)
            assert sorted(assets) == ["page/app.js", "page/style.css"]
            for asset in assets:
                response = await http.get(urljoin("/rose/", asset))
                assert response.status_code == 200 and response.text
                if asset.endswith(".js"):
                    script = response.text
            for text in (page.text, script):
                assert not ABSOLUTE_URL.search(text), ABSOLUTE_URL.search(text)
            fetched = re.findall(r'fetch\("([^"]+)"', script)
            assert sorted(fetched) == ["live/events", "v1/completions"]
            async with http.stream("GET", urljoin("/rose/", "live/events"), headers=KEY) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    assert line.startswith("data: {")
                    break
            body = {"prompt": "Hi", "max_tokens": 2}
            done = await http.post(urljoin("/rose/", "v1/completions"), json=body, headers=KEY)
            assert done.status_code == 200

    with BackgroundServer(proxy) as served:
        asyncio.run(browse(served.url))


# -- class 9: the live page's watchers are capped and share their snapshots --


def test_watchers_are_capped_per_client_and_overall_and_share_each_snapshot(
    checkpoint: tuple[Path, GPT], tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    dumps = []  # every snapshot serialized, by version
    monkeypatch.setattr(
        live, "json", SimpleNamespace(dumps=lambda *a, **k: dumps.append(1) or "{}")
    )
    server = in_process(checkpoint[1], tokenizer, max_live_watchers=3, max_live_watchers_per_client=2)  # fmt: skip

    async def watch(stack: contextlib.AsyncExitStack, client: str) -> httpx.Response:
        transport = httpx.AsyncHTTPTransport(local_address=client)
        http = await stack.enter_async_context(httpx.AsyncClient(transport=transport, timeout=30))
        response = await stack.enter_async_context(http.stream("GET", server.url + "/live/events"))
        if response.status_code == 200:
            lines = response.aiter_lines()  # kept open with the stack (dropping it closes)
            stack.push_async_callback(lines.aclose)
            await anext(lines)  # its first event
        else:
            await response.aread()
        return response

    async def crowd() -> None:
        async with contextlib.AsyncExitStack() as first, contextlib.AsyncExitStack() as rest:
            for _ in range(2):
                assert (await watch(first, "127.0.0.1")).status_code == 200
            one_too_many = await watch(rest, "127.0.0.1")
            error = is_openai_error(one_too_many, 429)
            assert error["code"] == "rate_limit_exceeded" and "at most 2" in error["message"]
            assert (await watch(rest, "127.0.0.2")).status_code == 200
            overall = await watch(rest, "127.0.0.3")
            assert "3 watchers" in is_openai_error(overall, 429)["message"]
            # A burst of steps while three watch: each snapshot is serialized once.
            body = {"prompt": "Hi", "max_tokens": 30, "ignore_eos": True}
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                assert (await http.post("/v1/completions", json=body)).status_code == 200
            assert len(dumps) <= live_state.version() + 1
            await first.aclose()  # the first client leaves: its places free up
            deadline = time.monotonic() + SLACK_S
            while (await watch(rest, "127.0.0.3")).status_code != 200:
                assert time.monotonic() < deadline, "a watcher that left still counts"
                await asyncio.sleep(0.1)

    with server:
        live_state = server.server.config.app.state.live
        asyncio.run(crowd())


# -- class 11: a windowed request's blocks --


def test_a_windowed_requests_snapshot_lists_only_the_blocks_it_holds(tokenizer) -> None:
    model = make_test_model(
        0, block_size=64, vocab_size=50257, position_embedding="rotary", sliding_window=16,
        attention_sinks=4,
    )  # fmt: skip
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64, kv_block_size=4))
    engine.add_request(list(range(100, 140)), SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(80):  # well past the window: blocks behind it were given back
        engine.step()
    (request,) = engine.scheduler.running
    assert FREED in request.block_table  # the premise: some were given back
    snapshot = live.take_snapshot(engine, 80, [])
    (view,) = snapshot["running"]
    assert FREED not in view["blocks"]
    assert len(view["blocks"]) == snapshot["blocks"].count("u")  # what the pool holds for it
    assert all(snapshot["blocks"][b] == "u" for b in view["blocks"])
