"""DDP under torchrun: two processes on halves of one global batch equal one process on all of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rosetrainer.train import main

# Every rank draws the same global batch and takes its own rows, so the two runs see the
# same windows. What differs is arithmetic order: DDP averages two half-batch gradients
# where one process averages the whole batch at once, and float32 rounds those sums
# differently (~1e-7 relative); AdamW carries that difference from step to step.
RELATIVE_TOLERANCE = 1e-5


def run_flags(text_file: Path, run_dir: Path, batch_size: int) -> list[str]:
    return [
        "--text-file", str(text_file), "--data-dir", str(text_file.parent / "data"),
        "--checkpoint-path", str(run_dir), "--n-layer", "2", "--n-head", "2", "--n-embd", "32",
        "--block-size", "32", "--batch-size", str(batch_size), "--grad-accum-steps", "2",
        "--max-steps", "3", "--warmup-steps", "1", "--eval-interval", "2", "--eval-iters", "1",
        "--sample-tokens", "0", "--device", "cpu",
    ]  # fmt: skip


def logged_losses(run_dir: Path) -> list[tuple[str, int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["kind"], r["step"], r.get("loss", r.get("val_loss"))) for r in records]


@pytest.mark.slow
def test_two_ddp_processes_match_one_process_with_twice_the_batch(
    tmp_path: Path, tinyshakespeare_path: Path
) -> None:
    text_file = tmp_path / "shakespeare.txt"
    text_file.write_text(
        tinyshakespeare_path.read_text(encoding="utf-8")[:20_000], encoding="utf-8"
    )

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two processes on a small machine
    done = subprocess.run(
        [*torchrun, "-m", "rosetrainer.train", *run_flags(text_file, tmp_path / "ddp", 1)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 process(es)" in done.stdout
    assert done.stdout.count("val loss") == 3  # evals at steps 2 and 3, the final line: rank 0 only

    assert main(run_flags(text_file, tmp_path / "single", 2)) == 0

    ddp, single = logged_losses(tmp_path / "ddp"), logged_losses(tmp_path / "single")
    assert [(kind, step) for kind, step, _ in ddp] == [(kind, step) for kind, step, _ in single]
    assert [kind for kind, _, _ in ddp].count("train") == 3
    for (kind, step, ddp_loss), (_, _, single_loss) in zip(ddp, single, strict=True):
        assert ddp_loss == pytest.approx(single_loss, rel=RELATIVE_TOLERANCE), (kind, step)
