"""Training runs for tests: a model small enough that a step takes milliseconds."""

from __future__ import annotations

import json
from pathlib import Path

# The vocabulary stays GPT-2's, so the gpt2 tokenizer fits.
TINY_MODEL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32"]


def tiny_run(text_file: Path, run_dir: Path, *extra: str) -> list[str]:
    """Flags for a few-millisecond-per-step run on text_file, writing to run_dir."""
    data_dir = text_file.parent / "data"
    return [
        "--text-file", str(text_file), "--data-dir", str(data_dir), "--checkpoint-path",
        str(run_dir), *TINY_MODEL, "--batch-size", "2", "--eval-iters", "1",
        "--warmup-steps", "2", "--sample-tokens", "0", "--device", "cpu", *extra,
    ]  # fmt: skip


def train_losses(metrics: Path) -> list[tuple[int, float]]:
    """(step, loss) of every training step logged in a metrics.jsonl (or a run directory's)."""
    path = metrics / "metrics.jsonl" if metrics.is_dir() else metrics
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
