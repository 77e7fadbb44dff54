"""What the next training step depends on, and the checkpoint that writes it down.

Resume is exact: a checkpoint holds the weights, AdamW's moments, the loss scaler, the
step, every random number generator and the state of the batch sampler, so N steps,
stop, resume, N more gives the same losses as 2N steps in one go. It also holds a hash
of the training text, so a resume on a text that changed is noticed.

Restoring checks each field as it goes: a checkpoint damaged inside (a wrong optimizer
state, a broken generator state) is refused with the field's name, not a traceback.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rosetrainer.config import GPTConfig, TrainConfig
from rosetrainer.errors import RoseError, one_line
from rosetrainer.model import GPT
from rosetrainer.runtime import Runtime


def rng_state() -> dict[str, Any]:
    """Every random stream training draws from, as tensors and plain lists."""
    version, mt_state, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": [version, list(mt_state), gauss_next],
    }


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, mt_state, gauss_next = state["python"]
    random.setstate((version, tuple(mt_state), gauss_next))


@contextlib.contextmanager
def restoring(field: str, source: str) -> Iterator[None]:
    """Turn whatever a damaged field makes torch or Python raise into one line naming it."""
    try:
        yield
    except (ValueError, KeyError, RuntimeError, TypeError, IndexError, AttributeError) as err:
        reason = one_line(err, with_type=False)[:200]
        raise RoseError(
            f"{source}: its {field!r} is damaged ({reason}); resume from another checkpoint, "
            f"or start a new run"
        ) from None


def check_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Every moment AdamW keeps has its parameter's shape, and a finite step count."""
    for param, state in optimizer.state.items():
        for name, value in state.items():
            if name == "step":
                if not torch.isfinite(torch.as_tensor(value)).all():
                    raise ValueError(f"a non-finite step count {value}")
            elif value.shape != param.shape:
                raise ValueError(f"{name} has shape {tuple(value.shape)}, its parameter "
                                 f"{tuple(param.shape)}")  # fmt: skip


@dataclass
class TrainingState:
    """What the next step depends on; a checkpoint is this, written down."""

    raw_model: GPT
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    data_generator: torch.Generator  # draws the training batches: its state is the data position
    data_sha256: str | None = None  # the training text's hash
    step: int = 0  # optimizer steps done
    best_val_loss: float = math.inf

    def to_checkpoint(self, model_cfg: GPTConfig, cfg: TrainConfig) -> dict[str, Any]:
        return {
            "model": self.raw_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            "step": self.step,
            "best_val_loss": self.best_val_loss,
            "model_config": model_cfg.to_dict(),
            "train_config": cfg.to_dict(),
            "rng": rng_state(),
            "data_state": self.data_generator.get_state(),
            "data_sha256": self.data_sha256,
            "tokenizer_name": cfg.tokenizer_name,
        }

    def restore(self, ckpt: dict[str, Any], source: str, cfg: TrainConfig, rt: Runtime) -> None:
        """Continue from `ckpt` (its weights are already in raw_model), field by field."""
        with restoring("step", source):
            self.step, self.best_val_loss = int(ckpt["step"]), float(ckpt["best_val_loss"])
            if self.step < 0 or math.isnan(self.best_val_loss):
                raise ValueError(f"step {self.step}, best val loss {self.best_val_loss}")
        with restoring("optimizer", source):
            self.optimizer.load_state_dict(ckpt["optimizer"])
            check_optimizer_state(self.optimizer)
        with restoring("scaler", source):
            if ckpt["scaler"] is not None and self.scaler.is_enabled():
                self.scaler.load_state_dict(ckpt["scaler"])
        with restoring("data_state", source):
            self.data_generator.set_state(ckpt["data_state"])
        with restoring("rng", source):
            restore_rng(ckpt["rng"])
        if rt.rank > 0:  # only rank 0's streams are saved; the others start fresh, distinct ones
            torch.manual_seed(cfg.seed + rt.rank + self.step * rt.world_size)

    def check_data(self, ckpt: dict[str, Any], cfg: TrainConfig) -> None:
        """Refuse to continue on a training text other than the checkpoint's, unless asked."""
        saved = ckpt.get("data_sha256")  # None in checkpoints from before it was stored
        if saved is None or saved == self.data_sha256 or cfg.accept_different_data:
            return
        raise RoseError(
            f"the training text changed since the checkpoint (sha256 {saved[:16]}... then, "
            f"{str(self.data_sha256)[:16]}... now); resume on the same text, or pass "
            f"--accept-different-data to go on with this one"
        )
