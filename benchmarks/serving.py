"""python -m benchmarks.serving: load for any OpenAI-compatible server, and what it measured.

    python -m benchmarks.serving --base-url http://127.0.0.1:8000/v1 \\
        --request-rate 1,4,inf --num-prompts 64 --input-len 128 --output-len 64

For each request rate it sends --num-prompts streaming completions, arriving as a
Poisson process (exponential gaps with mean 1/rate; `inf` sends them all at once), and
times every streamed chunk. Per rate it reports request throughput, output tokens/s and
the usual latencies (mean, p50, p90, p99, in ms):

* TTFT, time to first token: request sent -> first chunk with text;
* TPOT, time per output token: (e2e - TTFT) / (output tokens - 1), per request;
* ITL, inter-token latency: the gap between consecutive chunks, over all requests;
* e2e: request sent -> last chunk.

Prompts are windows of TinyShakespeare (--dataset-path) or random token ids (--random),
their lengths drawn from a seeded range around --input-len; --prefix-len puts one shared
prefix in front of every prompt (what prefix caching is for). The same seed gives the
same prompts and arrival times to every server, so runs compare side by side. Output
tokens are counted from the server's usage when it reports it, else one per chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from tqdm.asyncio import tqdm

from rosetrainer.errors import ArgumentParser, RoseError, run_cli
from rosetrainer.tokenizer import Tokenizer

PROG = "bench_serving"
DEFAULT_DATASET = Path("../shared/data/tinyshakespeare.txt")
PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class RateResult:
    request_rate: float  # offered (inf: all at once)
    num_prompts: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_output_tokens: int
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    errors: list[str]


def summarize(values_s: list[float]) -> dict[str, float]:
    """mean and percentiles, in milliseconds (NaN when there is nothing to summarize)."""
    if not values_s:
        return {"mean": math.nan, **{f"p{p}": math.nan for p in PERCENTILES}}
    ms = sorted(v * 1000 for v in values_s)

    def percentile(p: int) -> float:  # linear interpolation between closest ranks
        k = (len(ms) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return ms[lo] + (ms[hi] - ms[lo]) * (k - lo)

    return {"mean": statistics.fmean(ms), **{f"p{p}": percentile(p) for p in PERCENTILES}}


# -- prompts --


def make_prompts(
    tokenizer: Tokenizer,
    num_prompts: int,
    input_len: int,
    range_ratio: float,
    prefix_len: int,
    dataset_path: Path | None,
    seed: int,
) -> list[str]:
    """Prompt texts of about input_len tokens (+ the shared prefix), the same for one seed."""
    rng = random.Random(seed)
    if dataset_path is not None:
        if not dataset_path.is_file():
            raise RoseError(f"--dataset-path {dataset_path} is not a file; use --random instead")
        corpus = tokenizer.encode(dataset_path.read_text(encoding="utf-8"))
    else:
        corpus = [rng.randrange(tokenizer.n_vocab - 1) for _ in range(1 << 16)]
    longest = prefix_len + math.ceil(input_len * (1 + range_ratio))
    if len(corpus) <= longest:
        raise RoseError(f"the dataset has {len(corpus)} tokens; prompts need {longest}")
    prefix = corpus[:prefix_len]  # one prefix for every prompt
    low = max(1, math.floor(input_len * (1 - range_ratio)))
    high = max(low, math.ceil(input_len * (1 + range_ratio)))
    prompts = []
    for _ in range(num_prompts):
        length = rng.randint(low, high)
        start = rng.randrange(prefix_len, len(corpus) - length)
        prompts.append(tokenizer.decode(prefix + corpus[start : start + length]))
    return prompts


def arrival_gaps(num: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential gaps (a Poisson process)."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(num)]


# -- one request --


async def send(
    http: httpx.AsyncClient, model: str, prompt: str, prompt_tokens: int, args: argparse.Namespace
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": args.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    result = RequestResult(ok=False, prompt_tokens=prompt_tokens)
    chunks, usage_tokens, last = 0, None, None
    start = time.perf_counter()
    try:
        async with http.stream("POST", "/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                result.error = f"HTTP {response.status_code}: {detail}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if payload.get("usage"):
                    usage_tokens = payload["usage"].get("completion_tokens")
                choices = payload.get("choices") or []
                if not any(c.get("text") for c in choices):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last, chunks = now, chunks + 1
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        result.error = f"{type(err).__name__}: {err}"
        return result
    if last is None:
        result.error = "no text came back"
        return result
    result.ok = True
    result.e2e_s = last - start
    result.output_tokens = usage_tokens if usage_tokens else chunks
    return result


# -- one rate --


async def run_rate(
    base_url: str,
    model: str,
    prompts: list[str],
    prompt_tokens: list[int],
    rate: float,
    args: argparse.Namespace,
) -> RateResult:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    gate = asyncio.Semaphore(args.max_concurrency or len(prompts))
    async with httpx.AsyncClient(
        base_url=base_url, headers=auth_headers(args), limits=limits, timeout=args.timeout
    ) as http:
        bar = tqdm(total=len(prompts), desc=f"rate {rate:g}/s", disable=args.quiet)

        async def one(prompt: str, n_tokens: int) -> RequestResult:
            async with gate:
                result = await send(http, model, prompt, n_tokens, args)
            bar.update(1)
            return result

        tasks = []
        start = time.perf_counter()
        for gap, prompt, n_tokens in zip(
            arrival_gaps(len(prompts), rate, args.seed), prompts, prompt_tokens, strict=True
        ):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(prompt, n_tokens)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    return RateResult(
        request_rate=rate,
        num_prompts=len(prompts),
        completed=len(done),
        failed=len(results) - len(done),
        duration_s=duration,
        request_throughput=len(done) / duration,
        output_throughput=output_tokens / duration,
        total_output_tokens=output_tokens,
        ttft_ms=summarize([r.ttft_s for r in done]),
        tpot_ms=summarize([r.tpot_s for r in done if r.tpot_s is not None]),
        itl_ms=summarize([gap for r in done for gap in r.itl_s]),
        e2e_ms=summarize([r.e2e_s for r in done]),
        errors=sorted({r.error for r in results if not r.ok})[:5],
    )


def auth_headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def served_model(base_url: str, args: argparse.Namespace) -> str:
    async with httpx.AsyncClient(base_url=base_url, headers=auth_headers(args)) as http:
        response = await http.get("/models", timeout=args.timeout)
        response.raise_for_status()
        return response.json()["data"][0]["id"]


async def warm_up(base_url: str, model: str, prompt: str, args: argparse.Namespace) -> None:
    """One untimed request: a server may load its model, or compile, on the first one."""
    async with httpx.AsyncClient(
        base_url=base_url, headers=auth_headers(args), timeout=args.timeout
    ) as http:
        warm = argparse.Namespace(**{**vars(args), "output_len": 4})
        result = await send(http, model, prompt, 0, warm)
        if not result.ok:
            raise RoseError(f"the warm-up request failed: {result.error}")


def benchmark(args: argparse.Namespace) -> list[RateResult]:
    """Every rate in turn against args.base_url; the results, one per rate."""
    return asyncio.run(run_benchmark(args))


def load_prompts(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """The load's prompts and their token counts, from the load flags."""
    tokenizer = Tokenizer("gpt2")
    dataset = None if args.random else Path(args.dataset_path or DEFAULT_DATASET)
    if dataset is not None and args.dataset_path is None and not dataset.is_file():
        dataset = None  # no local TinyShakespeare: random token ids
    prompts = make_prompts(
        tokenizer, args.num_prompts, args.input_len, args.range_ratio, args.prefix_len,
        dataset, args.seed,
    )  # fmt: skip
    return prompts, [len(tokenizer.encode(p)) for p in prompts]


async def run_benchmark(args: argparse.Namespace) -> list[RateResult]:
    """`benchmark` for code already inside an event loop (a notebook: `await` it)."""
    prompts, prompt_tokens = load_prompts(args)
    base_url = args.base_url.rstrip("/")
    try:
        model = args.model or await served_model(base_url, args)
        await warm_up(base_url, model, prompts[0], args)
        return [
            await run_rate(base_url, model, prompts, prompt_tokens, rate, args)
            for rate in args.request_rate
        ]
    except httpx.ConnectError:
        raise RoseError(f"no server answers at {base_url}: start one, or fix --base-url") from None


# -- reporting --


def table(results: dict[str, list[RateResult]]) -> str:
    """One row per (label, rate)."""
    head = (
        f"{'server':<16} {'rate':>6} {'done':>5} {'req/s':>6} {'out tok/s':>9} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
        f"{'ITL p50':>8} {'e2e p50':>8} {'e2e p99':>8}"
    )
    rows = [head, "-" * len(head)]
    for label, per_rate in results.items():
        for r in per_rate:
            rows.append(
                f"{label:<16} {r.request_rate:>6g} {r.completed:>5} {r.request_throughput:>6.2f} "
                f"{r.output_throughput:>9.1f} {r.ttft_ms['p50']:>9.0f} {r.ttft_ms['p99']:>9.0f} "
                f"{r.tpot_ms['p50']:>9.1f} {r.tpot_ms['p99']:>9.1f} {r.itl_ms['p50']:>8.1f} "
                f"{r.e2e_ms['p50']:>8.0f} {r.e2e_ms['p99']:>8.0f}"
            )
    return "\n".join(rows)


def plot(results: dict[str, list[RateResult]], path: Path) -> None:
    """Latency against achieved request throughput, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("e2e_ms", "end-to-end (ms)")]
    for ax, (key, title) in zip(axes, panels, strict=True):
        for label, per_rate in results.items():
            x = [r.request_throughput for r in per_rate]
            for pct, style in (("p50", "-o"), ("p99", "--x")):
                ax.plot(x, [getattr(r, key)[pct] for r in per_rate], style, label=f"{label} {pct}")
        ax.set_xlabel("achieved requests/s")
        ax.set_title(title)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_json(results: dict[str, list[RateResult]], path: Path, args: argparse.Namespace) -> None:
    settings = {k: v for k, v in vars(args).items() if k != "api_key"}
    payload = {
        "settings": settings,
        "results": {label: [asdict(r) for r in rs] for label, rs in results.items()},
    }
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


# -- command line --


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",")]  # float("inf") is inf
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"rates are numbers or inf, comma-separated: {text!r}"
        ) from None
    if any(not rate > 0 for rate in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0: {text!r}")
    return rates


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that shape the load (shared with bench_serving_compare)."""
    p.add_argument(
        "--request-rate",
        type=parse_rates,
        default=[math.inf],
        help="requests/s, comma-separated; inf sends all at once (default: inf)",
    )
    p.add_argument("--num-prompts", type=int, default=64, help="requests per rate (default: 64)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens, about (default 128)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens (default: 64)")
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.5,
        help="prompt lengths are drawn from input-len * [1 - r, 1 + r] (default 0.5)",
    )
    p.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="tokens of one shared prefix in front of every prompt (default: 0)",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--dataset-path", help=f"a text file (default: {DEFAULT_DATASET} if there)")
    source.add_argument("--random", action="store_true", help="random token ids as prompts")
    p.add_argument("--temperature", type=float, default=0.0, help="default: 0 (greedy)")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos (rose and vLLM know it; not every server does)",
    )
    p.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: all)")
    p.add_argument("--seed", type=int, default=0, help="prompts and arrival times (default: 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--quiet", action="store_true", help="no progress bar")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    p.add_argument("--model", help="the model name to send (default: the server's first)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--label", default="server", help="this server's name in the table")
    add_load_arguments(p)
    p.add_argument("--json", default="bench_serving.json", help="where the results go")
    p.add_argument("--plot", default="bench_serving.png", help="latency-vs-rate plot ('' for none)")
    return p


def check(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise RoseError(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.range_ratio < 1:
        raise RoseError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if args.prefix_len < 0:
        raise RoseError(f"--prefix-len must be >= 0, got {args.prefix_len}")


def run(args: argparse.Namespace) -> int:
    check(args)
    results = {args.label: benchmark(args)}
    print(table(results))
    save_json(results, Path(args.json), args)
    if args.plot:
        plot(results, Path(args.plot))
    print(f"[{PROG}] wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: run(build_parser().parse_args(argv)), PROG)


if __name__ == "__main__":
    sys.exit(main())
