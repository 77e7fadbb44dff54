"""python -m benchmarks.onnx: decode speed of the ONNX graph in onnxruntime, side by side.

One process, one set of weights (random GPT-2 124M unless a model is given), exported
once to a temporary directory; then, interleaved round by round for each batch size:

* onnxruntime: the exported graph driven by roseinfer/loops/onnx_generate.py (numpy loop);
* rose eager: generate_batch on a StaticKVCache (PyTorch, no compile);
* rose compiled: the same with the decode step compiled (--compile: inductor's "default",
  seconds to compile, or "max-autotune", minutes, the fastest).

Greedy, ragged prompts of --prompt-len // 2 .. --prompt-len tokens as one left-padded
batch, --new-tokens each. Decode tokens/s counts every row's tokens after its first,
over the time after the first token (the prefill is not in it). Medians over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.decode import parse_batch_sizes, ragged_prompts
from roseinfer.cache.dense import StaticKVCache
from roseinfer.loops import onnx_generate
from roseinfer.loops.export_onnx import export, write_meta
from roseinfer.loops.generate import COMPILE_MODES, generate_batch
from roseinfer.loops.onnx_generate import OnnxModel
from roseinfer.request.sampling import SamplingParams
from roseinfer.request.sequence import GenerationResult
from rosetrainer.config import GPTConfig
from rosetrainer.errors import ArgumentParser, RoseError, run_cli
from rosetrainer.model import GPT

PROG = "benchmarks.onnx"
EAGER = "rose eager (static cache)"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=f"python -m {PROG}", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2", help="random-init shape (default: gpt2, 124M)")
    p.add_argument("--batch-sizes", default="1,16", help="comma list (default: 1,16)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; medians reported")
    p.add_argument(
        "--compile",
        default="default",
        choices=[*COMPILE_MODES, "none"],
        help="the compiled path's mode; 'none' leaves it out (default: default)",
    )
    p.add_argument(
        "--threads",
        type=int,
        help="threads for torch and for onnxruntime alike (default: each library's own; "
        "on a shared machine 1 is the steadiest comparison)",
    )
    p.add_argument("--seed", type=int, default=0)
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.threads is not None and args.threads < 1:
        raise RoseError(f"--threads must be >= 1, got {args.threads}")
    args.batch_sizes = parse_batch_sizes(args.batch_sizes)
    if not args.batch_sizes:
        raise RoseError("--batch-sizes is empty: give at least one batch size")
    if args.prompt_len < 2 or args.new_tokens < 2 or args.rounds < 1:
        raise RoseError("need --prompt-len >= 2, --new-tokens >= 2 and --rounds >= 1")
    return args


def status(message: str) -> None:
    print(f"[{PROG}] {message}", file=sys.stderr, flush=True)


def decode_tokens_per_s(results: list[GenerationResult]) -> float:
    """Every row's tokens after its first, over the time from the first token to the last."""
    tokens = sum(len(r.token_ids) - 1 for r in results)
    seconds = max(r.total_time_s for r in results) - min(r.time_to_first_token_s for r in results)
    return tokens / seconds


def bench(args: argparse.Namespace) -> int:
    config = GPTConfig.from_preset(args.preset)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = GPT(config).eval()
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    max_len = args.prompt_len + args.new_tokens
    if max_len > config.block_size:
        raise RoseError(f"--prompt-len + --new-tokens must fit block_size {config.block_size}")

    with tempfile.TemporaryDirectory(prefix="rose-onnx-bench-") as workdir:
        started = time.perf_counter()
        export(model, Path(workdir) / onnx_generate.MODEL_FILE)
        write_meta(model, Path(workdir), 50256, "gpt2", opset=18, source=f"random {args.preset}")
        # The session holds the weights: the files can go. Its threads must not spin between
        # runs, or they would slow the torch paths timed in between.
        onnx_model = OnnxModel(workdir, threads=args.threads, spin=False)
    status(f"exported {args.preset} in {time.perf_counter() - started:.0f} s")

    def run_torch(prompts: list[list[int]], mode: str | None) -> list[GenerationResult]:
        cache = StaticKVCache(model, batch_size=len(prompts), max_len=max_len)
        with torch.inference_mode():
            return generate_batch(model, prompts, params, cache=cache, compile=mode)

    paths = {
        "onnxruntime": lambda prompts: onnx_generate.generate_batch(onnx_model, prompts, params),
        EAGER: lambda prompts: run_torch(prompts, None),
    }
    if args.compile != "none":
        paths[f"rose compiled ({args.compile})"] = lambda prompts: run_torch(prompts, args.compile)

    generator = torch.Generator().manual_seed(args.seed)
    rows = []
    for batch_size in args.batch_sizes:
        prompts = ragged_prompts(batch_size, args.prompt_len, config.vocab_size, generator)
        for name, run in paths.items():  # warm-up (and the compile) outside the timing
            started = time.perf_counter()
            run(prompts)
            status(f"B={batch_size} {name}: warm-up {time.perf_counter() - started:.1f} s")
        speeds: dict[str, list[float]] = {name: [] for name in paths}
        tokens: dict[str, list[list[int]]] = {}
        for _ in range(args.rounds):
            for name, run in paths.items():
                results = run(prompts)
                speeds[name].append(decode_tokens_per_s(results))
                tokens[name] = [r.token_ids for r in results]
        reference = tokens[EAGER]
        for name in paths:
            same = "-" if name == EAGER else str(tokens[name] == reference)
            rows.append((batch_size, name, statistics.median(speeds[name]), same))

    print(
        f"decode tokens/s, {args.preset} random weights, fp32, CPU (torch: "
        f"{torch.get_num_threads()} threads, onnxruntime: {args.threads or 'its default'}), prompts {args.prompt_len // 2}..{args.prompt_len} tokens, "
        f"{args.new_tokens} new, median of {args.rounds}"
    )
    print(f"{'B':>3}  {'path':<30} {'tok/s':>9}  {'vs eager':>8}  same tokens as eager")
    for batch_size, name, speed, same in rows:
        eager = next(s for b, n, s, _ in rows if b == batch_size and n == EAGER)
        print(f"{batch_size:>3}  {name:<30} {speed:>9.1f}  {speed / eager:>7.2f}x  {same}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: bench(parse_args(argv)), PROG)


if __name__ == "__main__":
    sys.exit(main())
