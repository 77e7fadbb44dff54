"""A run's metrics.jsonl (one JSON object per step and per eval) and its loss curve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rosetrainer.errors import RoseError, os_error_line
from rosetrainer.files import write_atomically, write_bytes_atomically


class MetricsLog:
    """metrics.jsonl: one JSON object per step ("train") and per eval ("eval")."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled  # rank 0 writes; the other ranks log nothing

    def write(self, kind: str, **values: Any) -> None:
        if not self.enabled:
            return
        try:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"kind": kind, **values}) + "\n")
        except OSError as err:
            raise RoseError(os_error_line(err, self.path, "append to")) from None

    def read(self) -> tuple[list[dict[str, Any]], bool]:
        """The records, and whether a torn last line (a crash or a full disk mid-write) was
        dropped. A damaged line anywhere else is an error: the file is not what rose wrote."""
        if not self.path.is_file():
            return [], False
        lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
        records = []
        for number, line in enumerate(lines, start=1):
            try:
                record = json.loads(line)
                if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                    raise ValueError("not a record")
            except ValueError:
                if number == len(lines):
                    return records, True
                raise RoseError(
                    f"{self.path} line {number} is not a metrics record; move the file away "
                    f"(or start over with --overwrite)"
                ) from None
            records.append(record)
        return records, False

    def keep_up_to(self, step: int) -> bool:
        """Drop records past `step` (a resumed run redoes those steps), rewriting the file
        atomically; True when a torn last line was dropped as well."""
        if not self.enabled:
            return False
        records, torn = self.read()
        kept = "".join(json.dumps(r) + "\n" for r in records if r["step"] <= step)
        write_bytes_atomically(self.path, kept.encode("utf-8"))
        return torn


def plot_losses(records: list[dict[str, Any]], png_path: Path) -> bool:
    """Train loss at every step and train/val loss at every eval, as a PNG (False without
    matplotlib, which is optional)."""
    try:
        from matplotlib.figure import Figure  # the object API: no display backend needed
    except ImportError:
        return False
    steps = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.plot(
        [r["step"] for r in steps], [r["loss"] for r in steps], lw=0.8, alpha=0.5,
        label="train (step)",
    )  # fmt: skip
    ax.plot(
        [r["step"] for r in evals], [r["train_loss"] for r in evals], "o-", label="train (eval)"
    )
    ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="val (eval)")
    ax.set(xlabel="optimizer step", ylabel="cross-entropy (nats)", title="loss")
    ax.grid(alpha=0.3)
    ax.legend()
    write_atomically(png_path, lambda f: fig.savefig(f, format="png", dpi=120, bbox_inches="tight"))
    return True
