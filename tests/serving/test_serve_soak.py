"""A bounded soak: many concurrent clients against a small server, some leaving
mid-stream, some turned away by the queue bound; then SIGTERM with a request in flight.

What must hold: no 5xx except the intended 503s, every completed answer equals its solo
(uncached) run, and at the end every KV block is free.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from servers import (
    API_KEY,
    MODEL_NAME,
    Server,
    running_server,
    solo_text,
    stop,
    wait_idle,
    write_test_checkpoint,
)

from roseinfer.request.sampling_params import SamplingParams
from rosetrainer.model import GPT
from rosetrainer.tokenizer import Tokenizer

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]

NUM_REQUESTS = 200
CONCURRENCY = 32
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@dataclass
class Job:
    prompt: list[int]
    params: SamplingParams
    stream: bool
    leave_after: int | None  # chunks read before disconnecting (None: read everything)


@dataclass
class Outcome:
    status: int
    text: str = ""
    finish_reason: str | None = None
    turned_away: int = 0  # 503s answered before this one got in


RETRIES = 100  # a turned-away client waits (Retry-After, scaled down) and tries again


def make_jobs(seed: int = 0) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(NUM_REQUESTS):
        sampled = i % 2 == 1
        params = SamplingParams(
            max_tokens=rng.randint(1, 16),
            temperature=0.8 if sampled else 0.0,
            top_k=100 if sampled else 0,
            seed=i if sampled else None,
        )
        leave = rng.randint(1, 3) if i % 4 == 0 else None  # a quarter leave mid-stream
        jobs.append(
            Job(
                prompt=[rng.randrange(50257) for _ in range(rng.randint(1, 16))],
                params=params,
                stream=leave is not None or rng.random() < 0.5,
                leave_after=leave,
            )
        )
    return jobs


async def send(http: httpx.AsyncClient, job: Job) -> Outcome:
    p = job.params
    body = {"model": MODEL_NAME, "prompt": job.prompt, "max_tokens": p.max_tokens,
            "temperature": p.temperature, "top_k": p.top_k, "seed": p.seed,
            "stream": job.stream}  # fmt: skip
    if not job.stream:
        response = await http.post("/completions", json=body)
        if response.status_code != 200:
            return Outcome(response.status_code)
        choice = response.json()["choices"][0]
        return Outcome(200, choice["text"], choice["finish_reason"])
    async with http.stream("POST", "/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return Outcome(response.status_code)
        outcome, chunks = Outcome(200), 0
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            outcome.text += choice["text"]
            outcome.finish_reason = choice["finish_reason"] or outcome.finish_reason
            chunks += 1
            if chunks == job.leave_after and choice["finish_reason"] is None:
                return Outcome(499)  # leaving the block closes the connection mid-stream
        return outcome


async def soak(server: Server, jobs: list[Job]) -> list[Outcome]:
    gate = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY)

    async def one(job: Job) -> Outcome:
        async with gate:
            for attempt in range(RETRIES + 1):
                outcome = await send(http, job)
                if outcome.status != 503 or attempt == RETRIES:
                    outcome.turned_away = attempt
                    return outcome
                await asyncio.sleep(0.2)

    async with httpx.AsyncClient(
        base_url=server.base_url, headers=HEADERS, limits=limits, timeout=60
    ) as http:
        return await asyncio.gather(*map(one, jobs))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT]:
    path = tmp_path_factory.mktemp("soak") / "tiny.pt"
    return path, write_test_checkpoint(path)


def test_soak_ends_with_every_block_free_and_every_answer_equal_to_its_solo_run(
    checkpoint: tuple[Path, GPT], tmp_path: Path
) -> None:
    path, model = checkpoint
    tokenizer = Tokenizer("gpt2")
    jobs = make_jobs()
    # A small pool and queue: requests wait, get preempted, and some are turned away.
    flags = ["--api-key", API_KEY, "--max-num-seqs", "8", "--max-waiting", "16",
             "--kv-block-size", "8", "--num-kv-blocks", "48"]  # fmt: skip
    with running_server(path, tmp_path / "server.log", *flags) as server:
        outcomes = asyncio.run(soak(server, jobs))
        final = wait_idle(server)
        health = httpx.get(server.url + "/health").status_code
        after = asyncio.run(soak(server, jobs[:1]))[0]  # the server still serves
        log = server.log()
    statuses = [o.status for o in outcomes]
    assert set(statuses) <= {200, 499}, log  # 499: the client itself left
    assert statuses.count(499) > 0
    assert sum(o.turned_away for o in outcomes) > 0  # the bound was reached, answered with 503
    assert after.status in (200, 499) and after.turned_away == 0
    assert final["rose_kv_blocks_used"] == 0
    assert final["rose_num_requests_running"] == final["rose_num_requests_waiting"] == 0
    assert final['rose_requests_finished_total{finish_reason="abort"}'] >= 1
    assert health == 200
    for job, outcome in zip(jobs, outcomes, strict=True):
        if outcome.status == 200:
            text, _, reason = solo_text(model, tokenizer, job.prompt, job.params)
            assert (outcome.text, outcome.finish_reason) == (text, reason)


def test_sigterm_finishes_the_request_in_flight_and_exits_0(
    checkpoint: tuple[Path, GPT], tmp_path: Path
) -> None:
    body = {"model": MODEL_NAME, "prompt": "ROMEO:", "max_tokens": 100, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with running_server(checkpoint[0], tmp_path / "server.log", "--api-key", API_KEY) as server:
        with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=60) as http:
            with http.stream("POST", "/completions", json=body) as response:
                lines = response.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                server.process.terminate()  # SIGTERM while the request streams
                rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert stop(server.process) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/health")
