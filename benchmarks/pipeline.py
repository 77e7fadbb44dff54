"""python -m benchmarks.pipeline: a split model's speed, side by side, in one run.

The model (GPT-2 small with random weights unless --checkpoint-path) is written to a
temporary checkpoint; --stages processes load their shares of it and run, in one
launch, these jobs:

1. one prompt, `--long-tokens` new tokens: the per-step latency at step 50 against
   step 1000 (each stage's static cache reads its whole buffer every step, so a step
   should cost the same late as early);
2. `--batch` ragged prompts, `--new-tokens` each: without micro-batches, then with
   `--micro-batches` interleaved and lockstep, in generated tokens/s; the bubble (the
   stages' idle share during decode) is printed next to the textbook
   (N - 1) / (m + N - 1).

Last, the same batch in this one process, on a static cache, for scale. Every batched
run's tokens are checked against each other (micro-batches change nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from roseinfer.cache.dense import StaticKVCache
from roseinfer.loops.generate import generate_batch
from roseinfer.pipeline import PipelineJob, PipelineSetup, run_pipeline
from roseinfer.pipeline.timeline import bubble, latency_at, step_latencies, textbook_bubble
from roseinfer.request.sampling import SamplingParams
from rosetrainer.checkpoint import load_model, save_checkpoint
from rosetrainer.config import GPTConfig
from rosetrainer.errors import ArgumentParser, run_cli
from rosetrainer.model import GPT


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="benchmarks.pipeline", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-path", help="a rose checkpoint (default: random gpt2 124M)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per stage")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--long-tokens", type=int, default=1008, help="0 skips the latency job")
    p.add_argument("--early-step", type=int, default=50)
    p.add_argument("--late-step", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=2, help="latency job repeats; medians reported")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--micro-batches", type=int, default=None, help="default: --stages")
    p.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")
    p.add_argument("--quick", action="store_true", help="tiny model, few tokens: a smoke test")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def model_file(args: argparse.Namespace, directory: Path) -> tuple[Path, GPT]:
    if args.checkpoint_path:
        model, _ = load_model(args.checkpoint_path)
        return Path(args.checkpoint_path), model.eval()
    torch.manual_seed(0)
    config = GPTConfig.from_preset("tiny") if args.quick else GPTConfig()
    model = GPT(config).eval()
    path = directory / "model.pt"
    save_checkpoint(path, {"model": model.state_dict(), "model_config": config.to_dict()})
    return path, model


def tokens_per_s(results: list) -> float:
    new_tokens = sum(len(r.token_ids) for r in results)
    return new_tokens / max(r.total_time_s for r in results)


def run(args: argparse.Namespace) -> dict:
    if args.quick:
        args.long_tokens, args.early_step, args.late_step = 60, 5, 50
        args.batch, args.new_tokens = 4, 8
    m = args.micro_batches or args.stages
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="rose-bench-pipeline-") as directory:
        path, model = model_file(args, Path(directory))
        vocab = model.config.vocab_size
        long_prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        batch = [
            [
                rng.randrange(vocab)
                for _ in range(rng.randint(args.prompt_len // 2, args.prompt_len))
            ]
            for _ in range(args.batch)
        ]
        long = SamplingParams(max_tokens=max(1, args.long_tokens), ignore_eos=True)
        params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
        rounds = max(1, args.rounds) if args.long_tokens else 0
        jobs = [PipelineJob([long_prompt], long) for _ in range(rounds)] + [
            PipelineJob(batch, params, dict(micro_batches=1)),
            PipelineJob(batch, params, dict(micro_batches=m)),
            PipelineJob(batch, params, dict(micro_batches=m, schedule="lockstep")),
        ]
        setup = PipelineSetup(str(path), args.stages, threads=args.threads)
        print(
            f"[bench_pipeline] {args.stages} stages, {args.threads} thread(s) each", file=sys.stderr
        )
        run_started = time.perf_counter()
        pipeline = run_pipeline(setup, jobs)
        launch_s = time.perf_counter() - run_started

        figures: dict = {"stages": args.stages, "launch_and_run_s": round(launch_s, 1)}
        results = pipeline.results
        if rounds:
            # a busy machine drifts over a minute: each round's early and late step, and
            # the median of the rounds
            early, late = [], []
            for job in range(rounds):
                latencies = step_latencies(pipeline.stages, job)
                early.append(latency_at(latencies, args.early_step - 1))
                late.append(latency_at(latencies, min(args.late_step, len(latencies)) - 1))
            figures["latency"] = {
                "early_step": args.early_step,
                "late_step": args.late_step,
                "early_ms": round(statistics.median(early) * 1000, 2),
                "late_ms": round(statistics.median(late) * 1000, 2),
                "late_over_early": round(statistics.median(late) / statistics.median(early), 3),
                "rounds_ms": [
                    [round(e * 1000, 1), round(la * 1000, 1)]
                    for e, la in zip(early, late, strict=True)
                ],
            }
            results = results[rounds:]
        first = len(jobs) - 3
        single, micro, lockstep = results
        figures["batch"] = {
            "rows": args.batch,
            "new_tokens": args.new_tokens,
            "micro_batches": m,
            "tokens_per_s_one_batch": round(tokens_per_s(single), 1),
            "tokens_per_s_micro_interleaved": round(tokens_per_s(micro), 1),
            "tokens_per_s_micro_lockstep": round(tokens_per_s(lockstep), 1),
            "bubble_one_batch": round(bubble(pipeline.stages, first), 3),
            "bubble_micro_interleaved": round(bubble(pipeline.stages, first + 1), 3),
            "bubble_micro_lockstep": round(bubble(pipeline.stages, first + 2), 3),
            "textbook_bubble_one_batch": round(textbook_bubble(args.stages, 1), 3),
            "textbook_bubble_micro": round(textbook_bubble(args.stages, m), 3),
            "same_tokens": [r.token_ids for r in single]
            == [r.token_ids for r in micro]
            == [r.token_ids for r in lockstep],
        }
        figures["stage_memory"] = [
            {
                "stage": r.stage,
                "layers": f"{r.layers[0]}-{r.layers[1] - 1}",
                "params": r.num_params,
                "param_mib": round(r.param_bytes / 2**20, 1),
                "cache_mib": round(r.cache_bytes / 2**20, 1),
                "peak_rss_mib": round(r.peak_rss_bytes / 2**20, 1),
            }
            for r in pipeline.stages
        ]
        # the same batch in this process, every core on it, for scale
        torch.set_num_threads(args.stages * args.threads)
        longest = max(map(len, batch))
        cache = StaticKVCache(model, len(batch), longest + args.new_tokens)
        whole = generate_batch(model, batch, params, cache=cache)
        figures["batch"]["tokens_per_s_one_process"] = round(tokens_per_s(whole), 1)
        figures["batch"]["one_process_same_tokens"] = [r.token_ids for r in whole] == [
            r.token_ids for r in single
        ]
    return figures


def print_figures(figures: dict) -> None:
    out = sys.stderr
    if "latency" in figures:
        lat = figures["latency"]
        print(
            f"per-step latency, 1 row: step {lat['early_step']} {lat['early_ms']:.1f} ms, "
            f"step {lat['late_step']} {lat['late_ms']:.1f} ms ({lat['late_over_early']:.2f}x; "
            f"per round {lat['rounds_ms']})",
            file=out,
        )
    b = figures["batch"]
    print(f"batch of {b['rows']} ragged prompts, {b['new_tokens']} new tokens each:", file=out)
    rows = [
        ("one batch through the stages", "one_batch", "textbook_bubble_one_batch"),
        (f"{b['micro_batches']} micro-batches, interleaved", "micro_interleaved", None),
        (
            f"{b['micro_batches']} micro-batches, lockstep",
            "micro_lockstep",
            "textbook_bubble_micro",
        ),
    ]
    for label, key, textbook in rows:
        book = f"  (textbook {b[textbook]:.0%})" if textbook else ""
        print(
            f"  {label:<32} {b['tokens_per_s_' + key]:>7.1f} tok/s  bubble {b['bubble_' + key]:.0%}"
            f"{book}",
            file=out,
        )
    print(f"  {'one process, all cores':<32} {b['tokens_per_s_one_process']:>7.1f} tok/s", file=out)
    print(
        f"  same tokens everywhere: {b['same_tokens'] and b['one_process_same_tokens']}", file=out
    )
    for s in figures["stage_memory"]:
        print(
            f"stage {s['stage']} (layers {s['layers']}): {s['params']:,} params "
            f"({s['param_mib']} MiB), cache {s['cache_mib']} MiB, peak RSS {s['peak_rss_mib']} MiB",
            file=out,
        )


def main(argv: list[str] | None = None) -> int:
    def _main() -> int:
        args = parse_args(argv)
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
        figures = run(args)
        print_figures(figures)
        if args.json:
            print(json.dumps(figures))
        return 0

    return run_cli(_main, "bench_pipeline")


if __name__ == "__main__":
    sys.exit(main())
