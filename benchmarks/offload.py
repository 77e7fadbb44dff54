"""python -m benchmarks.offload: the offloaded KV cache beside the concatenating and static ones.

GPT-2 small's shape with random weights (the tests' wide init, so greedy tokens are
varied and win by clear margins), one random prompt, then greedy decoding until the
context is full (1024 tokens), on each cache in turn:

* tokens equal: first a short run on each cache against the uncached oracle's tokens
  (these runs also warm the kernels up), then each long run against the concatenating
  cache's long run;
* the cache's own bytes on the compute device, and in host memory;
* peak device memory of the long run: torch.cuda.max_memory_allocated during the run
  minus what was allocated before it (the weights), so the cache's device buffers plus
  a step's activations, and for concatenation the copy each step builds beside the old
  past; pinned host memory is not device memory and is not in it (CUDA only);
* host -> device copies per step (the offloaded cache brings every layer's past in
  again at each step: PCIe traffic on a GPU), and decode tokens/s.

One side-by-side table, ratios against the static cache; --json PATH writes the same.

    python -m benchmarks.offload --device cuda
    python -m benchmarks.offload --device cpu --tiny   # a smoke test: tiny model, 128 tokens
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rosecourse.demo import wide_random_init
from roseinfer.cache.dense import ConcatKVCache, DenseKVCache, StaticKVCache
from roseinfer.cache.offloaded import OffloadedKVCache
from roseinfer.loops.generate import generate
from roseinfer.request.sampling import SamplingParams
from rosetrainer.config import GPTConfig
from rosetrainer.errors import ArgumentParser, RoseError, run_cli
from rosetrainer.model import GPT
from rosetrainer.runtime import DTYPES, pick_device, pick_dtype

PROG = "benchmarks.offload"
KINDS = ("concat", "static", "offloaded")
BASELINE = "static"  # the ratios' denominator: rose's default cache for one prompt
MiB = 2**20


@dataclass
class CacheResult:
    kind: str
    tokens_equal_oracle: bool  # the short run's tokens are the uncached run's
    tokens_equal_concat: bool  # the long run's tokens are the concatenating cache's
    device_cache_bytes: int  # the cache's own buffers on the compute device, at the end
    host_cache_bytes: int  # ... and in host memory
    peak_device_bytes: int | None  # above the weights, during the long run (CUDA only)
    to_device_bytes_per_step: float  # host -> device copies per model call
    tokens_per_s: float  # decode, after the first token
    new_tokens: int


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=f"python -m {PROG}", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--tiny", action="store_true", help="the tiny preset, 128 tokens: a smoke test")
    p.add_argument("--prompt-len", type=int, help="default: 128 (--tiny: 16)")
    p.add_argument("--check-tokens", type=int, help="new tokens of the oracle check (default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the results to this JSON file")
    return p


def make_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> GPT:
    torch.manual_seed(args.seed)
    config = GPTConfig.from_preset("tiny" if args.tiny else "gpt2")
    return wide_random_init(GPT(config), args.seed).to(device=device, dtype=dtype)


def new_cache(kind: str, model: GPT, max_len: int) -> DenseKVCache:
    if kind == "concat":
        return ConcatKVCache()
    if kind == "static":
        return StaticKVCache(model, max_len=max_len)
    return OffloadedKVCache(model, max_len=max_len)


def footprint(kind: str, cache: DenseKVCache) -> tuple[int, int, int]:
    """(bytes on the compute device, bytes in host memory, bytes copied host -> device) of
    a cache after its run: the offloaded cache's nbytes are its host buffers, its device
    holds two layers' slots; the others live on the device and copy nothing in."""
    if kind == "offloaded":
        return cache.device_nbytes, cache.nbytes, cache.copied_to_device
    return cache.nbytes, 0, 0


class PeakMemory:
    """Peak CUDA memory allocated inside a `with` block, above what was allocated before."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.peak: int | None = None

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *_: object) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.before


def run(args: argparse.Namespace) -> list[CacheResult]:
    device = pick_device(args.device)
    model = make_model(args, device, pick_dtype(args.dtype, device))
    context = model.config.block_size
    prompt_len = args.prompt_len or (16 if args.tiny else 128)
    check_tokens = args.check_tokens or (8 if args.tiny else 32)
    if not 0 < prompt_len < context or not 0 < check_tokens <= context - prompt_len:
        raise RoseError(
            f"need 0 < --prompt-len < {context} (the context) and 0 < --check-tokens <= "
            f"the context minus the prompt; got {prompt_len} and {check_tokens}"
        )
    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(model.config.vocab_size, (prompt_len,), generator=generator).tolist()
    long_tokens = context - prompt_len  # the last is never fed back: context positions fit

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, ignore_eos=True)

    status(f"{model.config.n_layer} layers, {context}-token context, {args.dtype} on {device}")
    oracle = generate(model, prompt, greedy(check_tokens), use_cache=False).token_ids
    short = {
        kind: generate(
            model, prompt, greedy(check_tokens), cache=new_cache(kind, model, context)
        ).token_ids
        for kind in KINDS
    }
    results, long = [], {}
    for kind in KINDS:
        with PeakMemory(device) as memory:
            cache = new_cache(kind, model, context)
            result = generate(model, prompt, greedy(long_tokens), cache=cache)
        long[kind] = result.token_ids
        on_device, on_host, copied = footprint(kind, cache)
        del cache  # freed before the next kind's run: its peak is then its own
        results.append(
            CacheResult(
                kind=kind,
                tokens_equal_oracle=short[kind] == oracle,
                tokens_equal_concat=long[kind] == long["concat"],
                device_cache_bytes=on_device,
                host_cache_bytes=on_host,
                peak_device_bytes=memory.peak,
                to_device_bytes_per_step=copied / len(result.token_ids),
                tokens_per_s=result.tokens_per_s,
                new_tokens=len(result.token_ids),
            )
        )
        status(f"{kind}: {len(result.token_ids)} tokens at {result.tokens_per_s:.1f} tok/s")
    return results


def print_table(results: list[CacheResult], args: argparse.Namespace) -> None:
    base = next(r for r in results if r.kind == BASELINE)

    def mib(n: float | None) -> str:
        return "n/a" if n is None else f"{n / MiB:.1f}"

    def ratio(n: float | None, d: float | None) -> str:
        return "n/a" if n is None or not d else f"{n / d:.2f}x"

    print(
        f"{'cache':<10} {'=oracle':>7} {'=concat':>7} {'device MiB':>10} {'host MiB':>9} "
        f"{'peak MiB':>9} {'H2D MiB/step':>12} {'tok/s':>8} {'peak/' + BASELINE:>11} "
        f"{'tok/s/' + BASELINE:>12}"
    )
    for r in results:
        print(
            f"{r.kind:<10} {yes_no(r.tokens_equal_oracle):>7} {yes_no(r.tokens_equal_concat):>7} "
            f"{mib(r.device_cache_bytes):>10} {mib(r.host_cache_bytes):>9} "
            f"{mib(r.peak_device_bytes):>9} {mib(r.to_device_bytes_per_step):>12} "
            f"{r.tokens_per_s:>8.1f} {ratio(r.peak_device_bytes, base.peak_device_bytes):>11} "
            f"{ratio(r.tokens_per_s, base.tokens_per_s):>12}"
        )
    every = all(r.tokens_equal_oracle and r.tokens_equal_concat for r in results)
    print(f"tokens equal: {yes_no(every)}")
    print(
        "device/host MiB: the cache's own buffers; peak: max_memory_allocated during the long "
        "run above the weights (the cache's device buffers, a step's activations, concat's "
        "copy of the past; n/a off CUDA); H2D: bytes copied host -> device per model call"
    )
    if not every and args.dtype != "float32":
        print(f"({args.dtype}: kernels that sum in another order can flip a near-tie)")


def yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def status(message: str) -> None:
    print(f"[{PROG}] {message}", file=sys.stderr, flush=True)


def bench(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with torch.inference_mode():
        results = run(args)
    print_table(results, args)
    if args.json:
        payload = {"args": vars(args), "results": [asdict(r) for r in results]}
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
        status(f"results written to {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: bench(argv), PROG)


if __name__ == "__main__":
    sys.exit(main())
