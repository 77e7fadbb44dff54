"""One request never breaks another (issue 21): a real server (uvicorn on 127.0.0.1,
httpx as the client) against bad, slow and leaving clients, one test per class of the
issue, then a mixed soak of all of them among good requests whose answers must equal
their solo (uncached) runs.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from servers import (
    WINDOW,
    Server,
    admitted,
    is_openai_error,
    leave_a_non_streamed_request,
    running_server,
    solo_text,
    stop,
    wait_idle,
    write_test_checkpoint,
)

from roseinfer.cli import serve
from roseinfer.engine.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.request.sampling_params import SamplingParams
from roseinfer.serving.app import ServerSettings, build_app
from roseinfer.serving.background import BackgroundServer
from roseinfer.serving.chat_template import RENDER_TIMEOUT_S, ChatTemplate
from rosetrainer.model import GPT
from rosetrainer.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_WAITING = 8
# An operator's template with a defect per second message: one that loops, one that
# includes (no loader: TypeError), one that recurses, one that reads an undefined name
# (a TemplateError: the request's fault); any other conversation renders.
CHAT_TEMPLATE = """\
{%- set second = messages[1].content if messages | length > 1 else '' -%}
{%- if second == 'loop' -%}{% for i in range(100000) %}{% for j in range(100000) %}\
{% endfor %}{% endfor %}{%- endif -%}
{%- if second == 'include' -%}{% include 'other.jinja' %}{%- endif -%}
{%- if second == 'recurse' -%}{% macro down(n) %}{{ down(n + 1) }}{% endmacro %}\
{{ down(0) }}{%- endif -%}
{%- if second == 'undefined' -%}{{ nothing.there() }}{%- endif -%}
{% for m in messages %}{{ m.role }}: {{ m.content }}
{% endfor %}assistant:"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT]:
    path = tmp_path_factory.mktemp("isolation") / "tiny.pt"
    return path, write_test_checkpoint(path)


@pytest.fixture(scope="module")
def server(checkpoint: tuple[Path, GPT], tmp_path_factory: pytest.TempPathFactory) -> Server:
    folder = tmp_path_factory.mktemp("isolation-server")
    template = folder / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    flags = ["--max-waiting", str(MAX_WAITING), "--max-num-seqs", "8", "--chat-template",
             str(template)]  # fmt: skip
    with running_server(checkpoint[0], folder / "server.log", *flags) as server:
        yield server


# -- class 2: a non-streamed client that leaves is aborted (without --api-key here) --


@pytest.mark.slow
def test_a_non_streamed_client_that_leaves_is_aborted(server: Server) -> None:
    leave_a_non_streamed_request(server, {})


# -- class 3: bounded bodies and stop strings --


def test_a_body_over_the_bound_is_413_and_the_server_goes_on(server: Server) -> None:
    body = {"prompt": "Hi", "stop": ["x" * 4000] * 1000, "max_tokens": 2}  # ~4 MB
    error = is_openai_error(httpx.post(server.base_url + "/completions", json=body), 413)
    assert "1048576 bytes" in error["message"]
    # chunked, with no Content-Length to refuse up front: counted as it arrives
    raw = json.dumps(body).encode()
    chunks = (raw[i : i + 65536] for i in range(0, len(raw), 65536))
    chunked = httpx.post(
        server.base_url + "/completions",
        content=chunks,
        headers={"content-type": "application/json"},
    )
    is_openai_error(chunked, 413)
    ok = httpx.post(server.base_url + "/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


# -- class 7: chat templates --


def chat(server: Server, second: str, timeout: float = 30) -> httpx.Response:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": second}]
    body = {"messages": messages, "max_tokens": 2}
    return httpx.post(server.base_url + "/chat/completions", json=body, timeout=timeout)


@pytest.mark.slow
def test_a_template_that_loops_fails_its_request_in_time_and_stalls_no_one(
    checkpoint: tuple[Path, GPT],
) -> None:
    """/health answers while the looping template renders (it runs off the event loop),
    and the looping request ends with a 500 once the render's time is up. In-process, so
    that the test knows when the render has started instead of guessing it by a sleep."""
    model, tokenizer = checkpoint[1], Tokenizer("gpt2")
    template, rendering, rendered = ChatTemplate(CHAT_TEMPLATE), threading.Event(), []
    render = template.render

    def watched_render(messages: list[dict[str, str]], timeout: float = RENDER_TIMEOUT_S) -> str:
        rendering.set()
        try:
            return render(messages, timeout)
        finally:
            rendered.append(True)

    template.render = watched_render
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    app = build_app(engine, tokenizer, ServerSettings(model_name="tiny", chat_template=template))
    messages = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "loop"}]

    async def both(url: str) -> tuple[httpx.Response, bool, float]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            start = time.monotonic()
            looping = asyncio.create_task(
                http.post("/v1/chat/completions", json={"messages": messages})
            )
            assert await asyncio.to_thread(rendering.wait, 30), "the template never rendered"
            assert (await http.get("/health")).status_code == 200
            answered_during_render = not rendered
            return await looping, answered_during_render, time.monotonic() - start

    with BackgroundServer(app) as server:
        response, answered_during_render, total_s = asyncio.run(both(server.url))
    assert is_openai_error(response, 500)["type"] == "server_error"
    assert "longer than" in response.json()["error"]["message"]
    assert answered_during_render  # the event loop was free while the template ran
    assert total_s < 10


@pytest.mark.parametrize(
    ("second", "status", "words"),
    [("include", 500, "TypeError"), ("recurse", 500, "RecursionError"),
     ("undefined", 400, "failed on these messages")],
)  # fmt: skip
def test_a_template_that_breaks_is_an_error_in_openai_shape(
    server: Server, second: str, status: int, words: str
) -> None:
    assert words in is_openai_error(chat(server, second), status)["message"]
    assert chat(server, "fine").status_code == 200


@pytest.mark.parametrize(
    ("source", "message"),
    [("{% include 'x.jinja' %}", "cannot render a one-message chat"),
     ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
      "ran longer than"),
     (b"\xff\xfe{{ messages }}", "is not UTF-8 text")],
)  # fmt: skip
@pytest.mark.slow
def test_serve_checks_the_chat_template_at_startup(
    source: str | bytes, message: str, tmp_path: Path, capsys
) -> None:
    path = tmp_path / "chat.jinja"
    path.write_bytes(source if isinstance(source, bytes) else source.encode())
    assert serve.main(["--chat-template", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_serve_refuses_a_port_out_of_range_in_one_line(capsys) -> None:
    assert serve.main(["--port", "70000"]) == 2
    err = capsys.readouterr().err
    assert "--port must be in [0, 65535]" in err and len(err.strip().splitlines()) == 1


# -- class 9: the small ones --


def test_the_largest_seed_with_n_2_is_served(server: Server) -> None:
    body = {"prompt": "Hi", "max_tokens": 3, "temperature": 1.0, "seed": 2**64 - 1, "n": 2}
    response = httpx.post(server.base_url + "/completions", json=body)
    assert response.status_code == 200, response.text
    assert [c["index"] for c in response.json()["choices"]] == [0, 1]


@pytest.mark.parametrize("prompt", ["", [[]], []])
def test_an_empty_prompt_counts_the_end_of_text_it_starts_from(server: Server, prompt) -> None:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    response = httpx.post(server.base_url + "/completions", json=body)
    if prompt == []:  # no prompt at all, not an empty one
        assert is_openai_error(response, 400)["param"] == "prompt"
        return
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 1


# -- class 4: SIGTERM past --shutdown-timeout --


@pytest.mark.slow
def test_sigterm_past_the_timeout_aborts_and_every_client_gets_a_whole_answer(
    checkpoint: tuple[Path, GPT], tmp_path: Path
) -> None:
    body = {"prompt": "ROMEO:", "max_tokens": WINDOW - 24, "temperature": 0, "ignore_eos": True}

    async def streamed(http: httpx.AsyncClient, started: asyncio.Event) -> list[str]:
        async with http.stream("POST", "/completions", json={**body, "stream": True}) as r:
            events = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
            return events

    async def clients(server: Server) -> tuple[list[list[str]], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            started = [asyncio.Event() for _ in range(2)]
            streams = [asyncio.create_task(streamed(http, s)) for s in started]
            posts = [asyncio.create_task(http.post("/completions", json=body)) for _ in range(2)]
            for event in started:
                await event.wait()
            await admitted(http, server, 4)  # the non-streamed ones too
            server.process.send_signal(signal.SIGTERM)
            return await asyncio.gather(*streams), await asyncio.gather(*posts)

    flags = ["--shutdown-timeout", "0"]
    with running_server(checkpoint[0], tmp_path / "server.log", *flags) as server:
        streams, posts = asyncio.run(clients(server))
        code = stop(server.process)
        log = server.log()
    for events in streams:
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    for response in posts:
        assert response.status_code == 200
        assert response.json()["choices"][0]["finish_reason"] == "abort"
    assert code == 0 and "Traceback" not in log and "ERROR" not in log, log


# -- the mixed soak --

BAD = [  # (body changes, status): each class's bad request, sent while good ones run
    ({"temperature": 1e-50}, 400),
    ({"top_p": 1e-300}, 400),
    ({"logprobs": 10**6}, 400),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400),
    ({"stop": ["x" * 4000] * 300}, 413),
    ({"n": MAX_WAITING + 1}, 400),
    ({"prompt": [1] * (WINDOW + 1)}, 400),
    ({"prompt": [50257]}, 400),
]


@dataclass
class Good:
    prompt: list[int]
    max_tokens: int
    stream: bool


async def good(http: httpx.AsyncClient, job: Good) -> tuple[str, str | None]:
    body = {"prompt": job.prompt, "max_tokens": job.max_tokens, "temperature": 0,
            "stream": job.stream}  # fmt: skip
    for _ in range(100):  # a 503 (the queue is full for now) is retried, as a client would
        if not job.stream:
            response = await http.post("/completions", json=body)
            if response.status_code == 503:
                await asyncio.sleep(0.1)
                continue
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            return choice["text"], choice["finish_reason"]
        text, reason, events = "", None, []
        async with http.stream("POST", "/completions", json=body) as response:
            if response.status_code == 503:
                await response.aread()
                await asyncio.sleep(0.1)
                continue
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        assert events[-1] == "[DONE]", events
        for event in events[:-1]:
            choice = json.loads(event)["choices"][0]
            text, reason = text + choice["text"], choice["finish_reason"] or reason
        return text, reason
    raise AssertionError("turned away 100 times")


async def bad(http: httpx.AsyncClient, change: dict, status: int) -> None:
    body = {"prompt": "Hi", "max_tokens": 4, **change}
    if change.get("chat"):
        path, body = "/chat/completions", {"messages": change["chat"], "max_tokens": 4}
    else:
        path = "/completions"
    response = await http.post(path, json=body)
    assert response.status_code == status, (change, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


async def leave(http: httpx.AsyncClient, stream: bool, rng: random.Random) -> None:
    """A client that leaves while its long request runs (after a 503, it tries again)."""
    body = {"prompt": "ROMEO:", "max_tokens": WINDOW - 24, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    for _ in range(100):
        if not stream:
            try:
                response = await http.post("/completions", json=body, timeout=rng.uniform(0.2, 1))
            except httpx.ReadTimeout:
                return  # httpx closed the connection
            assert response.status_code == 503, response.text
        else:
            async with http.stream("POST", "/completions", json=body) as response:
                chunks = rng.randint(1, 5)
                async for line in response.aiter_lines():
                    chunks -= line.startswith("data: ")
                    if chunks == 0:
                        return  # leaving the block closes the connection mid-stream
                assert response.status_code == 503
        await asyncio.sleep(0.1)
    raise AssertionError("turned away 100 times")


@pytest.mark.slow
def test_mixed_soak_good_answers_equal_solo_runs_and_bad_ones_are_4xx(
    checkpoint: tuple[Path, GPT], server: Server
) -> None:
    rng = random.Random(21)
    goods = [
        Good([rng.randrange(50257) for _ in range(rng.randint(1, 12))], rng.randint(1, 12),
             stream=i % 2 == 0)
        for i in range(24)
    ]  # fmt: skip
    chat_bad = {"chat": [{"role": "user", "content": "Hi"},
                         {"role": "user", "content": "undefined"}]}  # fmt: skip
    bads = [*BAD, (chat_bad, 400)] * 2

    async def everything() -> list:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            tasks = [good(http, job) for job in goods]
            tasks += [bad(http, change, status) for change, status in bads]
            tasks += [leave(http, i % 2 == 0, random.Random(i)) for i in range(6)]
            order = list(range(len(tasks)))
            rng.shuffle(order)
            return await asyncio.gather(*(tasks[i] for i in order)), order

    start = time.monotonic()
    results, order = asyncio.run(everything())
    elapsed = time.monotonic() - start
    final = wait_idle(server)
    log = server.log()
    assert elapsed < 120
    answers = {i: r for i, r in zip(order, results, strict=True) if i < len(goods)}
    model, tokenizer = checkpoint[1], Tokenizer("gpt2")
    for i, job in enumerate(goods):
        params = SamplingParams(max_tokens=job.max_tokens)
        text, _, reason = solo_text(model, tokenizer, job.prompt, params)
        assert answers[i] == (text, reason), i
    assert "Traceback" not in log, log
    assert final["rose_num_requests_running"] == final["rose_num_requests_waiting"] == 0
    assert final["rose_kv_blocks_used"] == 0  # every block free or cached-unreferenced


# -- class 1, the serving side: a request the engine fails --

POISON = [464, 2068]  # the prompt of the request that fails inside the engine's step


def events_of(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("everyone", [False, True])
def test_a_request_the_engine_fails_gets_a_whole_error_and_the_others_their_tokens(
    checkpoint: tuple[Path, GPT], everyone: bool
) -> None:
    """One request failed as the engine reports it (CONTRACT 1: finished, "abort", `error`
    set, its blocks freed), or, as a bug would, a step that raises for everyone: each
    failed client gets an OpenAI-shaped error (a 500, or an error event then [DONE] on a
    stream); the others' tokens equal their solo runs; the server goes on."""
    model, tokenizer = checkpoint[1], Tokenizer("gpt2")
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=256))
    add, step, held, failed = engine.add_request, engine.step, [], []
    made: dict[str, int] = {}  # each poisoned request's tokens (the server's outputs: deltas)

    def add_poisoned_together(
        prompt_ids: list[int], params: SamplingParams, rid: str, **kind: object
    ) -> str:
        # The two poisoned requests enter the engine together, however far apart their
        # HTTP requests arrive (on a busy machine, the second can come after the first
        # has finished): the step that breaks for everyone then holds both of them.
        if prompt_ids == POISON:
            made[rid] = 0
        if prompt_ids == POISON and not held:
            held.append((prompt_ids, params, rid))
            return rid
        if prompt_ids == POISON:
            add(*held[0], **kind)
        return add(prompt_ids, params, rid, **kind)

    def step_that_fails() -> list:
        outputs = step()
        for out in outputs:
            if out.request_id in made:
                made[out.request_id] += len(out.new_token_ids)
        # A poisoned request fails at its third token: a stream has sent text by then.
        poisoned = [o for o in outputs if made.get(o.request_id) == 3]
        if everyone and len(poisoned) == 2 and not failed:
            failed.append(True)
            raise RuntimeError("injected: the step broke")
        for out in poisoned:
            if not out.finished and not everyone:
                engine.abort(out.request_id)
                out.finished, out.finish_reason = True, "abort"
                out.error = "sampling failed: injected"
        return outputs

    engine.add_request, engine.step = add_poisoned_together, step_that_fails
    app = build_app(engine, tokenizer, ServerSettings(model_name="tiny"))
    goods = [[15496, 11], [40, 716, 257]]

    async def send(http: httpx.AsyncClient, prompt: list[int], stream: bool) -> httpx.Response:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream}
        return await http.post("/v1/completions", json=body)

    async def together(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            jobs = [(POISON, False), (POISON, True)] + [(g, s) for g in goods for s in (0, 1)]
            return await asyncio.gather(*(send(http, p, bool(s)) for p, s in jobs))

    with BackgroundServer(app) as server:
        poisoned, poisoned_stream, *answers = asyncio.run(together(server.url))
        after = httpx.post(
            server.url + "/v1/completions", json={"prompt": goods[0], "max_tokens": 2}
        )
    assert is_openai_error(poisoned, 500)["type"] == "server_error"
    events = events_of(poisoned_stream)
    # some text came, then the error, then [DONE]
    assert any(json.loads(e)["choices"][0]["text"] for e in events[:-2])
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"
    assert after.status_code == 200
    assert engine.stats().num_kv_blocks_used == 0
    assert failed == ([True] if everyone else [])
    if everyone:
        return  # the step that broke failed every request in it
    for prompt, response in zip([g for g in goods for _ in (0, 1)], answers, strict=True):
        text, _, reason = solo_text(model, tokenizer, prompt, SamplingParams(max_tokens=8))
        assert response.status_code == 200
        if response.headers["content-type"].startswith("text/event-stream"):
            chunks = [json.loads(e)["choices"][0] for e in events_of(response)[:-1]]
            got = ("".join(c["text"] for c in chunks), chunks[-1]["finish_reason"])
        else:
            choice = response.json()["choices"][0]
            got = (choice["text"], choice["finish_reason"])
        assert got == (text, reason)
