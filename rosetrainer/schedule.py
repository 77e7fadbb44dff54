"""The learning-rate schedule: linear warmup, cosine decay, then a floor."""

from __future__ import annotations

import math

from rosetrainer.config import TrainConfig


def learning_rate_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to learning_rate, cosine decay to min_lr, then min_lr for good.

    `step` counts the optimizer steps already taken (0 for the first). The decay ends
    at lr_decay_steps (default max_steps); a run extended past it goes on at min_lr.
    """
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    if step >= decay_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / (decay_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (
        cfg.learning_rate - cfg.min_lr
    )
