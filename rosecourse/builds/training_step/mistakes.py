"""The training step build's known wrong answers (data: what `rose-course check
training_step` names).

Each is the reference solution (training_step/reference.py) with one
function written wrong, as a learner writes it into build_training_step.py: it runs as
if written there (grading.replaced rebinds it to the module's globals; the names it
reads are imported below from the reference solution). `# the mistake` marks the line.
"""

from __future__ import annotations

import math

from torch import nn

from rosecourse.builds.grading import KnownWrong
from rosecourse.builds.training_step.reference import clip_gradients, learning_rate
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


def _train_step(model, optimizer, batches, step, cfg, scaled=True, clip_first=True):
    """The reference's train_step, with the mistake its arguments say."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, cfg)
    total = 0.0
    for _ in range(cfg.grad_accum_steps):
        x, y = next(batches)
        # the mistake when not scaled: was `loss = model(x, y).loss / cfg.grad_accum_steps`
        loss = model(x, y).loss / (cfg.grad_accum_steps if scaled else 1)
        loss.backward()
        total += loss.item() / (1 if scaled else cfg.grad_accum_steps)
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    if not clip_first:  # the mistake: was `clip_gradients(...)`, then `optimizer.step()`
        optimizer.step()
    norm = clip_gradients(model.parameters(), max_norm)
    if clip_first:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, norm


def _unscaled_accumulation(model, optimizer, batches, step, cfg):
    return _train_step(model, optimizer, batches, step, cfg, scaled=False)


def _clipped_after_the_step(model, optimizer, batches, step, cfg):
    return _train_step(model, optimizer, batches, step, cfg, clip_first=False)


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
