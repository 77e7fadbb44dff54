"""The training benchmark runs and prints its table (a smoke test: no timing is asserted)."""

from __future__ import annotations

import pytest

from rosetrainer.bench import bench


def test_quick_bench_prints_both_checkpointing_settings(capsys: pytest.CaptureFixture) -> None:
    assert bench(["--quick"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("tiny ")]
    assert [row[1] for row in rows] == ["off", "on"]
    for row in rows:
        tokens_per_s, total_mib = float(row[5].replace(",", "")), float(row[-1].replace(",", ""))
        assert tokens_per_s > 0 and total_mib > 0
    assert "tiny: checkpointing saves" in out
