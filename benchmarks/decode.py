"""python -m benchmarks.decode: decode speed, side by side, on one set of weights.

One process times, interleaved round by round: the uncached oracle, the
concatenating cache, the static cache, the static cache with its decode step
compiled (inductor's default mode, and max-autotune with the weights frozen into
the graph), and Hugging Face `transformers` `generate` on the same weights (when it is
installed). Batch 1, greedy, a P-token prompt, N new tokens. It prints tokens/s,
ms/token, time to first token, per-step latency early vs late, speedups, and the
fraction of the memory roofline: the bytes a decode step must read (weights plus
the cache) against a streaming-read bandwidth measured in the same run.

A second table batches: for each B in --batch-sizes, B prompts of ragged lengths run
as one left-padded batch on a static cache, against the same prompts one by one,
interleaved round by round; it reports generated tokens/s of each and the speedup.
A decode step reads every weight once whatever B is, so batching buys throughput
until the step turns compute-bound.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from rosecourse.roofline import cache_bytes, weight_bytes
from roseinfer.cache.dense import ConcatKVCache, StaticKVCache
from roseinfer.engine.packed import PackedLinear, can_pack
from roseinfer.loops.generate import generate, generate_batch
from roseinfer.request.sampling import SamplingParams
from rosetrainer.config import GPTConfig
from rosetrainer.errors import ArgumentParser, RoseError, run_cli
from rosetrainer.model import GPT
from rosetrainer.runtime import DTYPES

ALL_PATHS = ("uncached", "concat", "static", "static+compile", "static+autotune", "hf")
# The static cache's decode step, eager or compiled in one of kv_cache.COMPILE_MODES.
STATIC_PATHS = {"static": None, "static+compile": "default", "static+autotune": "max-autotune"}


@dataclass
class PathResult:
    path: str
    tokens_per_s: float  # decode: tokens after the first, over the time after the first
    ms_per_token: float
    time_to_first_token_ms: float
    early_step_ms: float  # median step latency around step `early`
    late_step_ms: float  # ... and around step `late`
    bytes_per_token: float
    roofline_fraction: float
    tokens: list[int]
    step_ms: list[float]


@dataclass
class BatchResult:
    batch_size: int
    prompt_lengths: list[int]
    new_tokens: int  # over all rows
    batched_tokens_per_s: float  # one left-padded batch
    one_by_one_tokens_per_s: float  # the same prompts, one after another
    speedup: float
    tokens_agree: bool  # every batched row equals its prompt run alone


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="benchmarks.decode", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint-path", help="a rose checkpoint (default: random gpt2 124M)")
    src.add_argument("--hf-model", help="a local Hugging Face GPT-2 directory")
    p.add_argument("--preset", default="gpt2", help="random-init shape when no weights are given")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians reported")
    p.add_argument(
        "--paths", default=",".join(ALL_PATHS), help="comma list of " + ", ".join(ALL_PATHS)
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--early-step", type=int, default=50)
    p.add_argument("--late-step", type=int, default=None, help="default: the last steps")
    p.add_argument("--plot", default="runs/bench/decode_latency.png", help="'' to skip")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.add_argument("--quick", action="store_true", help="tiny model, few tokens: a smoke test")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--batch-sizes",
        help="comma list of batch sizes for the batched table; '' to skip "
        "(default: 1,4,16; with --quick: 1,4)",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.preset, args.prompt_len, args.new_tokens, args.rounds = "tiny", 8, 24, 1
        args.early_step = 4
    if args.batch_sizes is None:
        args.batch_sizes = "1,4" if args.quick else "1,4,16"
    args.batch_sizes = parse_batch_sizes(args.batch_sizes)
    if args.prompt_len < 1 or args.new_tokens < 2 or args.rounds < 1:
        raise RoseError("need --prompt-len >= 1, --new-tokens >= 2 and --rounds >= 1")
    args.paths = [name.strip() for name in args.paths.split(",") if name.strip()]
    unknown = sorted(set(args.paths) - set(ALL_PATHS))
    if unknown:
        raise RoseError(f"unknown path(s) {', '.join(unknown)}; choose from {', '.join(ALL_PATHS)}")
    return args


def load_model(args: argparse.Namespace) -> GPT:
    if args.checkpoint_path:
        from rosetrainer.checkpoint import load_model as load_checkpoint_model

        model, _ = load_checkpoint_model(args.checkpoint_path)
    elif args.hf_model:
        from rosetrainer.hf import load_hf_gpt2

        model = load_hf_gpt2(args.hf_model)
    else:
        torch.manual_seed(args.seed)
        model = GPT(GPTConfig.from_preset(args.preset))
    if args.prompt_len + args.new_tokens > model.config.block_size:
        raise RoseError(
            f"prompt ({args.prompt_len}) + new tokens ({args.new_tokens}) exceed the context "
            f"({model.config.block_size}); the bench times decoding inside one window"
        )
    return model.to(device=args.device, dtype=DTYPES[args.dtype]).eval()


def streaming_read_bandwidth(device: str, n_bytes: int = 1 << 30) -> float:
    """Bytes/s of reading a buffer far larger than the caches, as a decode step reads weights."""
    x = torch.ones(n_bytes // 4, device=device)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        x.sum()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return n_bytes / best


def matmul_rate(device: str, n: int = 1024) -> float:
    """Floating-point operations/s of a large float32 matrix product: the best of five,
    with PyTorch's default product and, on a CPU with oneDNN, with the weight packed for
    it once (as the engine multiplies), whichever is faster."""
    a = torch.randn(n, n, device=device)
    products = [lambda: a @ a]
    square = nn.Linear(n, n, bias=False, device=device)
    if can_pack(square):
        with torch.no_grad():
            square.weight.copy_(a)
        products.append(functools.partial(PackedLinear(square, n), a))
    best = float("inf")
    for product in products:
        for _ in range(5):
            _sync(device)
            start = time.perf_counter()
            product()
            _sync(device)
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class StepClock:
    """Timestamps: the start, then one per generated token."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.times: list[float] = []

    def start(self) -> None:
        _sync(self.device)
        self.times = [time.perf_counter()]

    def tick(self, *_: object) -> None:
        self.times.append(time.perf_counter())


def run_rose(
    model: GPT, prompt: list[int], n: int, path: str, clock: StepClock, max_len: int
) -> list[int]:
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    cache = None
    if path == "concat":
        cache = ConcatKVCache()
    elif path in STATIC_PATHS:
        cache = StaticKVCache(model, max_len=max_len)
    clock.start()
    result = generate(
        model,
        prompt,
        params,
        use_cache=path != "uncached",
        cache=cache,
        on_token=clock.tick,
        compile=STATIC_PATHS.get(path),
    )
    return result.token_ids


def parse_batch_sizes(text: str) -> list[int]:
    """--batch-sizes: a comma list of integers >= 1 ('' is none)."""
    try:
        sizes = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise RoseError(f"--batch-sizes takes a comma list of integers, got {text!r}") from None
    if any(b < 1 for b in sizes):
        raise RoseError(f"batch sizes must be >= 1, got {sizes}")
    return sizes


def ragged_prompts(
    n: int, prompt_len: int, vocab_size: int, generator: torch.Generator
) -> list[list[int]]:
    """n random prompts of lengths between prompt_len // 2 and prompt_len (a ragged batch
    that still leaves room for the new tokens in the window)."""
    lengths = torch.randint(max(1, prompt_len // 2), prompt_len + 1, (n,), generator=generator)
    return [torch.randint(vocab_size, (int(k),), generator=generator).tolist() for k in lengths]


def run_batched(
    model: GPT, prompts: list[list[int]], n: int, clock: StepClock, max_len: int
) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    cache = StaticKVCache(model, batch_size=len(prompts), max_len=max_len)
    clock.start()
    results = generate_batch(model, prompts, params, cache=cache, on_token=clock.tick)
    return [result.token_ids for result in results]


def elapsed(clock: StepClock) -> float:
    return clock.times[-1] - clock.times[0]


def bench_batches(model: GPT, args: argparse.Namespace) -> list[BatchResult]:
    """Per batch size: one batch vs one by one, static caches, interleaved round by round."""
    generator = torch.Generator().manual_seed(args.seed)
    max_len = args.prompt_len + args.new_tokens
    results = []
    for batch_size in args.batch_sizes:
        prompts = ragged_prompts(batch_size, args.prompt_len, model.config.vocab_size, generator)
        run_batched(model, prompts, 4, StepClock(args.device), max_len)  # warm-up
        batched_s, one_by_one_s = [], []
        for round_idx in range(args.rounds):
            batch_clock = StepClock(args.device)
            batched = run_batched(model, prompts, args.new_tokens, batch_clock, max_len)
            batched_s.append(elapsed(batch_clock))
            prompt_clocks = [StepClock(args.device) for _ in prompts]
            one_by_one = [
                run_rose(model, prompt, args.new_tokens, "static", prompt_clock, max_len)
                for prompt, prompt_clock in zip(prompts, prompt_clocks, strict=True)
            ]
            one_by_one_s.append(sum(map(elapsed, prompt_clocks)))
            print(
                f"[benchmarks.decode] round {round_idx + 1}: batch of {batch_size} done",
                file=sys.stderr,
            )
        new_tokens = sum(map(len, batched))
        batched_tps = new_tokens / statistics.median(batched_s)
        one_by_one_tps = new_tokens / statistics.median(one_by_one_s)
        results.append(
            BatchResult(
                batch_size=batch_size,
                prompt_lengths=[len(prompt) for prompt in prompts],
                new_tokens=new_tokens,
                batched_tokens_per_s=batched_tps,
                one_by_one_tokens_per_s=one_by_one_tps,
                speedup=batched_tps / one_by_one_tps,
                tokens_agree=batched == one_by_one,
            )
        )
    return results


def make_hf_runner(model: GPT):
    """The same weights in transformers' GPT2LMHeadModel, and a function that times generate."""
    from transformers.generation.streamers import BaseStreamer

    from rosetrainer.hf import to_hf_gpt2

    hf_model = to_hf_gpt2(model).eval()

    class ClockStreamer(BaseStreamer):
        def __init__(self, clock: StepClock) -> None:
            self.clock, self.seen_prompt = clock, False

        def put(self, value: torch.Tensor) -> None:
            if self.seen_prompt:  # generate first puts the prompt, then each new token
                self.clock.tick()
            self.seen_prompt = True

        def end(self) -> None:
            pass

    def run(prompt: list[int], n: int, clock: StepClock) -> list[int]:
        ids = torch.tensor([prompt], device=model.lm_head.weight.device)
        clock.start()
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            streamer=ClockStreamer(clock),
        )
        return out[0, len(prompt) :].tolist()

    return run


def summarize(
    path: str,
    runs: list[StepClock],
    tokens: list[int],
    model: GPT,
    args: argparse.Namespace,
    bandwidth: float,
) -> PathResult:
    step_ms = [
        statistics.median((clock.times[i + 1] - clock.times[i]) * 1e3 for clock in runs)
        for i in range(len(runs[0].times) - 1)
    ]
    decode_s = statistics.median(clock.times[-1] - clock.times[1] for clock in runs)
    tps = (len(step_ms) - 1) / decode_s
    late = args.late_step if args.late_step is not None else len(step_ms) - 6

    def around(step: int) -> float:
        lo, hi = max(1, step - 5), min(len(step_ms), step + 6)
        return statistics.median(step_ms[lo:hi])

    if path in STATIC_PATHS:
        positions = args.prompt_len + args.new_tokens  # the whole buffer is read every step
    elif path == "uncached":
        positions = 0.0  # recomputes instead of reading a cache
    else:
        positions = args.prompt_len + args.new_tokens / 2  # the mean context of the run
    per_token = weight_bytes(model) + cache_bytes(model, positions)
    return PathResult(
        path=path,
        tokens_per_s=tps,
        ms_per_token=1e3 / tps,
        time_to_first_token_ms=step_ms[0],
        early_step_ms=around(min(args.early_step, len(step_ms) - 1)),
        late_step_ms=around(late),
        bytes_per_token=per_token,
        roofline_fraction=tps * per_token / bandwidth,
        tokens=tokens,
        step_ms=step_ms,
    )


def print_heading(title: str, header: str) -> None:
    print(f"\n{title}\n{header}\n{'-' * len(header)}")


def print_table(results: list[PathResult], args: argparse.Namespace, bandwidth: float) -> None:
    base = {r.path: r.tokens_per_s for r in results}
    print_heading(
        f"decode, batch 1, greedy: {args.prompt_len}-token prompt, {args.new_tokens} new tokens, "
        f"{args.dtype} on {args.device}, median of {args.rounds} interleaved round(s); "
        f"streaming read {bandwidth / 1e9:.1f} GB/s",
        f"{'path':<15}{'tok/s':>9}{'ms/tok':>9}{'TTFT ms':>9}{'early ms':>10}{'late ms':>9}"
        f"{'late/early':>11}{'vs uncached':>12}{'vs HF':>7}{'roofline':>10}",
    )
    for r in results:
        vs_unc = f"{r.tokens_per_s / base['uncached']:.1f}x" if "uncached" in base else "-"
        vs_hf = f"{r.tokens_per_s / base['hf']:.2f}x" if "hf" in base else "-"
        print(
            f"{r.path:<15}{r.tokens_per_s:>9.1f}{r.ms_per_token:>9.2f}"
            f"{r.time_to_first_token_ms:>9.1f}{r.early_step_ms:>10.2f}{r.late_step_ms:>9.2f}"
            f"{r.late_step_ms / r.early_step_ms:>11.2f}{vs_unc:>12}{vs_hf:>7}"
            f"{r.roofline_fraction:>9.0%}"
        )


def print_batch_table(results: list[BatchResult], args: argparse.Namespace) -> None:
    print_heading(
        f"batched decode, greedy, static cache: prompts of {max(1, args.prompt_len // 2)}.."
        f"{args.prompt_len} tokens, {args.new_tokens} new tokens each, {args.dtype} on "
        f"{args.device}, median of {args.rounds} interleaved round(s)",
        f"{'batch':>5}{'new tokens':>12}{'batched tok/s':>15}{'one-by-one tok/s':>18}"
        f"{'speedup':>9}{'same tokens':>13}",
    )
    for r in results:
        print(
            f"{r.batch_size:>5}{r.new_tokens:>12}{r.batched_tokens_per_s:>15.1f}"
            f"{r.one_by_one_tokens_per_s:>18.1f}{r.speedup:>8.2f}x"
            f"{'yes' if r.tokens_agree else 'NO':>13}"
        )


def plot(results: list[PathResult], path: str, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot(range(1, len(r.step_ms)), r.step_ms[1:], label=r.path, linewidth=1)
    ax.set_xlabel("decode step")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.set_title(f"per-step decode latency, {args.dtype} {args.device}, prompt {args.prompt_len}")
    ax.legend()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def bench(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise RoseError("--device cuda, but CUDA is not available here; use --device cpu")
    model = load_model(args)
    paths = list(args.paths)
    runners = {}
    if "hf" in paths:
        try:
            runners["hf"] = make_hf_runner(model)
        except ImportError:
            print(
                "[benchmarks.decode] transformers is not installed: skipping hf",
                file=sys.stderr,
            )
            paths.remove("hf")
    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(
        model.config.vocab_size, (args.prompt_len,), generator=generator
    ).tolist()
    bandwidth = streaming_read_bandwidth(args.device)

    def run(path: str, n: int, clock: StepClock) -> list[int]:
        if path == "hf":
            return runners["hf"](prompt, n, clock)
        # One cache length for warm-up and timed runs: the compiled step keeps its graph.
        return run_rose(model, prompt, n, path, clock, max_len=args.prompt_len + args.new_tokens)

    with torch.inference_mode():
        for path in paths:  # warm-up (and the compile) outside the timed rounds
            run(path, 4, StepClock(args.device))
        clocks: dict[str, list[StepClock]] = {path: [] for path in paths}
        tokens: dict[str, list[int]] = {}
        for round_idx in range(args.rounds):
            for path in paths:
                clock = StepClock(args.device)
                tokens[path] = run(path, args.new_tokens, clock)
                clocks[path].append(clock)
                print(f"[benchmarks.decode] round {round_idx + 1}: {path} done", file=sys.stderr)

        batch_results = bench_batches(model, args)

    results = [summarize(p, clocks[p], tokens[p], model, args, bandwidth) for p in paths]
    reference = tokens[paths[0]]
    agree = {p: tokens[p] == reference for p in paths}
    if args.json:
        payload = {
            "args": {k: v for k, v in vars(args).items()},
            "bandwidth_bytes_per_s": bandwidth,
            "results": [asdict(r) for r in results],
            "tokens_agree": agree,
            "batched": [asdict(r) for r in batch_results],
        }
        print(json.dumps(payload))
    else:
        print_table(results, args, bandwidth)
        print(
            f"same tokens as {paths[0]}: "
            + ", ".join(f"{p} {'yes' if ok else 'NO'}" for p, ok in agree.items())
        )
        if args.dtype != "float32" and not all(agree.values()):
            print(
                f"({args.dtype}: kernels that sum in another order round differently, and a "
                "random model's near-ties then flip; identical tokens are float32's promise)"
            )
        if batch_results:
            print_batch_table(batch_results, args)
    if args.plot:
        plot(results, args.plot, args)
        print(f"[benchmarks.decode] per-step latency plot: {args.plot}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: bench(argv), "benchmarks.decode")


if __name__ == "__main__":
    sys.exit(main())
