"""python -m benchmarks.contention: rose on a busy machine, beside vLLM on the same load.

    python -m benchmarks.contention            # tiny and GPT-2 124M shapes, with vLLM
    python -m benchmarks.contention --no-vllm  # rose alone
    python -m benchmarks.contention --quick    # the tiny shape, short runs (a smoke test)

A learner's laptop is never idle. This program measures rose's three CPU workloads on
random weights of two shapes (the `tiny` preset a learner trains first, and GPT-2 124M):

* generate: `rose-generate`, one prompt, its default path (the static cache), as a user
  runs it (a process of its own; its own tokens/s line);
* train: the trainer's optimizer step (`rosetrainer.step.train_step`), 8 x 128 tokens
  (tiny) or 1 x 256 (GPT-2), the first step untimed;
* engine: `LLM.generate` over 16 greedy requests (8 for GPT-2; prompts of 16-64 random
  tokens, 32 new tokens each) from a Hugging Face GPT-2 folder of the shape, and vLLM's CPU build on
  the same folder and requests (benchmarks/vllm_venv.py sets it up as the engine
  benchmark does).

Each runs in a fresh process (as a user's command would), with rose's threads as it
chooses them ("auto", rosetrainer/threads.py), fixed at one thread, and fixed at one per
core (torch's default, what rose ran with before it chose): first alone, then beside
`cores` busy programs of equal priority (plain CPU loops, as a browser tab or a build
would be). On 2 cores one run of a setting differs from the next by 5-10% alone and more
when busy, so each setting runs `--rounds` times (3), the settings taking turns, and the
table shows the medians (every run is printed too). It prints tokens/s side by side and
the ratios the choice is judged by: auto against one thread under load (>= 1 means the default never collapses), auto
against one per core alone (its idle speed kept), and rose's engine against vLLM's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks import vllm_venv
from rosetrainer.errors import ArgumentParser, run_cli

SHAPES = {"tiny": "tiny", "gpt2": "gpt2"}  # shape: preset
# Tokens each workload makes or trains on, per shape (quick: the smoke test's).
GENERATE_TOKENS = {"tiny": 300, "gpt2": 32, "quick": 8}
TRAIN_BATCH = {"tiny": (8, 128), "gpt2": (1, 256), "quick": (2, 32)}
TRAIN_STEPS = {"tiny": 8, "gpt2": 2, "quick": 2}
ENGINE_REQUESTS = {"tiny": 64, "gpt2": 8, "quick": 4}
ENGINE_NEW_TOKENS = 32
SETTINGS = ("auto", "1", "cores")  # rose's threads: its choice, one, one per core
QUICK_SETTINGS = ("auto", "1")


def cpu_name() -> str:
    """The CPU's model and the vector instructions that set PyTorch's kernels."""
    name = platform.processor() or "unknown CPU"
    flags = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        name = re.search(r"model name\s*:\s*(.*)", text).group(1)
        flags = re.search(r"flags\s*:\s*(.*)", text).group(1).split()
    except (OSError, AttributeError):
        pass
    has = [
        label
        for label, flag in (
            ("AVX2", "avx2"),
            ("AVX-512", "avx512f"),
            ("AVX512_BF16", "avx512_bf16"),
            ("AMX", "amx_bf16"),
        )
        if flag in flags
    ]
    return f"{name} ({', '.join(has) or 'no AVX2'}), {len(os.sched_getaffinity(0))} cores"


@contextmanager
def busy_programs(count: int) -> Iterator[None]:
    """`count` programs of equal priority that keep a core busy each while the block runs."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    time.sleep(0.5)  # (running before the measured program starts)
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def child_env(setting: str) -> dict[str, str]:
    """The environment of a measured rose process: OMP_NUM_THREADS only where fixed."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if setting != "auto":
        cores = len(os.sched_getaffinity(0))
        env["OMP_NUM_THREADS"] = str(cores if setting == "cores" else int(setting))
    return env


def run_child(args: list[str], setting: str) -> float:
    """A measuring process's tokens/s (its last line: JSON)."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.contention", "--child", *args],
        env=child_env(setting), capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])["tok_s"]


def generate_tok_s(folder: Path, tokens: int, setting: str) -> float:
    """`rose-generate` as a user runs it; its own tokens/s line."""
    out = subprocess.run(
        [sys.executable, "-m", "roseinfer.cli_generate", "--hf-model", str(folder),
         "--prompt", "ROMEO:", "--max-new-tokens", str(tokens), "--seed", "1",
         "--no-stop-at-eot"],
        env=child_env(setting), capture_output=True, text=True, check=True,
    )  # fmt: skip
    return float(re.search(r"tokens/s: ([\d.]+)", out.stderr).group(1))


def requests_for(shape: str, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(50256) for _ in range(rng.randint(16, 64))]
        for _ in range(ENGINE_REQUESTS[shape])
    ]


# ---------------------------------------------------------------------------
# The measuring processes (--child): each prints {"tok_s": ...} last
# ---------------------------------------------------------------------------


def child_train(shape: str, preset: str) -> float:
    import torch

    from rosetrainer.config import GPTConfig, TrainConfig
    from rosetrainer.model import GPT
    from rosetrainer.runtime import Runtime
    from rosetrainer.step import train_step
    from rosetrainer.threads import Threads

    threads = Threads()
    batch, block = TRAIN_BATCH[shape]
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset(preset, vocab_size=50304, block_size=block))
    cfg = TrainConfig(batch_size=batch)
    rt = Runtime(torch.device("cpu"), torch.float32)
    optimizer = model.configure_optimizer(0.1, 1e-3, (0.9, 0.99), "cpu")
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            x = torch.randint(0, 50257, (batch, block + 1))
            yield x[:, :-1], x[:, 1:]

    data = batches()
    threads.adapt()
    train_step(model, optimizer, scaler, data, cfg, rt)  # (warm-up: allocations)
    started = time.perf_counter()
    for _ in range(TRAIN_STEPS[shape]):
        threads.adapt()
        train_step(model, optimizer, scaler, data, cfg, rt)
    return TRAIN_STEPS[shape] * batch * block / (time.perf_counter() - started)


def child_engine(shape: str, folder: str) -> float:
    from roseinfer import LLM, SamplingParams

    llm = LLM(folder, hf=True)
    params = SamplingParams(max_tokens=ENGINE_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # (warm-up)
    prompts = requests_for(shape)
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return len(prompts) * ENGINE_NEW_TOKENS / (time.perf_counter() - started)


# ---------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------


def vllm_tok_s(folder: Path, shape: str) -> float:
    prompts = requests_for(shape)
    run = vllm_venv.run_offline(
        folder, prompts, [ENGINE_NEW_TOKENS] * len(prompts),
        engine_args={"dtype": "float32"}, kv_cache_gib=1, warmup=True,
    )  # fmt: skip
    return len(prompts) * ENGINE_NEW_TOKENS / run.generate_s


def hf_folder(preset: str, directory: Path) -> Path:
    """A random GPT-2 of the preset's shape, saved as rose-export-hf saves one: what
    rose-generate, rose's engine and vLLM all read."""
    import torch

    from rosetrainer.config import GPTConfig
    from rosetrainer.hf import save_hf_gpt2
    from rosetrainer.model import GPT
    from rosetrainer.tokenizer import Tokenizer

    torch.manual_seed(0)
    directory.mkdir(parents=True)
    save_hf_gpt2(GPT(GPTConfig.from_preset(preset)), Tokenizer("gpt2").encoding, directory)
    return directory


def measure(
    shape: str,
    preset: str,
    folder: Path,
    loads: dict,
    settings: tuple,
    with_vllm: bool,
    rounds: int,
) -> dict:
    """tok/s of every workload and setting of one shape, per load: {(what, setting, load)},
    the median of `rounds` runs, the settings taking turns within each round (so that a
    slow minute of the machine falls on all of them, not on one)."""
    runs: dict[tuple[str, str, str], list[float]] = {}
    for load, cores in loads.items():
        with busy_programs(cores):
            for round_ in range(1, rounds + 1):
                for setting in settings:
                    say(f"  {shape} {load}, round {round_}/{rounds}: threads {setting}")
                    runs.setdefault(("generate", setting, load), []).append(
                        generate_tok_s(folder, GENERATE_TOKENS[shape], setting)
                    )
                    runs.setdefault(("train", setting, load), []).append(
                        run_child(["train", shape, preset], setting)
                    )
                    runs.setdefault(("engine", setting, load), []).append(
                        run_child(["engine", shape, str(folder)], setting)
                    )
                if with_vllm:
                    say(f"  {shape} {load}, round {round_}/{rounds}: vLLM")
                    runs.setdefault(("engine", "vLLM", load), []).append(vllm_tok_s(folder, shape))
    for key, values in runs.items():
        say(f"    {' '.join(key)}: {', '.join(f'{v:.1f}' for v in values)}")
    return {key: statistics.median(values) for key, values in runs.items()}


def table(shape: str, figures: dict, loads: dict, settings: tuple) -> None:
    alone, busy = loads
    say(f"\n{shape}: tokens/s by rose's threads ({', '.join(settings)}; cores = one per "
        f"core), alone and beside {loads[busy]} busy programs")  # fmt: skip
    head = "".join(f"{f'{s} {load}':>13}" for load in loads for s in settings)
    say(f"{'':<10}{head}{'busy: auto/1':>14}{'alone: auto/cores':>19}")
    for what in ("generate", "train", "engine"):
        row = "".join(f"{figures[what, s, load]:>13.1f}" for load in loads for s in settings)
        kept = figures[what, "auto", busy] / figures[what, "1", busy]
        idle = "-"
        if "cores" in settings:
            idle = f"{figures[what, 'auto', alone] / figures[what, 'cores', alone]:.2f}x"
        say(f"{what:<10}{row}{kept:>13.2f}x{idle:>19}")
    if ("engine", "vLLM", alone) in figures:
        for load in loads:
            theirs = figures["engine", "vLLM", load]
            ours = figures["engine", "auto", load]
            say(f"engine {load}: rose (auto) {ours:.1f} tok/s, vLLM {theirs:.1f} tok/s, "
                f"rose/vLLM {ours / theirs:.2f}x")  # fmt: skip


def say(text: str = "") -> None:
    print(text, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m benchmarks.contention", description=__doc__)
    p.add_argument("--quick", action="store_true", help="the tiny shape, short runs")
    p.add_argument("--no-vllm", action="store_true", help="leave vLLM out")
    p.add_argument("--shapes", default="tiny,gpt2", help="of: tiny, gpt2 (default: both)")
    p.add_argument(
        "--rounds", type=int, default=3,
        help="runs of each setting, taking turns; the table shows their median (default 3)",
    )  # fmt: skip
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # a measuring process
    return p


def bench(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.child:
        what, shape, where = args.child
        tok_s = child_train(shape, where) if what == "train" else child_engine(shape, where)
        print(json.dumps({"tok_s": tok_s}))
        return 0
    cores = len(os.sched_getaffinity(0))
    loads = {"alone": 0, "busy": cores}
    shapes = ["quick"] if args.quick else args.shapes.split(",")
    say(f"rose on a busy machine: {cpu_name()}; torch threads per setting: auto (rose's "
        f"choice), 1, {cores} (one per core); busy = {cores} CPU loops of equal priority")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="rose-bench-contention-") as tmp:
        for shape in shapes:
            preset = "tiny" if shape == "quick" else SHAPES[shape]
            folder = hf_folder(preset, Path(tmp, shape))
            settings = QUICK_SETTINGS if args.quick else SETTINGS
            rounds = 1 if args.quick else args.rounds
            figures = measure(shape, preset, folder, loads, settings, not args.no_vllm, rounds)
            table(shape, figures, loads, settings)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: bench(argv), "benchmarks.contention")


if __name__ == "__main__":
    sys.exit(main())
