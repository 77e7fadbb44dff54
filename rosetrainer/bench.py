"""Training speed and memory, with activation checkpointing off and on: python -m rosetrainer.bench

Every configuration runs in a fresh process, so one configuration's memory can
never be hidden in (or blamed on) another's. A process builds the model, then its
gradients and AdamW's two moment buffers (the state a run keeps for good), notes
the memory at that point, and times a few training steps (forward, backward,
AdamW) on random tokens. Two memory figures come back:

* "step": the peak during the steps minus the memory once the state existed, i.e.
  what a step adds on top: activations, logits, temporaries. Checkpointing acts here.
* "total": the whole peak during the steps. On CPU that is the process's peak
  resident set (ru_maxrss, the Python and PyTorch runtime included); on CUDA it is
  torch.cuda.max_memory_allocated.

glibc is left to hand large freed blocks back to the kernel, so that the resident
set follows the live tensors. The trainer keeps them instead
(`runtime.keep_freed_memory`), which on CPU makes its steps faster than here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from rosetrainer.config import PRESETS, GPTConfig
from rosetrainer.errors import ArgumentParser, RoseError, run_cli
from rosetrainer.model import GPT
from rosetrainer.runtime import setup_device

PROG = "rosetrainer.bench"
MIB = 2**20
# A batch per preset that keeps a CPU run to minutes; --batch-size sets one for all.
DEFAULT_BATCH = {"tiny": 16, "gpt2": 2}


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


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Time spec["steps"] training steps of one configuration; run in a fresh process."""
    rt = setup_device(spec["device"], spec["dtype"])
    torch.manual_seed(0)
    config = GPTConfig.from_preset(spec["preset"], block_size=spec["block_size"])
    model = GPT(config).to(rt.device)
    model.activation_checkpointing = spec["checkpointing"]
    optimizer = model.configure_optimizer(0.1, 3e-4, (0.9, 0.95), rt.device.type)
    allocate_training_state(model, optimizer)
    reset_peak_memory(rt.device)
    state_bytes = peak_memory_bytes(rt.device)

    shape = (spec["batch_size"], spec["block_size"])
    x = torch.randint(config.vocab_size, shape, device=rt.device)
    y = torch.randint(config.vocab_size, shape, device=rt.device)
    for i in range(spec["warmup_steps"] + spec["steps"]):
        if i == spec["warmup_steps"]:
            rt.synchronize()
            started = time.perf_counter()
        with rt.autocast():
            loss = model(x, y).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep the gradients allocated, as counted above
    rt.synchronize()
    seconds = time.perf_counter() - started

    peak_bytes = peak_memory_bytes(rt.device)
    return {
        **spec,
        "device": str(rt.device),
        "tokens_per_s": spec["steps"] * x.numel() / seconds,
        "ms_per_step": 1000 * seconds / spec["steps"],
        "step_peak_mib": (peak_bytes - state_bytes) / MIB,
        "total_peak_mib": peak_bytes / MIB,
        "logits_mib": x.numel() * config.vocab_size * 4 / MIB,
    }


def run_in_fresh_process(spec: dict[str, Any]) -> dict[str, Any]:
    command = [sys.executable, "-m", "rosetrainer.bench", "--worker", json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last_line = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RoseError(f"the {spec['preset']} run failed: {last_line}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_table(results: list[dict[str, Any]]) -> None:
    memory = "peak RSS (ru_maxrss)" if results[0]["device"] == "cpu" else "max_memory_allocated"
    print(
        f"training step = forward + backward + AdamW on {results[0]['device']}, {results[0]['dtype']}"
    )
    print(f"memory: {memory}; 'step' = peak minus memory once weights, grads, AdamW state exist")
    header = f"{'preset':<12} {'checkpointing':<14} {'batch x ctx':>12} {'tokens/s':>10} {'ms/step':>9} {'step MiB':>10} {'total MiB':>10}"
    print(header)
    print("-" * len(header))
    for r in results:
        shape = f"{r['batch_size']} x {r['block_size']}"
        on = "on" if r["checkpointing"] else "off"
        print(
            f"{r['preset']:<12} {on:<14} {shape:>12} {r['tokens_per_s']:>10,.0f} "
            f"{r['ms_per_step']:>9,.0f} {r['step_peak_mib']:>10,.0f} {r['total_peak_mib']:>10,.0f}"
        )
    print()
    for off, on in zip(results[::2], results[1::2], strict=True):
        print(
            f"{off['preset']}: checkpointing saves {saved_percent(off, on, 'step_peak_mib'):.0f}% of "
            f"step memory ({saved_percent(off, on, 'total_peak_mib'):.0f}% of the total peak) "
            f"and costs {saved_percent(off, on, 'tokens_per_s'):.0f}% of throughput (the fp32 "
            f"logits alone are {off['logits_mib']:,.0f} MiB per copy; with checkpointing the loss "
            f"builds them a slice at a time)"
        )


def saved_percent(off: dict[str, Any], on: dict[str, Any], key: str) -> float:
    """How much lower `key` is with checkpointing on, in percent of the value with it off."""
    return 100.0 * (off[key] - on[key]) / off[key] if off[key] else math.nan


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m rosetrainer.bench",
        description="Tokens/s and peak memory of training steps, activation checkpointing off/on.",
    )
    parser.add_argument(
        "--presets", default="tiny,gpt2", help="comma-separated (default tiny,gpt2)"
    )
    parser.add_argument(
        "--batch-size", type=int, help="sequences per step (default: tiny 16, gpt2 2)"
    )
    parser.add_argument("--block-size", type=int, help="context length (default: the preset's)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    parser.add_argument(
        "--warmup-steps", type=int, default=1, help="untimed steps first (default 1)"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (CUDA)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny only, 2 small steps")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one measurement, in a child process
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def specs_from_args(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One spec per (preset, checkpointing off/on), checked before any process starts."""
    if args.quick:
        args.presets, args.steps, args.warmup_steps = "tiny", 2, 0
        args.batch_size = args.batch_size or 2
    presets = [name.strip() for name in args.presets.split(",") if name.strip()]
    for name in presets:
        if name not in PRESETS:
            raise RoseError(f"unknown preset {name!r}; choose from: {', '.join(PRESETS)}")
    for flag in ("batch_size", "block_size", "steps"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise RoseError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.warmup_steps < 0:
        raise RoseError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    setup_device(args.device, args.dtype)  # fail here, not in a child
    specs = []
    for name in presets:
        block_size = args.block_size or PRESETS[name]["block_size"]
        GPTConfig.from_preset(name, block_size=block_size)
        for checkpointing in (False, True):
            specs.append(
                {
                    "preset": name,
                    "checkpointing": checkpointing,
                    "batch_size": args.batch_size or DEFAULT_BATCH.get(name, 1),
                    "block_size": block_size,
                    "steps": args.steps,
                    "warmup_steps": args.warmup_steps,
                    "device": args.device,
                    "dtype": args.dtype,
                }
            )
    return specs


def bench(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(measure(json.loads(args.worker))))
        return 0
    results = []
    for spec in specs_from_args(args):
        on = "on" if spec["checkpointing"] else "off"
        print(f"measuring {spec['preset']}, checkpointing {on} ...", file=sys.stderr, flush=True)
        results.append(run_in_fresh_process(spec))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_table(results)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: bench(argv), PROG)


if __name__ == "__main__":
    sys.exit(main())
