"""Training speed and memory: python -m benchmarks.train

Each configuration runs in a fresh process, so one configuration's memory can never be
hidden in (or blamed on) another's. A process builds the model and AdamW as the trainer
does (`rosetrainer.step.build_model`, compiled with --compile), creates the gradients
and AdamW's two moment buffers, notes the memory at that point, then times training
steps through the trainer's own `train_step` on batches drawn by its own `rank_batch`
(random token ids: the speed of a step does not depend on which tokens it reads), with
one host sync per step for the loss, as the trainer logs it.

Two memory figures come back:

* "step": the peak during the steps minus the memory once weights, gradients and
  AdamW's state existed: what a step adds on top (activations, logits, temporaries).
  Checkpointing acts here.
* "total": the whole peak during the steps. On CPU that is the process's peak resident
  set (ru_maxrss, the Python and PyTorch runtime included); on CUDA it is
  torch.cuda.max_memory_allocated.

MFU (model FLOPs utilisation) counts a token's training FLOPs as nanoGPT's
`estimate_mfu` does, 6 N + 12 L H Q T (N the parameters less the position table), and
divides the rate by the card's dense bfloat16 peak; recomputation under checkpointing
is not counted as useful work. `--nanogpt DIR` runs nanoGPT's own train.py from DIR on
the same card, the same shapes and random token ids, and prints it beside rose.
`--fit-memory GIB` finds the largest batch that fits a memory budget with checkpointing
off and on (the trade a learner makes checkpointing for). `--loss chunked,plain` measures
the model's loss (`rosetrainer.model.linear_cross_entropy`: the logits a slice of rows at a
time, never whole) beside the plain one it replaced (every logit, then F.cross_entropy
over their float32 copy), swapped in for that one process.

glibc is left to hand large freed blocks back to the kernel, so that the resident set
follows the live tensors. The trainer keeps them instead (`runtime.keep_freed_memory`),
which on CPU makes its steps faster than here.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from rosetrainer import model as model_module
from rosetrainer.config import PRESETS, TRAINING_VOCAB_MULTIPLE, GPTConfig, TrainConfig
from rosetrainer.errors import ArgumentParser, RoseError, run_cli
from rosetrainer.model import GPT
from rosetrainer.runtime import Runtime, setup_device
from rosetrainer.step import build_model, rank_batch, train_step

PROG = "benchmarks.train"
REPO_ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
GIB = 2**30
# A batch per preset that keeps a CPU run to minutes; --batch-size sets one for all.
DEFAULT_BATCH = {"tiny": 16, "gpt2": 2}
# Dense bfloat16 peaks (FLOP/s, no sparsity) of the cards MFU is reported against;
# --peak-tflops gives any other.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
# The random token stream batches are drawn from (uint16, as the trainer's .bin files).
STREAM_TOKENS = 2**21


def peak_memory_bytes(device: torch.device) -> int:
    """The peak since the last reset: resident set on CPU, allocated tensors on CUDA."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource  # POSIX only; imported here so CUDA runs elsewhere do not need it

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS says bytes, Linux KiB


def reset_peak_memory(device: torch.device) -> None:
    """Forget earlier peaks (imports, initialisation): the peak restarts from what is used now."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    # Linux: writing "5" here resets the process's peak resident set (ru_maxrss too) to
    # the current one. Elsewhere the earlier peak stays, and "step" can only read low.
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def allocate_training_state(model: GPT, optimizer: torch.optim.Optimizer) -> None:
    """Create the gradients and AdamW's moments now, before any step, so that the memory
    a step adds on top of them can be told apart."""
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    learning_rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0  # with lr 0 this step only allocates the moment buffers
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, learning_rates, strict=True):
        group["lr"] = lr


def flops_per_token(config: GPTConfig, non_embedding_params: int) -> float:
    """Training FLOPs per token as nanoGPT's estimate_mfu counts them: 6 per parameter
    (forward 2, backward 4) plus attention's scores and weighted sum over T keys."""
    L, H, T = config.n_layer, config.n_head, config.block_size
    Q = config.n_embd // H
    return 6 * non_embedding_params + 12 * L * H * Q * T


def peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    """The card's dense bfloat16 peak, from --peak-tflops or its name; None when unknown."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for card, flops in PEAK_BF16_FLOPS.items() if card in name), None)


def random_token_stream(vocab_size: int, seed: int = 0) -> np.ndarray:
    """Random token ids (uint16, like the trainer's .bin files) for batches to be drawn from."""
    return np.random.default_rng(seed).integers(0, vocab_size, STREAM_TOKENS, dtype=np.uint16)


def training_setup(spec: dict[str, Any]) -> tuple[Runtime, GPTConfig, TrainConfig]:
    rt = setup_device(spec["device"], spec["dtype"])
    # rose-train's model: the vocabulary padded (GPTConfig.vocab_multiple), unless told
    overrides = {"block_size": spec["block_size"], "vocab_multiple": spec["vocab_multiple"]}
    if spec.get("vocab_size"):
        overrides["vocab_size"] = spec["vocab_size"]
    config = GPTConfig.from_preset(spec["preset"], **overrides)
    cfg = TrainConfig(
        batch_size=spec["batch_size"],
        compile=spec["compile"],
        activation_checkpointing=spec["checkpointing"],
        device=spec["device"],
        dtype=spec["dtype"],
    )
    return rt, config, cfg


def plain_cross_entropy(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """The loss as a textbook writes it, in place of linear_cross_entropy: every logit at
    once, their float32 copy, and F.cross_entropy (the padded rows' logits cut off)."""
    logits = F.linear(x, weight)[:, :vocab_size]
    return F.cross_entropy(logits.float(), targets, ignore_index=model_module.IGNORE_INDEX)


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Time spec["steps"] training steps of one configuration; run in a fresh process."""
    if spec.get("loss") == "plain":  # (this process only: each configuration has its own)
        model_module.linear_cross_entropy = plain_cross_entropy
    rt, config, cfg = training_setup(spec)
    if spec.get("memory_fraction"):
        torch.cuda.set_per_process_memory_fraction(spec["memory_fraction"], rt.device)
    torch.manual_seed(0)
    raw_model, model = build_model(config, cfg, rt, None)
    optimizer = raw_model.configure_optimizer(
        cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), rt.device.type
    )
    scaler = torch.amp.GradScaler(rt.device.type, enabled=cfg.dtype == "float16")
    allocate_training_state(raw_model, optimizer)
    reset_peak_memory(rt.device)
    state_bytes = peak_memory_bytes(rt.device)

    tokens, generator = random_token_stream(config.vocab_size), torch.Generator().manual_seed(0)
    batches = (rank_batch(tokens, cfg.batch_size, config.block_size, generator, rt)
               for _ in itertools.count())  # fmt: skip

    def step() -> float:
        loss, _ = train_step(model, optimizer, scaler, batches, cfg, rt)
        return loss.item()  # the trainer reads each step's loss: one host sync a step

    for _ in range(spec["warmup_steps"]):
        step()
    rt.synchronize()
    started = time.perf_counter()
    for _ in range(spec["steps"]):
        step()
    rt.synchronize()
    seconds = time.perf_counter() - started
    peak_bytes = peak_memory_bytes(rt.device)

    profile = None
    if spec.get("profile") and rt.device.type == "cuda":
        profile = profiled_steps(step, spec["profile"])

    tokens_per_step = cfg.batch_size * config.block_size
    tokens_per_s = spec["steps"] * tokens_per_step / seconds
    peak = peak_flops(rt.device, spec.get("peak_tflops"))
    model_flops = flops_per_token(config, raw_model.num_params(non_embedding=True))
    return {
        **spec,
        "peer": "rose",
        "device": str(rt.device),
        "device_name": device_name(rt.device),
        "vocab_rows": config.padded_vocab_size,
        "tokens_per_s": tokens_per_s,
        "ms_per_step": 1000 * seconds / spec["steps"],
        "mfu": tokens_per_s * model_flops / peak if peak else None,
        "step_peak_mib": (peak_bytes - state_bytes) / MIB,
        "total_peak_mib": peak_bytes / MIB,
        "logits_mib": tokens_per_step * config.padded_vocab_size * 4 / MIB,
        "profile": profile,
    }


def profiled_steps(step, path: str, steps: int = 3) -> str:
    """A few steps under torch.profiler: the table of the kernels that took the GPU's time,
    written to `path` (and its first lines returned)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25)
    Path(path).write_text(table)
    return "\n".join(table.splitlines()[:12])


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def fit_memory(spec: dict[str, Any]) -> dict[str, Any]:
    """The largest batch (doubling from 1) whose training steps fit a memory budget of
    spec["budget_gib"], and its tokens/s; one process, the budget set on CUDA's allocator."""
    rt, config, cfg = training_setup({**spec, "batch_size": 1})
    budget = spec["budget_gib"] * GIB
    total = torch.cuda.get_device_properties(rt.device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), rt.device)
    torch.manual_seed(0)
    raw_model, model = build_model(config, cfg, rt, None)
    optimizer = raw_model.configure_optimizer(
        cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), rt.device.type
    )
    scaler = torch.amp.GradScaler(rt.device.type, enabled=False)
    tokens, generator = random_token_stream(config.vocab_size), torch.Generator().manual_seed(0)
    fits: list[dict[str, Any]] = []
    for batch_size in (2**i for i in range(9)):  # up to 256: a few seconds a step eager
        trial = TrainConfig(**{**cfg.to_dict(), "batch_size": batch_size})
        batches = (rank_batch(tokens, batch_size, config.block_size, generator, rt)
                   for _ in itertools.count())  # fmt: skip
        try:
            torch.cuda.reset_peak_memory_stats(rt.device)
            train_step(model, optimizer, scaler, batches, trial, rt)  # warm-up
            rt.synchronize()
            started = time.perf_counter()
            for _ in range(spec["steps"]):
                train_step(model, optimizer, scaler, batches, trial, rt)[0].item()
            seconds = time.perf_counter() - started
        except torch.OutOfMemoryError:
            break
        finally:
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        fits.append(
            {
                "batch_size": batch_size,
                "tokens_per_s": spec["steps"] * batch_size * config.block_size / seconds,
                "total_peak_mib": torch.cuda.max_memory_allocated(rt.device) / MIB,
            }
        )
    return {**spec, "device_name": device_name(rt.device), "fits": fits}


def run_in_fresh_process(spec: dict[str, Any], what: str = "measure") -> dict[str, Any]:
    payload = json.dumps({**spec, "what": what})
    command = [sys.executable, "-m", "benchmarks.train", "--worker", payload]
    # From the repository's root, where `benchmarks` is found (no wheel installs it).
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    if done.returncode != 0:
        last_line = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RoseError(f"the {spec['preset']} run failed: {last_line}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------
# nanoGPT's train.py as the peer
# ---------------------------------------------------------------------------

NANOGPT_ITER = re.compile(r"^iter (\d+): loss [\d.naif]+, time ([\d.]+)ms")


def run_nanogpt(nanogpt_dir: Path, spec: dict[str, Any], matched: bool) -> dict[str, Any]:
    """nanoGPT's train.py, unchanged, on a copy of its folder with random token ids as its
    data set, at spec's batch and context, bfloat16, compiled (its defaults) and one
    micro-step a step; tokens/s from its own per-iteration times after the warm-up.

    matched: the model rose trains (GPT-2's 50,257-token vocabulary through its meta.pkl,
    biases on); otherwise nanoGPT as it ships (vocabulary padded to 50,304, no biases)."""
    config = GPTConfig.from_preset(spec["preset"], block_size=spec["block_size"])
    last_iter = spec["warmup_steps"] + spec["steps"] - 1  # its iterations are 0..max_iters
    device = setup_device(spec["device"], spec["dtype"]).device
    with tempfile.TemporaryDirectory(prefix="nanogpt-") as work:
        folder = Path(work)
        for name in ("train.py", "model.py", "configurator.py"):
            shutil.copy(nanogpt_dir / name, folder / name)
        data = folder / "data" / "rose_bench"
        data.mkdir(parents=True)
        stream = random_token_stream(config.vocab_size)
        stream.tofile(data / "train.bin")
        stream[: 2**16].tofile(data / "val.bin")
        if matched:
            (data / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": config.vocab_size}))
        overrides = {
            "dataset": "rose_bench", "out_dir": str(folder / "out"), "batch_size":
            spec["batch_size"], "block_size": spec["block_size"], "gradient_accumulation_steps": 1,
            "n_layer": config.n_layer, "n_head": config.n_head, "n_embd": config.n_embd,
            "bias": matched, "dropout": 0.0, "max_iters": last_iter, "lr_decay_iters": last_iter + 1,
            "eval_interval": 10**9, "eval_iters": 1, "log_interval": 1, "wandb_log": False,
            "always_save_checkpoint": False, "compile": spec["compile"], "dtype": spec["dtype"],
            "device": str(device),
        }  # fmt: skip
        args = [f"--{key}={value}" for key, value in overrides.items()]
        done = subprocess.run(
            [sys.executable, "train.py", *args], cwd=folder, capture_output=True, text=True
        )
    if done.returncode != 0:
        last_line = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RoseError(f"nanoGPT's train.py failed: {last_line}")
    times = {
        int(m.group(1)): float(m.group(2)) / 1000
        for m in map(NANOGPT_ITER.match, done.stdout.splitlines())
        if m
    }
    timed = [times[i] for i in sorted(times) if i >= spec["warmup_steps"]]
    if not timed:
        raise RoseError("nanoGPT's train.py printed no timed iterations")
    seconds = statistics.fmean(timed)
    tokens_per_s = spec["batch_size"] * spec["block_size"] / seconds
    peak = peak_flops(device, spec.get("peak_tflops"))
    vocab = config.vocab_size if matched else 50304
    n_params = nanogpt_params(config, vocab, matched)
    return {
        **spec,
        "peer": "nanoGPT" + (" (rose's model)" if matched else " (as shipped)"),
        "vocab_rows": vocab,
        "device_name": device_name(device),
        "tokens_per_s": tokens_per_s,
        "ms_per_step": 1000 * seconds,
        "mfu": tokens_per_s * flops_per_token(config, n_params) / peak if peak else None,
        "step_peak_mib": math.nan,
        "total_peak_mib": math.nan,
    }


def nanogpt_params(config: GPTConfig, vocab_size: int, bias: bool) -> int:
    """nanoGPT's non-embedding parameter count for its model of this shape (rose's own
    model, built on the meta device, counts the same parameters)."""
    shape = GPTConfig(**{**config.to_dict(), "vocab_size": vocab_size, "bias": bias})
    with torch.device("meta"):
        return GPT(shape).num_params(non_embedding=True)


# ---------------------------------------------------------------------------
# The tables
# ---------------------------------------------------------------------------


def print_table(results: list[dict[str, Any]]) -> None:
    first = results[0]
    memory = "peak RSS (ru_maxrss)" if first["device"] == "cpu" else "max_memory_allocated"
    print(
        f"training step = forward + backward + AdamW on {first['device_name']}, "
        f"{first['dtype']}, compile {'on' if first['compile'] else 'off'}"
    )
    print(f"memory: {memory}; 'step' = peak minus memory once weights, grads, AdamW state exist")
    print("vocab: rows of the embedding and output matrix (the vocabulary and its padding)")
    header = (
        f"{'trainer':<24} {'preset':<8} {'vocab':>6} {'ckpt':<5} {'loss':<7} {'batch x ctx':>12} "
        f"{'tokens/s':>10} {'ms/step':>9} {'MFU':>6} {'step MiB':>10} {'total MiB':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        shape = f"{r['batch_size']} x {r['block_size']}"
        on = "on" if r["checkpointing"] else "off"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        print(
            f"{r['peer']:<24} {r['preset']:<8} {r['vocab_rows']:>6} {on:<5} "
            f"{r.get('loss', 'chunked'):<7} {shape:>12} "
            f"{r['tokens_per_s']:>10,.0f} {r['ms_per_step']:>9,.1f} {mfu:>6} "
            f"{r['step_peak_mib']:>10,.0f} {r['total_peak_mib']:>10,.0f}"
        )
    print()
    rose = [r for r in results if r["peer"] == "rose" and r.get("loss", "chunked") == "chunked"]
    for off in rose:
        on = next((r for r in rose if r["checkpointing"] and same_shape(r, off)), None)
        if off["checkpointing"] or on is None:
            continue
        print(
            f"{off['preset']} {off['batch_size']} x {off['block_size']}: checkpointing saves "
            f"{saved_percent(off, on, 'step_peak_mib'):.0f}% of step memory "
            f"({saved_percent(off, on, 'total_peak_mib'):.0f}% of the total peak) and costs "
            f"{saved_percent(off, on, 'tokens_per_s'):.0f}% of throughput"
        )
    for plain in (r for r in results if r.get("loss") == "plain"):
        mine = next(
            (
                r
                for r in rose
                if r["checkpointing"] == plain["checkpointing"] and same_shape(r, plain)
            ),
            None,
        )
        if mine is not None:
            print(
                f"{plain['preset']} {plain['batch_size']} x {plain['block_size']}: the sliced loss "
                f"{mine['tokens_per_s'] / plain['tokens_per_s']:.2f}x the plain one's tokens/s, "
                f"step memory {mine['step_peak_mib']:,.0f} against {plain['step_peak_mib']:,.0f} "
                f"MiB (the whole float32 logits are {plain['logits_mib']:,.0f} MiB a copy)"
            )
    for peer in (r for r in results if r["peer"] != "rose"):
        mine = next((r for r in rose if not r["checkpointing"] and same_shape(r, peer)), None)
        if mine is not None:
            print(
                f"rose / {peer['peer']} at {peer['batch_size']} x {peer['block_size']}: "
                f"{mine['tokens_per_s'] / peer['tokens_per_s']:.2f}x tokens/s"
            )


def same_shape(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["preset"], a["batch_size"], a["block_size"]) == (
        b["preset"],
        b["batch_size"],
        b["block_size"],
    )


def print_fits(fits: list[dict[str, Any]]) -> None:
    for result in fits:
        on = "on" if result["checkpointing"] else "off"
        largest = result["fits"][-1] if result["fits"] else None
        where = (
            f"batch {largest['batch_size']} x {result['block_size']}, "
            f"{largest['tokens_per_s']:,.0f} tokens/s, peak {largest['total_peak_mib']:,.0f} MiB"
            if largest
            else "not even batch 1"
        )
        print(
            f"within {result['budget_gib']} GiB, checkpointing {on}, {result['preset']} "
            f"(eager): the largest batch is {where}"
        )


def saved_percent(off: dict[str, Any], on: dict[str, Any], key: str) -> float:
    """How much lower `key` is with checkpointing on, in percent of the value with it off."""
    return 100.0 * (off[key] - on[key]) / off[key] if off[key] else math.nan


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m benchmarks.train",
        description="Tokens/s, MFU and peak memory of training steps, activation "
        "checkpointing off/on, optionally beside nanoGPT's train.py.",
    )
    parser.add_argument(
        "--presets", default="tiny,gpt2", help="comma-separated (default tiny,gpt2)"
    )
    parser.add_argument(
        "--batch-size", type=int, help="sequences per step (default: tiny 16, gpt2 2)"
    )
    parser.add_argument("--block-size", type=int, help="context length (default: the preset's)")
    parser.add_argument(
        "--vocab-size", type=int, help="the model's vocabulary (e.g. 50304, padded as nanoGPT does)"
    )
    parser.add_argument(
        "--vocab-multiple",
        type=int,
        default=TRAINING_VOCAB_MULTIPLE,
        help=f"pad the vocabulary's rows to a multiple of N (default {TRAINING_VOCAB_MULTIPLE}, "
        "as rose-train does; 1: unpadded)",
    )
    parser.add_argument(
        "--checkpointing", default="off,on", help="activation checkpointing: off, on or off,on"
    )
    parser.add_argument(
        "--loss",
        default="chunked",
        help="chunked (the model's: a slice of rows at a time), plain (every logit, then "
        "F.cross_entropy) or chunked,plain (default chunked)",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    parser.add_argument(
        "--warmup-steps", type=int, default=1, help="untimed steps first (default 1)"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (CUDA)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument(
        "--nanogpt", type=Path, help="a copy of nanoGPT's repository: run its train.py beside"
    )
    parser.add_argument(
        "--fit-memory",
        type=float,
        metavar="GIB",
        help="CUDA, instead of the timings: the largest batch (eager) whose steps fit GIB",
    )
    parser.add_argument("--peak-tflops", type=float, help="the card's dense bf16 peak, for MFU")
    parser.add_argument("--profile", help="CUDA: write a torch.profiler table of rose's steps here")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny only, 2 small steps")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one measurement, in a child process
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def specs_from_args(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One spec per (preset, checkpointing setting), checked before any process starts."""
    if args.quick:
        args.presets, args.steps, args.warmup_steps = "tiny", 2, 0
        args.batch_size = args.batch_size or 2
    presets = [name.strip() for name in args.presets.split(",") if name.strip()]
    for name in presets:
        if name not in PRESETS:
            raise RoseError(f"unknown preset {name!r}; choose from: {', '.join(PRESETS)}")
    for flag in ("batch_size", "block_size", "steps", "vocab_size", "vocab_multiple"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise RoseError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.warmup_steps < 0:
        raise RoseError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    settings = [word.strip() for word in args.checkpointing.split(",")]
    if not settings or any(word not in ("off", "on") for word in settings):
        raise RoseError(f"--checkpointing takes off, on or off,on, got {args.checkpointing!r}")
    losses = [word.strip() for word in args.loss.split(",")]
    if not losses or any(word not in ("chunked", "plain") for word in losses):
        raise RoseError(f"--loss takes chunked, plain or chunked,plain, got {args.loss!r}")
    if args.nanogpt is not None and not (args.nanogpt / "train.py").is_file():
        raise RoseError(f"--nanogpt {args.nanogpt}: no train.py there (a copy of nanoGPT's repo)")
    rt = setup_device(args.device, args.dtype)  # fail here, not in a child
    if (args.fit_memory or args.profile) and rt.device.type != "cuda":
        raise RoseError("--fit-memory and --profile measure CUDA memory and kernels: --device cuda")
    specs = []
    for name in presets:
        block_size = args.block_size or PRESETS[name]["block_size"]
        GPTConfig.from_preset(name, block_size=block_size)
        for word, loss in itertools.product(settings, losses):
            specs.append(
                {
                    "preset": name,
                    "checkpointing": word == "on",
                    "loss": loss,
                    "batch_size": args.batch_size or DEFAULT_BATCH.get(name, 1),
                    "block_size": block_size,
                    "vocab_size": args.vocab_size,
                    "vocab_multiple": args.vocab_multiple,
                    "steps": args.steps,
                    "warmup_steps": args.warmup_steps,
                    "device": args.device,
                    "dtype": args.dtype,
                    "compile": args.compile,
                    "peak_tflops": args.peak_tflops,
                }
            )
    return specs


def bench(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        result = fit_memory(spec) if spec.pop("what") == "fit" else measure(spec)
        print(json.dumps(result))
        return 0
    specs = specs_from_args(args)
    if args.fit_memory:
        fits = []
        for spec in specs:
            on = "on" if spec["checkpointing"] else "off"
            print(f"fitting {args.fit_memory} GiB, checkpointing {on} ...", file=sys.stderr)
            fit = {**spec, "budget_gib": args.fit_memory, "compile": False}
            fits.append(run_in_fresh_process(fit, "fit"))
        if args.json:
            print(json.dumps(fits, indent=2))
        else:
            print_fits(fits)
        return 0
    results = []
    for index, spec in enumerate(specs):
        on = "on" if spec["checkpointing"] else "off"
        print(
            f"measuring {spec['preset']}, checkpointing {on}, {spec['loss']} loss ...",
            file=sys.stderr,
            flush=True,
        )
        # the profile: of the first configuration only, checkpointing off
        profile = args.profile if index == 0 and not spec["checkpointing"] else None
        results.append(run_in_fresh_process({**spec, "profile": profile}))
    if args.nanogpt is not None:
        for spec in specs:
            if spec["checkpointing"] or spec["loss"] == "plain":  # (nanoGPT's runs once a shape)
                continue
            for matched in (True, False):
                print("measuring nanoGPT's train.py ...", file=sys.stderr, flush=True)
                results.append(run_nanogpt(args.nanogpt, spec, matched))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_table(results)
        profiled = next((r["profile"] for r in results if r.get("profile")), None)
        if profiled:
            print(f"\nthe kernels of rose's steps (whole table in {args.profile}):\n{profiled}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: bench(argv), PROG)


if __name__ == "__main__":
    sys.exit(main())
