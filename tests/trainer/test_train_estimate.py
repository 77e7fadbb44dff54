"""The trainer's "about N minutes on this machine" line, measured from its first steps."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from training import tiny_run

from rosetrainer.config import TrainConfig
from rosetrainer.train import main
from rosetrainer.trainer import ESTIMATE_AFTER_STEPS, time_estimate


def estimate(step: int, step_seconds: float, **train: int) -> str:
    run = SimpleNamespace(cfg=TrainConfig(**train), state=SimpleNamespace(step=step))
    return time_estimate(step_seconds, run)


def test_the_estimate_counts_the_steps_left_and_their_evaluations() -> None:
    # The quickstart's shape with longer evaluations: 494 steps left at 0.6 s, and 5 evals
    # of 2 x 50 batches, each a third of a step: 296.4 s + 100 s = 6.6 minutes.
    line = estimate(6, 0.6, max_steps=500, eval_interval=100, eval_iters=50)
    assert line == (
        "about 7 minutes on this machine for the 494 steps left (0.60 s a step over the last 5)"
    )
    # Evaluations weigh in: without them, 494 x 0.6 s would read "about 5 minutes".
    assert estimate(6, 0.6, max_steps=500, eval_interval=1000, eval_iters=1).startswith(
        "about 5 minutes"
    )
    assert estimate(6, 1.0, max_steps=80, eval_interval=1000, eval_iters=1).startswith(
        "about 1 minute on"
    )
    assert estimate(6, 0.1, max_steps=60, eval_interval=100).startswith("under a minute")
    assert estimate(6, 1.0, max_steps=100, eval_interval=1000, eval_iters=1).startswith(
        "about 2 minutes"
    )


@pytest.mark.slow
def test_a_run_prints_its_estimate_once_after_its_first_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    text_file = tmp_path / "text.txt"
    text_file.write_text(" ".join(f"line {i} of a made-up text." for i in range(600)))
    steps = ESTIMATE_AFTER_STEPS + 3
    assert main(tiny_run(text_file, tmp_path / "run", "--max-steps", str(steps))) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "on this machine" in line]
    assert len(lines) == 1, lines
    left = steps - 1 - ESTIMATE_AFTER_STEPS
    assert re.fullmatch(
        rf"\[rosetrainer\] under a minute on this machine for the {left} steps left "
        rf"\(\d+\.\d\d s a step over the last {ESTIMATE_AFTER_STEPS}\)",
        lines[0],
    )
