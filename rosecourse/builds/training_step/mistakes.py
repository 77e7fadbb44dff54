"""The training step build's known wrong answers (data: what `rose-course check
training_step` names).

Each is the reference solution (rosecourse/solutions/build_training_step.py) with one
function written wrong, as a learner writes it into build_training_step.py: it runs as
if written there (grading.replaced rebinds it to the module's globals; the names it
reads are imported below from the reference solution). `# the mistake` marks the line.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn

from rosecourse.builds.grading import KnownWrong
from rosecourse.solutions.build_training_step import clip_gradients, learning_rate
from rosetrainer.config import TrainConfig


def _decay_on_layernorm(model: nn.Module, weight_decay: float) -> list[dict]:
    # the mistake: was `decay = [p for p in params if p.dim() >= 2]` and `no_decay = [p for p in
    # params if p.dim() < 2]`, params the parameters that require a gradient
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if not n.endswith("bias")]
    no_decay = [p for n, p in named if n.endswith("bias")]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _unscaled_accumulation(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    step: int,
    cfg: TrainConfig,
) -> tuple[float, float]:
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, cfg)
    total = 0.0
    for _ in range(cfg.grad_accum_steps):
        x, y = next(batches)
        # the mistake: was `loss = model(x, y).loss / cfg.grad_accum_steps`
        loss = model(x, y).loss
        loss.backward()
        # the mistake: was `total += loss.item()`
        total += loss.item() / cfg.grad_accum_steps
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    norm = clip_gradients(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, norm


def _clipped_after_the_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    step: int,
    cfg: TrainConfig,
) -> tuple[float, float]:
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, cfg)
    total = 0.0
    for _ in range(cfg.grad_accum_steps):
        x, y = next(batches)
        loss = model(x, y).loss / cfg.grad_accum_steps
        loss.backward()
        total += loss.item()
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    # the mistake: was `norm = clip_gradients(model.parameters(), max_norm) optimizer.step()`
    optimizer.step()
    norm = clip_gradients(model.parameters(), max_norm)
    optimizer.zero_grad(set_to_none=True)
    return total, norm


def _schedule_one_step_off(step: int, cfg: TrainConfig) -> float:
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    if step < cfg.warmup_steps:
        # the mistake: was `return cfg.learning_rate * (step + 1) / cfg.warmup_steps`
        return cfg.learning_rate * step / cfg.warmup_steps
    if step >= decay_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / (decay_steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + cosine * (cfg.learning_rate - cfg.min_lr)


KNOWN_WRONG = (
    KnownWrong(
        "decay_on_layernorm",
        {"parameter_groups": _decay_on_layernorm},
        "the LayerNorm weights decay: weight decay pulls a LayerNorm's gain toward 0; "
        "decay only the matrices (two dimensions or more)",
    ),
    KnownWrong(
        "unscaled_accumulation",
        {"train_step": _unscaled_accumulation},  # fmt: skip
        "each micro-batch's loss is backpropagated unscaled: the gradients add up to the "
        "sum of the micro-batches' losses, not their mean (clipping then sees them "
        "grad_accum_steps times too large)",
    ),
    KnownWrong(
        "clipped_after_the_step",
        {"train_step": _clipped_after_the_step},
        "the gradients are clipped after the optimizer's step has used them: clip first",
    ),
    KnownWrong(
        "schedule_one_step_off",
        {"learning_rate": _schedule_one_step_off},  # fmt: skip
        "the warmup starts at 0: the first step (step 0) must already take "
        "learning_rate / warmup_steps, and step warmup_steps - 1 the full rate",
    ),
)
