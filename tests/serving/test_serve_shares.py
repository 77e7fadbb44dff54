"""No client can take what the others need (issue 52): the threads that wait for a
constraint's compile, the event loop while a huge prompt is tokenized, the queue of
requests waiting for a first token. A real server (uvicorn on 127.0.0.1, httpx as the
client); clients told apart by X-Forwarded-For, as a proxy in front of the server names
them (127.0.0.1 is a proxy uvicorn trusts, by default).
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from servers import (
    WINDOW,
    Server,
    admitted,
    is_openai_error,
    running_server,
    write_test_checkpoint,
)

from roseinfer.engine.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.request.grammar_process import Abandoned, Workers
from roseinfer.request.sampling_params import StructuredOutputs
from roseinfer.request.structured import grammar_for
from roseinfer.serving import compiles as compiles_module
from roseinfer.serving.app import ServerSettings, build_app
from roseinfer.serving.background import BackgroundServer
from roseinfer.serving.chat_template import ChatTemplate
from roseinfer.serving.compiles import THREADS, Compiles, TooManyCompiles
from rosetrainer.model import GPT
from rosetrainer.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_WAITING = 16  # so a client's share is 4 (a quarter)
SLOW_REGEX = "a{%d}"  # compiles for longer than the compile bound (10 s): refused then


def client(name: str) -> dict[str, str]:
    return {"X-Forwarded-For": name}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT]:
    path = tmp_path_factory.mktemp("shares") / "tiny.pt"
    return path, write_test_checkpoint(path)


@pytest.fixture(scope="module")
def server(checkpoint: tuple[Path, GPT], tmp_path_factory: pytest.TempPathFactory) -> Server:
    folder = tmp_path_factory.mktemp("shares-server")
    flags = ["--max-waiting", str(MAX_WAITING), "--max-num-seqs", "1"]
    with running_server(checkpoint[0], folder / "server.log", *flags) as server:
        yield server


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


# -- F2: a huge prompt is refused before it is tokenized; tokenizing is off the loop --


@pytest.mark.slow
def test_a_prompt_certainly_past_the_context_is_refused_by_its_bytes(server: Server) -> None:
    """A 1 MiB prompt has more than 1,024 tokens whatever they are (no GPT-2 token holds
    more than 128 bytes): refused by its size, before a second of tokenizing, in the
    style of the too-long refusal; one just under the bound is counted in tokens."""
    huge = "ab " * 300_000  # 900,000 bytes > 1024 x 128
    for path, body, param in [
        ("/completions", {"prompt": huge, "max_tokens": 2}, "prompt"),
        ("/completions", {"prompt": ["Hi", huge], "max_tokens": 2}, "prompt"),
        ("/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages"),
    ]:
        error = is_openai_error(httpx.post(server.base_url + path, json=body, timeout=30), 400)
        assert error["param"] == param
        assert "bytes, so more than 1024 tokens" in error["message"], error["message"]
        assert "context window is 1024: shorten the prompt" in error["message"]
    under = "ab " * 40_000  # 120,000 bytes: may fit as far as bytes can tell; it does not
    error = is_openai_error(
        httpx.post(server.base_url + "/completions", json={"prompt": under}, timeout=30), 400
    )
    assert re.match(
        r"the prompt has \d+ tokens but the model's context window is 1024", error["message"]
    )


class WatchedTokenizer(Tokenizer):
    """The GPT-2 tokenizer, noting the thread each encode runs on."""

    threads: list[str]

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return super().encode(text)


def test_prompts_are_tokenized_off_the_event_loop(checkpoint: tuple[Path, GPT]) -> None:
    tokenizer = WatchedTokenizer("gpt2")
    tokenizer.threads = []
    engine = LLMEngine(checkpoint[1], tokenizer, EngineConfig(num_kv_blocks=64))
    with BackgroundServer(build_app(engine, tokenizer, ServerSettings("tiny"))) as server:
        base = server.url + "/v1"
        assert httpx.post(base + "/completions", json={"prompt": "Hi", "max_tokens": 1}).is_success
        assert httpx.post(base + "/completions", json={"prompt": ["a", "b"], "max_tokens": 1})
        assert httpx.post(base + "/chat/completions", json=CHAT).is_success
        assert httpx.post(server.url + "/tokenize", json={"prompt": "Hi"}).is_success
    assert len(tokenizer.threads) >= 5
    assert all(name.startswith("rose-tokenize") for name in tokenizer.threads), tokenizer.threads


def test_a_batch_of_prompts_stops_tokenizing_at_the_first_too_long(
    checkpoint: tuple[Path, GPT],
) -> None:
    """60 prompts each under the byte bound but past the context: the first tokenized
    is refused, the other 59 never tokenized; a batch with one prompt past the byte bound
    is refused before any of its prompts is tokenized."""
    tokenizer = WatchedTokenizer("gpt2")
    tokenizer.threads = []
    engine = LLMEngine(checkpoint[1], tokenizer, EngineConfig(num_kv_blocks=64))
    long = " a" * 1100  # 1,100 tokens, 2,200 bytes: past the context of 1024
    with BackgroundServer(build_app(engine, tokenizer, ServerSettings("tiny"))) as server:
        body = {"prompt": [long] * 60, "max_tokens": 1}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        error = is_openai_error(response, 400)
        assert error["message"].startswith("the prompt has 1100 tokens but the model's context")
        assert len(tokenizer.threads) == 1
        body = {"prompt": ["Hi", "ab " * 300_000], "max_tokens": 1}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert "bytes, so more than 1024 tokens" in is_openai_error(response, 400)["message"]
        assert len(tokenizer.threads) == 1


def test_a_conversation_past_the_context_is_refused_before_its_template_runs(
    checkpoint: tuple[Path, GPT], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chat body under 1 MiB may hold 16,000 messages: rendering them took seconds of
    the GIL on the template's threads, so another client waited up to 7 s and /health 2 s,
    and some were a 500 (the render's time limit) though the client sent too much.
    More messages than the context has tokens, or contents with more bytes than it can
    cover, are a 400 naming `messages` before the template runs."""
    renders = []
    render = ChatTemplate.render
    monkeypatch.setattr(
        ChatTemplate, "render", lambda self, m: renders.append(m) or render(self, m)
    )
    tokenizer = Tokenizer("gpt2")
    engine = LLMEngine(checkpoint[1], tokenizer, EngineConfig(num_kv_blocks=64))
    many = [{"role": "user", "content": ""}] * 16_000
    large = [
        {"role": "user", "content": "ab " * 25_000},
        {"role": "user", "content": "ab " * 25_000},
    ]
    app = build_app(engine, tokenizer, ServerSettings("tiny"))
    renders.clear()  # (the template's trial render at start-up)
    with BackgroundServer(app) as server:
        url = server.url + "/v1/chat/completions"
        for messages, message in [
            (many, "the conversation has 16000 messages, more than the model's context window"),
            (large, "the messages' contents have 150000 bytes, so more than 1024 tokens"),
        ]:
            error = is_openai_error(httpx.post(url, json={"messages": messages}, timeout=60), 400)
            assert error["param"] == "messages"
            assert error["message"].startswith(message), error["message"]
        assert renders == []
        assert httpx.post(url, json=CHAT, timeout=60).is_success
    assert len(renders) == 1  # (the spy sees renders: the refusals above ran none)


# -- F3: one client's share of the waiting queue --


@pytest.mark.slow
def test_one_client_cannot_fill_the_waiting_queue(server: Server) -> None:
    """With one sequence running at a time, client A holds the engine with a long request
    and sends more than its share of --max-waiting (a quarter): past the share its
    requests get 503, and client B is still admitted and served."""
    long = {"prompt": "ROMEO:", "max_tokens": WINDOW - 16, "ignore_eos": True, "temperature": 0}
    short = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            running = asyncio.create_task(
                http.post("/completions", json=long, headers=client("10.0.0.1"))
            )
            await admitted(http, server, 1)
            flood = [
                asyncio.create_task(
                    http.post("/completions", json=short, headers=client("10.0.0.1"))
                )
                for _ in range(MAX_WAITING)
            ]
            # A's share fills: 4 admitted, the rest refused at once
            refused = []
            for task in asyncio.as_completed(flood):
                response = await task
                if response.status_code != 503:
                    break  # (the long request ended: the queue moved on)
                refused.append(response)
                if len(refused) == MAX_WAITING - 4:
                    break
            assert len(refused) == MAX_WAITING - 4, [r.text for r in refused]
            assert "--max-waiting-per-client" in refused[0].json()["error"]["message"]
            assert not running.done(), "the long request ended before the flood was answered"
            other = await http.post("/completions", json=short, headers=client("10.0.0.2"))
            assert other.status_code == 200, other.text
            assert (await running).status_code == 200
            for task in flood:
                assert (await task).status_code in (200, 503)

    asyncio.run(run())


def test_a_request_over_the_clients_share_is_a_400_naming_the_flag(server: Server) -> None:
    body = {"prompt": "Hi", "max_tokens": 2, "n": 5}  # 5 > a share of 4
    response = httpx.post(server.base_url + "/completions", json=body, headers=client("10.0.0.3"))
    error = is_openai_error(response, 400)
    assert "at most 4 at once (--max-waiting-per-client)" in error["message"]
    # the proxy's own requests (no X-Forwarded-For) are anyone's: the whole queue
    assert httpx.post(server.base_url + "/completions", json=body, timeout=60).status_code == 200


# -- F1: compiles wait on their own threads, a budget per client --


@pytest.mark.slow
def test_slow_constraints_from_one_client_never_hold_up_anothers_chat(server: Server) -> None:
    """Client A sends many distinct constraints that each compile past the 10 s bound
    (one changed digit each: a memory of refused texts would not know them); client B's
    plain chat answers while A's first is still compiling, about as fast as before, and
    A's constraints past its budget are refused at once (429)."""

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:

            async def chat() -> float:
                start = time.monotonic()
                response = await http.post("/chat/completions", json=CHAT, headers=client("b"))
                assert response.status_code == 200, response.text
                return time.monotonic() - start

            await chat()  # warm
            baseline = max([await chat() for _ in range(3)])
            slow = [
                asyncio.create_task(
                    http.post(
                        "/chat/completions",
                        json={
                            **CHAT,
                            "structured_outputs": {"regex": SLOW_REGEX % (2_000_000 + i)},
                        },
                        headers=client("a"),
                    )
                )
                for i in range(10)
            ]
            await asyncio.sleep(1.0)  # the compiles have started (or been refused)
            during = await chat()
            pending = [task for task in slow if not task.done()]
            assert len(pending) >= 1, "every slow constraint was answered before the chat"
            assert during < baseline + 5.0, (during, baseline)
            for task in slow:
                if task.done():
                    error = is_openai_error(task.result(), 429)
                    assert error["code"] == "too_many_compiles"
            assert len(pending) == 1  # A's budget: one new constraint compiling at once
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    asyncio.run(run())


@pytest.mark.slow
def test_one_new_constraint_sent_many_times_at_once_costs_one_compile(server: Server) -> None:
    """A well-behaved client's batch: one new schema in many requests at once. The first
    compiles it, the others wait for that compile instead of counting against the
    client's budget: every request is answered, none refused."""
    fields = {"structured_outputs": {"regex": "[a-z]{3}-[0-9]{7}"}}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            return await asyncio.gather(
                *[
                    http.post("/chat/completions", json={**CHAT, **fields}, headers=client("c"))
                    for _ in range(4)  # (its share of the waiting queue)
                ]
            )

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    for response in responses:  # (max_tokens 2: a prefix of the pattern)
        text = response.json()["choices"][0]["message"]["content"]
        assert re.fullmatch(r"[a-z]{0,3}(-[0-9]{0,7})?", text), text


class HeldCompile:
    """Stands in for `grammar_for`: each compile holds its pool thread until released,
    and says which constraints a thread took (by their regex)."""

    def __init__(self) -> None:
        self.release, self.started = threading.Event(), []
        self.abandoned: dict[str, threading.Event] = {}  # by regex

    def __call__(
        self,
        spec: StructuredOutputs,
        tokenizer: Tokenizer,
        vocab_size: int,
        abandoned: threading.Event,
    ) -> str:
        self.started.append(spec.regex)
        self.abandoned[spec.regex] = abandoned
        assert self.release.wait(60)
        return f"compiled {spec.regex}"


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> HeldCompile:
    # One real constraint in the cache first (compiled by the worker process).
    grammar_for(CACHED, GPT2, GPT2.n_vocab)
    fake = HeldCompile()
    monkeypatch.setattr(compiles_module, "grammar_for", fake)
    yield fake
    fake.release.set()


GPT2 = Tokenizer("gpt2")
CACHED = StructuredOutputs(choice=["yes", "no"])


async def started(held: HeldCompile, regex: str) -> None:
    """Until a pool thread has taken `regex`'s compile (2 s at most)."""
    async with asyncio.timeout(2.0):
        while regex not in held.started:
            await asyncio.sleep(0.01)


def test_a_constraint_sent_many_times_waits_for_its_compile_without_threads(
    held: HeldCompile,
) -> None:
    """One client sends one slow new regex twelve times at once, more than the pool has
    threads: it compiles once, and the duplicates wait for it on the event loop, so
    another client's cached constraint is answered at once and its new one starts
    compiling while the first still runs."""

    async def run() -> None:
        compiles = Compiles(GPT2, GPT2.n_vocab, per_client=1)
        slow = StructuredOutputs(regex="a{7000000}")
        same = [asyncio.create_task(compiles.grammar(slow, "a")) for _ in range(3 * THREADS // 2)]
        await started(held, "a{7000000}")
        async with asyncio.timeout(2.0):
            assert (await compiles.grammar(CACHED, "b")) is not None
        other = asyncio.create_task(compiles.grammar(StructuredOutputs(regex="[k]{2}"), "c"))
        await started(held, "[k]{2}")
        held.release.set()
        assert await asyncio.gather(*same) == ["compiled a{7000000}"] * len(same)
        assert await other == "compiled [k]{2}"
        assert held.started.count("a{7000000}") == 1
        compiles.close()

    asyncio.run(run())


@pytest.mark.slow
def test_a_clients_budget_counts_queued_compiles_and_leaves_with_the_client(
    held: HeldCompile,
) -> None:
    """With every pool thread compiling, a client's new constraint waits in the queue and
    counts against its budget (its next is refused at once); a request that gives up
    gives its budget back at once: a queued compile is dropped, never run, and one that
    is running finishes without holding the client's budget."""

    async def run() -> None:
        compiles = Compiles(GPT2, GPT2.n_vocab, per_client=1)
        running = [
            asyncio.create_task(compiles.grammar(StructuredOutputs(regex=f"[r]{{{i}}}"), f"r{i}"))
            for i in range(THREADS)
        ]
        for i in range(THREADS):
            await started(held, f"[r]{{{i}}}")
        queued = asyncio.create_task(compiles.grammar(StructuredOutputs(regex="[q]{1}"), "z"))
        await asyncio.sleep(0.1)
        assert not queued.done()
        with pytest.raises(TooManyCompiles):
            async with asyncio.timeout(2.0):
                await compiles.grammar(StructuredOutputs(regex="[q]{2}"), "z")
        queued.cancel()  # z's client left
        await asyncio.gather(queued, return_exceptions=True)
        again = asyncio.create_task(compiles.grammar(StructuredOutputs(regex="[q]{3}"), "z"))
        running[0].cancel()  # r0's client left, its compile running
        await asyncio.gather(running[0], return_exceptions=True)
        assert held.abandoned["[r]{0}"].is_set()  # (waiting for a worker: dropped)
        after = asyncio.create_task(compiles.grammar(StructuredOutputs(regex="[r]{9}"), "r0"))
        await asyncio.sleep(0.1)
        assert not again.done() and not after.done()  # waiting, not refused
        # y sends one new text twice and leaves once: the other still waits, on y's budget
        twice = StructuredOutputs(regex="[y]{2}")
        first, second = (asyncio.create_task(compiles.grammar(twice, "y")) for _ in range(2))
        await asyncio.sleep(0.1)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        with pytest.raises(TooManyCompiles):
            await compiles.grammar(StructuredOutputs(regex="[y]{3}"), "y")
        held.release.set()
        assert await again == "compiled [q]{3}" and await after == "compiled [r]{9}"
        assert await second == "compiled [y]{2}"
        await asyncio.gather(*running[1:])
        assert "[q]{1}" not in held.started  # dropped while queued
        compiles.close()

    asyncio.run(run())


def test_a_compile_abandoned_while_waiting_for_a_worker_gives_up() -> None:
    """A compile whose requests all left, still waiting for a worker, gives up instead
    of taking a worker for nobody (sixteen abandoned slow regexes from sixteen addresses
    held a newcomer's compile 40 s, two workers x 10 s x 8 threads)."""
    workers = Workers(size=0)  # (every worker busy, for as long as this runs)
    abandoned, outcome = threading.Event(), []

    def check() -> None:
        try:
            workers.check("gpt2", "[x]{2}", "regex", 10.0, abandoned)
        except Abandoned:
            outcome.append("abandoned")

    thread = threading.Thread(target=check)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive()  # waiting for a worker
    abandoned.set()
    thread.join(2.0)
    assert outcome == ["abandoned"]


@pytest.mark.slow
def test_a_client_that_leaves_during_its_compile_gives_back_its_budget(server: Server) -> None:
    """Client D sends a slow new constraint and hangs up while it compiles: the server
    notices, and D's next new constraint is compiled, not refused for the one nobody
    waits for."""

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            slow = {**CHAT, "structured_outputs": {"regex": SLOW_REGEX % 3_000_001}}
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/chat/completions", json=slow, headers=client("d"), timeout=1.0)
            await asyncio.sleep(1.0)  # (the server checks for a disconnect every 0.2 s)
            quick = {**CHAT, "structured_outputs": {"regex": "[d]{2}-[0-9]"}}
            response = await http.post("/chat/completions", json=quick, headers=client("d"))
            assert response.status_code == 200, response.text

    asyncio.run(run())
