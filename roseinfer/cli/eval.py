"""python -m roseinfer.cli.eval: what a KV cache's precision costs, measured.

    python -m roseinfer.cli.eval --checkpoint-path checkpoints/tiny \\
        --text-file ../shared/data/tinyshakespeare.txt --kv-cache-dtype auto int8 int4

For each cache dtype, side by side in one run:

* **perplexity** of the text's validation split (its last 10%, split as the trainer
  splits it), computed through the cached decode path: windows of the text are fed
  one token per model call on top of the cache, as generation feeds them, so every
  prediction reads keys and values from the cache and its precision is what is
  measured. A full forward pass without any cache scores the same windows first: the
  unquantized cache must equal it (up to float rounding).
* **greedy agreement** with the full-precision run: for several prompts cut from the
  text, N greedy tokens with the unquantized cache are the reference. With the cache
  under test, the first step where free-running greedy decoding departs from them, and
  the share of steps whose top-1 token is the reference's when the reference tokens are
  fed in (teacher forcing, so one early difference does not decide every later step).
* **memory**: KV bytes per token, scales and zero points included, and how many
  requests of --request-len tokens fit in --kv-memory of cache.

A quantized cache here is `roseinfer.cache.quantized.QuantizedKVCache`; "auto" is the
unquantized `StaticKVCache`.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from roseinfer.cache.quantized import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_WINDOW,
    KEY_GROUPINGS,
    KV_CACHE_DTYPES,
    check_quant_settings,
    kv_bytes_per_token,
    make_kv_cache,
)
from roseinfer.loading import load_model_and_tokenizer
from roseinfer.loops.generate import generate_batch, model_step, prefill
from roseinfer.request.sampling import SamplingParams
from rosetrainer.config import GPTConfig, TrainConfig
from rosetrainer.errors import ArgumentParser, RoseError, not_a_file, run_cli
from rosetrainer.model import GPT
from rosetrainer.runtime import pick_device
from rosetrainer.tokenizer import Tokenizer

PROG = "roseinfer.cli.eval"
GiB = 2**30


@dataclass(frozen=True)
class CacheChoice:
    """One cache under test: its dtype and how it quantizes."""

    kv_cache_dtype: str
    window: int = DEFAULT_WINDOW
    group_size: int = DEFAULT_GROUP_SIZE
    keys_per: str = "channel"

    def make(self, model: GPT, batch_size: int, max_len: int):
        return make_kv_cache(
            model,
            batch_size,
            max_len,
            kv_cache_dtype=self.kv_cache_dtype,
            window=self.window,
            group_size=self.group_size,
            keys_per=self.keys_per,
        )

    @property
    def label(self) -> str:
        if self.kv_cache_dtype == "auto":
            return "auto"
        keys = "" if self.keys_per == "channel" else ", keys per token"
        return f"{self.kv_cache_dtype} (window {self.window}, group {self.group_size}{keys})"


@dataclass
class Perplexity:
    nll_sum: float  # natural log, summed over every scored token
    n_tokens: int
    seconds: float

    @property
    def value(self) -> float:
        return math.exp(self.nll_sum / self.n_tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.seconds


@dataclass
class Agreement:
    first_divergence: list[int | None]  # per prompt: the first step unlike the reference
    top1_agreement: float  # mean over prompts and steps, teacher-forced
    tokens_per_s: float  # free-running greedy decode, batch 1


# ---------------------------------------------------------------------------
# The text
# ---------------------------------------------------------------------------


def split_ids(
    text_file: str, tokenizer: Tokenizer, split: str, val_fraction: float | None = None
) -> list[int]:
    """The text's token ids: all of them, or the validation split, the last `val_fraction`
    as the trainer splits it (rosetrainer.data: the first int(n * (1 - f)) are training)."""
    path = Path(text_file)
    why = not_a_file(path)
    if why is not None:
        raise RoseError(f"text file {path} {why}")
    try:
        ids = tokenizer.encode(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise RoseError(f"text file {path} is not UTF-8 text") from None
    if split == "val":
        fraction = TrainConfig().val_fraction if val_fraction is None else val_fraction
        ids = ids[int(len(ids) * (1.0 - fraction)) :]
    if len(ids) < 2:
        raise RoseError(f"{path} ({split}) has {len(ids)} token(s): perplexity needs at least 2")
    return ids


def windows(ids: list[int], context: int) -> list[list[int]]:
    """Consecutive windows of context + 1 tokens, each overlapping the next by one token:
    every token after the first is predicted exactly once, from up to `context` before it.
    The last window is shorter when the text does not divide evenly."""
    return [ids[i : i + context + 1] for i in range(0, len(ids) - 1, context)]


def batches_of_equal_length(
    rows: list[list[int]], batch_size: int, device: torch.device
) -> list[torch.Tensor]:
    """(B, T) id tensors of at most batch_size windows each, one length per batch."""
    by_length: dict[int, list[list[int]]] = {}
    for row in rows:
        by_length.setdefault(len(row), []).append(row)
    return [
        torch.tensor(same[i : i + batch_size], device=device)
        for same in by_length.values()
        for i in range(0, len(same), batch_size)
    ]


# ---------------------------------------------------------------------------
# Perplexity: without a cache, and through a cache one token at a time
# ---------------------------------------------------------------------------


@torch.inference_mode()
def full_forward_perplexity(model: GPT, batches: list[torch.Tensor]) -> Perplexity:
    """The reference: each window in one forward pass, no cache at all."""
    nll, n, started = 0.0, 0, time.perf_counter()
    for ids in batches:
        logits = model(ids[:, :-1]).logits
        nll += float(
            F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
        )
        n += ids[:, 1:].numel()
    return Perplexity(nll, n, time.perf_counter() - started)


@torch.inference_mode()
def cached_perplexity(model: GPT, batches: list[torch.Tensor], choice: CacheChoice) -> Perplexity:
    """Each window fed one token per model call on top of a fresh cache: every prediction
    after the first reads the earlier tokens' keys and values from the cache."""
    nll, n, started = 0.0, 0, time.perf_counter()
    for ids in batches:
        inputs, targets = ids[:, :-1], ids[:, 1:]
        cache = choice.make(model, inputs.size(0), inputs.size(1))
        for t in range(inputs.size(1)):
            logits = model_step(model, inputs[:, t : t + 1], cache)
            nll += float(F.cross_entropy(logits.float(), targets[:, t], reduction="sum"))
        n += targets.numel()
    return Perplexity(nll, n, time.perf_counter() - started)


# ---------------------------------------------------------------------------
# Greedy agreement with the full-precision run
# ---------------------------------------------------------------------------


def agreement_prompts(ids: list[int], n_prompts: int, prompt_len: int) -> list[list[int]]:
    """n_prompts prompts of prompt_len tokens, spread evenly over the text."""
    if len(ids) < prompt_len * n_prompts:
        raise RoseError(
            f"the text has {len(ids)} tokens: too few for {n_prompts} prompts of {prompt_len}"
        )
    stride = (len(ids) - prompt_len) // max(1, n_prompts - 1)
    return [ids[i * stride : i * stride + prompt_len] for i in range(n_prompts)]


def greedy_runs(
    model: GPT, prompts: list[list[int]], steps: int, choice: CacheChoice
) -> tuple[list[list[int]], float]:
    """Each prompt's `steps` greedy tokens alone (batch 1) on `choice`'s cache; tokens/s."""
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    runs, decoded, decode_s = [], 0, 0.0
    for prompt in prompts:
        cache = choice.make(model, 1, len(prompt) + steps)
        (result,) = generate_batch(model, [prompt], params, cache=cache)
        runs.append(result.token_ids)
        decoded += len(result.token_ids) - 1
        decode_s += result.total_time_s - result.time_to_first_token_s
    return runs, decoded / decode_s


@torch.inference_mode()
def teacher_forced_top1(
    model: GPT, prompt: list[int], reference: list[int], choice: CacheChoice
) -> list[bool]:
    """Per step: is the cache's top-1 token the reference's, the reference tokens fed in?"""
    cache = choice.make(model, 1, len(prompt) + len(reference))
    device = model.lm_head.weight.device
    logits = prefill(model, cache, [prompt])
    same = []
    for step, token in enumerate(reference):
        same.append(int(logits.argmax(-1)) == token)
        if step + 1 < len(reference):
            logits = model_step(model, torch.tensor([[token]], device=device), cache)
    return same


def greedy_agreement(
    model: GPT, prompts: list[list[int]], references: list[list[int]], choice: CacheChoice
) -> Agreement:
    runs, tokens_per_s = greedy_runs(model, prompts, len(references[0]), choice)
    first = [
        next((i for i, (a, b) in enumerate(zip(run, ref, strict=True)) if a != b), None)
        for run, ref in zip(runs, references, strict=True)
    ]
    same = [
        hit
        for prompt, ref in zip(prompts, references, strict=True)
        for hit in teacher_forced_top1(model, prompt, ref, choice)
    ]
    return Agreement(first, sum(same) / len(same), tokens_per_s)


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------


def requests_that_fit(
    config: GPTConfig, choice: CacheChoice, itemsize: int, request_len: int, memory: int
) -> int:
    """Requests of request_len tokens whose keys and values fit in `memory` bytes (each
    quantized request also holds the buffer of its exact window: window + group tokens)."""
    per_token = kv_bytes_per_token(config, choice.kv_cache_dtype, choice.group_size, itemsize)
    per_request = request_len * per_token
    if choice.kv_cache_dtype != "auto":
        exact = choice.window + choice.group_size
        per_request += exact * kv_bytes_per_token(config, "auto", itemsize=itemsize)
    return int(memory // per_request)


# ---------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=f"python -m {PROG}", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-path", help="a rose .pt or run directory (default: the newest)")
    p.add_argument("--hf-model", help="a local Hugging Face GPT-2 directory instead")
    p.add_argument("--text-file", help="a UTF-8 text, e.g. tinyshakespeare.txt")
    p.add_argument(
        "--memory-only",
        action="store_true",
        help="print only the memory table, for a --preset shape (no weights, no text)",
    )
    p.add_argument("--preset", default="gpt2", help="the shape --memory-only measures")
    p.add_argument(
        "--split",
        choices=["val", "all"],
        default="val",
        help="val: the last 10%% of the tokens, as the trainer splits them (default); all",
    )
    p.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=list(KV_CACHE_DTYPES),
        help=f"caches to compare, side by side (default: {' '.join(KV_CACHE_DTYPES)}); "
        "auto is the unquantized cache",
    )
    p.add_argument("--kv-cache-window", type=int, default=DEFAULT_WINDOW)
    p.add_argument("--kv-cache-group-size", type=int, default=DEFAULT_GROUP_SIZE)
    p.add_argument("--keys-per", choices=KEY_GROUPINGS, default="channel")
    p.add_argument("--context", type=int, help="tokens of context per window (default: block_size)")
    p.add_argument(
        "--max-tokens", type=int, help="score only the first N tokens of the split (default: all)"
    )
    p.add_argument("--batch-size", type=int, default=32, help="windows decoded together")
    p.add_argument("--prompts", type=int, default=8, help="prompts for greedy agreement")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=64, help="greedy steps per prompt")
    p.add_argument("--request-len", type=int, default=1024, help="for the memory table")
    p.add_argument("--kv-memory-gib", type=float, default=1.0, help="for the memory table")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu")
    return p


def checked_choices(args: argparse.Namespace, config: GPTConfig) -> list[CacheChoice]:
    choices = []
    for name in args.kv_cache_dtype:
        check_quant_settings(
            config, name, args.kv_cache_group_size, args.kv_cache_window, args.keys_per
        )
        choices.append(
            CacheChoice(name, args.kv_cache_window, args.kv_cache_group_size, args.keys_per)
        )
    return choices


def memory_table(args: argparse.Namespace) -> None:
    """Bytes per token by the formula, and as allocated: one request's cache of
    --request-len tokens (built on the meta device: shapes and sizes, no memory)."""
    config = GPTConfig.from_preset(args.preset)
    choices = checked_choices(args, config)
    if args.request_len > config.block_size:
        raise RoseError(f"--request-len exceeds the {args.preset} context ({config.block_size})")
    with torch.device("meta"):
        model = GPT(config)
    memory = int(args.kv_memory_gib * GiB)
    auto_bytes = kv_bytes_per_token(config, "auto")
    header = f"{'KV cache':<34}{'bytes/tok':>10}{'x auto':>8}{'allocated/tok':>15}{'requests':>10}"
    print(
        f"\n{args.preset} ({config.n_layer} layers x {config.n_embd}), float32 weights; "
        f"allocated: one {args.request_len}-token request's cache, window included; "
        f"requests: of {args.request_len} tokens in {args.kv_memory_gib:g} GiB"
        f"\n{header}\n{'-' * len(header)}"
    )
    for choice in choices:
        per_token = kv_bytes_per_token(config, choice.kv_cache_dtype, choice.group_size)
        cache = choice.make(model, 1, args.request_len)
        allocated = cache.nbytes / args.request_len
        fits = requests_that_fit(config, choice, 4, args.request_len, memory)
        print(
            f"{choice.label:<34}{per_token:>10,.0f}{per_token / auto_bytes:>8.3f}"
            f"{allocated:>15,.0f}{fits:>10,}"
        )


def run(args: argparse.Namespace) -> int:
    for flag in ("batch_size", "prompts", "prompt_len", "steps", "request_len"):
        if getattr(args, flag) < 1:
            raise RoseError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.memory_only:
        memory_table(args)
        return 0
    if args.text_file is None:
        raise RoseError("--text-file is required (or --memory-only for the memory table alone)")
    device = pick_device(args.device)
    model, tokenizer, source = load_model_and_tokenizer(
        args.checkpoint_path, args.hf_model, None, device, torch.float32
    )
    config = model.config
    choices = checked_choices(args, config)
    context = config.block_size if args.context is None else args.context
    if not 1 <= context <= config.block_size:
        raise RoseError(
            f"--context must be in [1, block_size = {config.block_size}], got {context}"
        )
    if args.prompt_len + args.steps > config.block_size:
        raise RoseError(
            f"--prompt-len + --steps ({args.prompt_len + args.steps}) exceed the context "
            f"({config.block_size})"
        )
    ids = split_ids(args.text_file, tokenizer, args.split)
    prompts = agreement_prompts(ids, args.prompts, args.prompt_len)
    if args.max_tokens is not None:
        ids = ids[: args.max_tokens + 1]
    batches = batches_of_equal_length(windows(ids, context), args.batch_size, device)
    print(
        f"[{PROG}] {source}: {len(ids) - 1:,} tokens of {args.text_file} ({args.split}) scored "
        f"in windows of {context}, {args.prompts} prompts x {args.steps} greedy steps",
        file=sys.stderr,
        flush=True,
    )

    reference = full_forward_perplexity(model, batches)
    full_precision = CacheChoice("auto")
    references, _ = greedy_runs(model, prompts, args.steps, full_precision)
    itemsize = model.lm_head.weight.element_size()
    memory = int(args.kv_memory_gib * GiB)
    auto_bytes = kv_bytes_per_token(config, "auto", itemsize=itemsize)
    header = (
        f"{'KV cache':<42}{'bytes/tok':>10}{'x auto':>8}{'requests':>10}{'perplexity':>16}"
        f"{'change':>9}{'top-1 agree':>13}{'first diff':>12}{'score tok/s':>13}{'greedy tok/s':>14}"
    )
    print(
        f"\n{source}, {len(ids) - 1:,} tokens ({args.split}); requests: of {args.request_len} "
        f"tokens in {args.kv_memory_gib:g} GiB; agreement: {args.prompts} prompts x {args.steps} "
        f"greedy steps vs auto\n{header}\n{'-' * len(header)}"
    )
    print(f"{'none (one forward pass)':<42}{'':>28}{reference.value:>16,.3f}", flush=True)
    for choice in choices:
        ppl = cached_perplexity(model, batches, choice)
        agree = greedy_agreement(model, prompts, references, choice)
        per_token = kv_bytes_per_token(config, choice.kv_cache_dtype, choice.group_size, itemsize)
        fits = requests_that_fit(config, choice, itemsize, args.request_len, memory)
        diverged = [step for step in agree.first_divergence if step is not None]
        first = f"{min(diverged)} ({len(diverged)}/{len(prompts)})" if diverged else "none"
        print(
            f"{choice.label:<42}{per_token:>10,.0f}{per_token / auto_bytes:>8.3f}{fits:>10,}"
            f"{ppl.value:>16,.3f}{ppl.value / reference.value - 1:>+9.2%}"
            f"{agree.top1_agreement:>13.2%}{first:>12}{ppl.tokens_per_s:>13.1f}"
            f"{agree.tokens_per_s:>14.1f}",
            flush=True,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: run(build_parser().parse_args(argv)), PROG)


if __name__ == "__main__":
    sys.exit(main())
