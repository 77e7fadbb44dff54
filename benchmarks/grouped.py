"""python -m benchmarks.grouped: what grouped-query attention saves in the engine's pool.

    python -m benchmarks.grouped           # SmolLM2-135M's shape, random weights, 32 requests
    python -m benchmarks.grouped --quick   # a tiny model, a few requests (a smoke test)

Two Llama-shaped models of the same width, random weights: SmolLM2-135M's shape (9 query
heads over 3 key/value heads) and the same with one key/value head per query head. Each
serves the same workload (benchmarks.engine's: seeded prompts and output lengths,
end-of-text ignored) on the engine, all requests at once, in one pool of the same bytes.
It prints, for each, the KV bytes the pool holds per live token over the run (blocks in
use, over the tokens the running sequences hold: block rounding included) beside what
the model's key/value heads take per token (2 * layers * kv_heads * head_dim numbers),
how many blocks (tokens) fit in the pool, and output tokens/s. The grouped model's tokens
are checked against the uncached oracle for the first requests.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from benchmarks.engine import FULL, QUICK, make_requests, run_engine, timed
from rosecourse.demo import wide_random_init
from roseinfer.cache.quantized import kv_bytes_per_token
from roseinfer.engine.config import EngineConfig
from roseinfer.loops.generate import generate
from roseinfer.request.sampling import SamplingParams
from rosetrainer.config import GPTConfig
from rosetrainer.errors import ArgumentParser, RoseError, run_cli
from rosetrainer.model import GPT
from rosetrainer.tokenizer import Tokenizer

QUICK_CONFIG = GPTConfig.from_preset(
    "tiny-llama", n_layer=2, n_head=6, n_kv_head=2, n_embd=48, mlp_hidden=64, block_size=64
)
ORACLE_CHECKS = 2  # requests whose tokens are checked against the uncached oracle


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m benchmarks.grouped", description=__doc__)
    p.add_argument("--quick", action="store_true", help="a tiny model and a few requests")
    p.add_argument("--requests", type=int, help="how many requests (default: 32; quick: 8)")
    p.add_argument("--kv-cache-memory", default="64MiB", help="the pool's bytes (default: 64MiB)")
    p.add_argument("--seed", type=int, default=0)
    return p


def models(quick: bool) -> dict[str, GPT]:
    """name -> model: the grouped shape and the same width with every head its own keys."""
    grouped = QUICK_CONFIG if quick else GPTConfig.from_preset("smollm2-135m", block_size=512)
    ungrouped = dataclasses.replace(grouped, n_kv_head=None)
    return {
        f"{grouped.n_head} q / {grouped.kv_heads} kv heads": wide_random_init(GPT(grouped), 0),
        f"{ungrouped.n_head} q / {ungrouped.kv_heads} kv heads": wide_random_init(
            GPT(ungrouped), 0
        ),
    }


def run(args: argparse.Namespace) -> int:
    if args.requests is not None and args.requests < 1:
        raise RoseError(f"--requests must be >= 1, got {args.requests}")
    torch.manual_seed(args.seed)
    work = QUICK if args.quick else FULL
    work = dataclasses.replace(work, requests=args.requests or (8 if args.quick else 32))
    tokenizer = Tokenizer("gpt2")
    print(f"threads: {torch.get_num_threads()}; pool: {args.kv_cache_memory}; float32")
    header = f"{'model':<20} {'KV B/token':>11} {'heads size':>11} {'ratio':>6}"
    print(f"{header} {'pool tokens':>12} {'tok/s':>9}")
    for name, model in models(args.quick).items():
        config = model.config
        requests = make_requests(work, min(config.vocab_size, tokenizer.n_vocab), args.seed)
        requests = [
            (p[: config.block_size // 2], min(n, config.block_size // 2)) for p, n in requests
        ]
        settings = dict(kv_block_size=16, kv_cache_memory=args.kv_cache_memory)
        result, seconds = timed(run_engine, model, tokenizer, requests, **settings)
        for (prompt, n), tokens in list(zip(requests, result.outputs, strict=True))[:ORACLE_CHECKS]:
            params = SamplingParams(max_tokens=n, ignore_eos=True)
            if generate(model, prompt, params, use_cache=False).token_ids != tokens:
                raise RoseError(f"{name}: the engine's tokens differ from the uncached oracle's")
        per_token = result.held_bytes / result.live_tokens
        heads_size = kv_bytes_per_token(config, "auto")
        pool_tokens = EngineConfig(**settings).pool_blocks(config, 4) * settings["kv_block_size"]
        made = sum(len(tokens) for tokens in result.outputs)
        print(
            f"{name:<20} {per_token:>11,.0f} {heads_size:>11,.0f} {per_token / heads_size:>6.2f} "
            f"{pool_tokens:>12,} {made / seconds:>9,.1f}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: run(build_parser().parse_args(argv)), "benchmarks.grouped")


if __name__ == "__main__":
    sys.exit(main())
