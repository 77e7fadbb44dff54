"""A real rose server for tests: a subprocess on 127.0.0.1, a free port, always stopped.

`running_server` starts `python -m roseinfer.cli.serve --port 0`, waits for its one ready
line (which names the port it got), yields, and on the way out (also after a failing
test) sends SIGTERM, then SIGKILL if it has not exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from roseinfer.loops.generate import generate
from roseinfer.request.sampling_params import SamplingParams
from rosetrainer.checkpoint import save_checkpoint
from rosetrainer.config import GPTConfig
from rosetrainer.model import GPT
from rosetrainer.tokenizer import Tokenizer

API_KEY = "test-key"
MODEL_NAME = "tiny"
READY = re.compile(r"serving \S+ at (http://\S+)/v1")
STARTUP_TIMEOUT_S = 60
# The served model's context: long enough that a request can run for seconds (a test
# can act while it is still running, even on a busy machine).
WINDOW = 1024


def write_test_checkpoint(path: Path) -> GPT:
    """A seeded random model with GPT-2's vocabulary (the real tokenizer decodes whatever
    it makes) and a window of WINDOW tokens, saved as a rose checkpoint.

    A checkpoint ties the output matrix to the token embedding, so models.py's untied
    wide init cannot be saved; every matrix drawn with std 0.5 instead (GPT-2 uses 0.02)
    gives varied greedy text whose top-2 logits stay well apart (checked in the tests).
    """
    torch.manual_seed(2)  # a seed whose greedy text is varied, with no near-ties
    config = GPTConfig(vocab_size=50257, block_size=WINDOW, n_layer=2, n_head=2, n_embd=32)
    model = GPT(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.5)
    save_checkpoint(path, {"model": model.state_dict(), "model_config": model.config.to_dict()})
    return model


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    log_path: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def running_server(
    checkpoint: Path,
    log_path: Path,
    *flags: str,
    name: str | None = MODEL_NAME,
    source_flag: str = "--checkpoint-path",
) -> Iterator[Server]:
    """name: --served-model-name (None: the server's own default); source_flag: how the
    server is told `checkpoint` (--hf-model for a Hugging Face folder)."""
    named = ["--served-model-name", name] if name is not None else []
    command = [
        sys.executable, "-m", "roseinfer.cli.serve", source_flag, str(checkpoint),
        "--port", "0", "--device", "cpu", *named, *flags,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a tiny model: one thread is fastest
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, env=env)
    try:
        url = _wait_ready(process, log_path)
        yield Server(url, process, log_path)
    finally:
        stop(process)


def _wait_ready(process: subprocess.Popen, log_path: Path) -> str:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not selector.select(timeout=0.5):
                continue
            line = process.stdout.readline().decode()
            match = READY.search(line)
            if match:
                return match.group(1)
            if not line and process.poll() is not None:
                break
    raise AssertionError(f"the server did not start; its log:\n{log_path.read_text()}")


def stop(process: subprocess.Popen, timeout: float = 30) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    process.stdout.close()
    return process.returncode


def is_openai_error(response: httpx.Response, status: int) -> dict:
    """The response's error, checked to be OpenAI's shape with this status."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def metrics(server: Server) -> dict[str, float]:
    """GET /metrics as {'name{labels}': value}."""
    return parse_metrics(httpx.get(server.url + "/metrics").text)


def parse_metrics(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def wait_idle(server: Server, timeout: float = 20) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits; return the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(server)
        idle = values["rose_num_requests_running"] == 0 and values["rose_num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.05)


async def admitted(
    http: httpx.AsyncClient, server: Server, count: int, timeout: float = 30
) -> dict[str, float]:
    """Poll /metrics until the engine holds `count` requests (running or waiting): what a
    test waits on before it acts on requests in flight, instead of sleeping and hoping
    they have arrived. Returns the reading."""
    deadline = time.monotonic() + timeout
    while True:
        values = parse_metrics((await http.get(server.url + "/metrics")).text)
        held = values["rose_num_requests_running"] + values["rose_num_requests_waiting"]
        if held == count:
            return values
        assert time.monotonic() < deadline, f"the engine holds {held} requests, not {count}"
        await asyncio.sleep(0.02)


def solo_text(
    model: GPT, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams
) -> tuple[str, list[int], str]:
    """The oracle: (text, token ids, finish_reason) of the uncached run of one request."""
    decode = tokenizer.decode if params.stop else None
    with torch.no_grad():
        result = generate(
            model, prompt_ids, params, use_cache=False, eot_id=tokenizer.eot_id, decode=decode
        )
    text = tokenizer.decode(result.token_ids)
    if isinstance(result.stop_reason, str):  # the API leaves a matched stop string out
        text = text[: text.index(result.stop_reason)]
    return text, result.token_ids, result.finish_reason


def leave_a_non_streamed_request(server: Server, headers: dict[str, str]) -> int:
    """Send a long non-streamed request, leave (close the connection) once the engine
    runs it, and return how many tokens the server generated for it before it was
    aborted."""
    before = wait_idle(server)
    long = WINDOW - 24  # seconds of work: still running when the client leaves
    body = {"model": MODEL_NAME, "prompt": "ROMEO:", "max_tokens": long, "temperature": 0,
            "ignore_eos": True}  # fmt: skip

    async def send_and_leave() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, headers=headers) as http:
            request = asyncio.create_task(http.post("/completions", json=body, timeout=60))
            await admitted(http, server, 1)
            assert not request.done(), "the request finished before its client left"
            request.cancel()  # the client gives up: httpx closes the connection
            with contextlib.suppress(asyncio.CancelledError):
                await request

    asyncio.run(send_and_leave())
    after = wait_idle(server)
    assert after["rose_kv_blocks_used"] == 0
    aborted = 'rose_requests_finished_total{finish_reason="abort"}'
    assert after.get(aborted, 0) == before.get(aborted, 0) + 1, "not aborted"
    generated = after["rose_generation_tokens_total"] - before["rose_generation_tokens_total"]
    assert generated < long
    return int(generated)
