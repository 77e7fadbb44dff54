"""python -m benchmarks.live_page: engine throughput with the live page open, and without.

    rose-serve --checkpoint-path checkpoints/tiny &
    python -m benchmarks.live_page --base-url http://127.0.0.1:8000/v1 --rounds 3 \\
        --num-prompts 32 --input-len 64 --output-len 64 --random --ignore-eos

An open page holds one /live/events stream: while it is open the engine thread takes a
snapshot between steps (at most 10 a second) and the event loop serializes and sends
it. This program sends one load (bench_serving's: the same prompts every time, all at
once by default) in rounds that alternate between no stream open and --watchers streams
open, each read and parsed event by event as the page does. Alternating lets a machine
whose speed drifts (a shared one) drift for both alike. It prints each round's output
tokens/s and the ratio of the medians, open over closed. The browser's drawing is not
measured: it runs in the browser's process, usually on another machine.

On a busy machine two runs of one load differ by more than the page costs, so
`--checkpoint-path` measures the cost itself, with no server: the engine runs the load
in this process, and the live page's hook (and the serializing of each snapshot, which
the server does on its event loop) is timed beside the steps, watched and not:

    python -m benchmarks.live_page --checkpoint-path checkpoints/tiny --rounds 3 \
        --num-prompts 32 --input-len 64 --output-len 64 --random --ignore-eos
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys

import httpx

from benchmarks import serving as bench_serving
from rosetrainer.errors import ArgumentParser, RoseError, run_cli

PROG = "bench_live_page"
SETTLE_S = 0.5  # before each round: the streams are open and the engine sees them


async def watch(url: str, headers: dict[str, str], events: list[int]) -> None:
    """Read /live/events as the page does, counting the snapshots, until cancelled."""
    async with (
        httpx.AsyncClient(headers=headers, timeout=None) as http,
        http.stream("GET", url) as response,
    ):
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:200]
            raise RoseError(f"GET {url}: HTTP {response.status_code} {detail}")
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                json.loads(line[5:])
                events[0] += 1


async def one_round(
    args: argparse.Namespace, model: str, prompts: list[str], prompt_tokens: list[int], open_: bool
) -> tuple[float, float]:
    """(output tokens/s, snapshots received per second) of one run of the load."""
    base_url = args.base_url.rstrip("/")
    url = base_url.removesuffix("/v1") + "/live/events"
    events = [0]
    watchers = [
        asyncio.create_task(watch(url, bench_serving.auth_headers(args), events))
        for _ in range(args.watchers if open_ else 0)
    ]
    try:
        await asyncio.sleep(SETTLE_S)
        for task in watchers:
            if task.done():
                task.result()  # a watcher that failed (401, no live page) says why
        result = await bench_serving.run_rate(
            base_url, model, prompts, prompt_tokens, args.request_rate[0], args
        )
    finally:
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
    if result.failed:
        raise RoseError(f"{result.failed} requests failed: {result.errors}")
    return result.output_throughput, events[0] / result.duration_s


async def compare(args: argparse.Namespace) -> dict[str, list[float]]:
    """Output tokens/s per round, page closed and open."""
    prompts, prompt_tokens = bench_serving.load_prompts(args)
    base_url = args.base_url.rstrip("/")
    try:
        model = args.model or await bench_serving.served_model(base_url, args)
        await bench_serving.warm_up(base_url, model, prompts[0], args)
    except httpx.ConnectError:
        raise RoseError(f"no server answers at {base_url}: start one, or fix --base-url") from None
    throughput: dict[str, list[float]] = {"closed": [], "open": []}
    for number in range(1, args.rounds + 1):
        for mode in ("closed", "open"):
            tps, events = await one_round(args, model, prompts, prompt_tokens, mode == "open")
            throughput[mode].append(tps)
            print(
                f"round {number}  page {mode:<6}  {tps:9.1f} output tokens/s  "
                f"{events:5.1f} snapshots/s",
                flush=True,
            )
    return throughput


def hook_share(args: argparse.Namespace) -> None:
    """The load through an in-process engine: per round, watched and not, the steps'
    tokens/s and the CPU time in the live page's hook as a share of the steps' (torch on
    one thread: OMP_NUM_THREADS=1, or the steps' other threads go uncounted)."""
    import time

    from roseinfer.engine.config import EngineConfig
    from roseinfer.engine.llm_engine import LLMEngine, RequestOutputKind
    from roseinfer.loading import load_model_and_tokenizer
    from roseinfer.request.sampling_params import SamplingParams
    from roseinfer.serving.live import LiveState

    model, tokenizer, _ = load_model_and_tokenizer(args.checkpoint_path)
    engine = LLMEngine(model, tokenizer, EngineConfig())
    live = LiveState(engine)
    prompts, _ = bench_serving.load_prompts(args)
    params = SamplingParams(
        max_tokens=args.output_len, temperature=args.temperature, ignore_eos=args.ignore_eos
    )
    # Round 0 is a warm-up (it also fills the prefix cache, as it stays for later rounds).
    for number in range(args.rounds + 1):
        for watched in (False, True):
            for prompt in prompts:  # (DELTA outputs, as rose-serve's)
                engine.add_request(prompt, params, output_kind=RequestOutputKind.DELTA)
            tokens, step_s, hook_s, sent = engine.generation_tokens, 0.0, 0.0, live.version()
            began = time.perf_counter()
            while engine.has_unfinished():
                started = time.thread_time()  # CPU time: a busy machine's waits left out
                engine.step()
                stepped = time.thread_time()
                if watched:
                    live.watch()  # what an open page's stream does every tenth of a second
                live.after_step()
                if watched and live.version() != sent:
                    sent = live.version()
                    live.snapshot_json()
                hook_s += time.thread_time() - stepped
                step_s += stepped - started
            if number:
                tps = (engine.generation_tokens - tokens) / (time.perf_counter() - began)
                print(
                    f"round {number}  page {'open' if watched else 'closed':<6}  {tps:9.1f} "
                    f"output tokens/s  hook {100 * hook_s / step_s:6.3f}% of step CPU time",
                    flush=True,
                )


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m benchmarks.live_page", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    p.add_argument("--model", help="the model name to send (default: the server's first)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument(
        "--checkpoint-path", help="no server: time the live page's hook in an in-process engine"
    )
    p.add_argument("--rounds", type=int, default=3, help="closed/open pairs (default: 3)")
    p.add_argument(
        "--watchers",
        type=int,
        default=1,
        help="pages open in a round (default: 1); past 4 start the server with a larger "
        "--max-live-watchers-per-client",
    )
    bench_serving.add_load_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    bench_serving.check(args)
    if args.rounds < 1 or args.watchers < 1:
        raise RoseError("--rounds and --watchers must be >= 1")
    if len(args.request_rate) != 1:
        raise RoseError(f"give one --request-rate, got {len(args.request_rate)}")
    if args.checkpoint_path:
        hook_share(args)
        return 0
    args.quiet = True  # one line per round instead of progress bars
    throughput = asyncio.run(compare(args))
    closed, open_ = (statistics.median(throughput[m]) for m in ("closed", "open"))
    print(
        f"median output tokens/s: page closed {closed:.1f}, open {open_:.1f}; "
        f"open/closed = {open_ / closed:.3f}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: run(build_parser().parse_args(argv)), PROG)


if __name__ == "__main__":
    sys.exit(main())
