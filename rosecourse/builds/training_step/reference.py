"""Build (chapter 00): the training step, as rose's trainer takes it.

The pieces of one optimizer step (rose's are `GPT.configure_optimizer` in
rosetrainer/model.py, `learning_rate_at` in rosetrainer/schedule.py and `train_step` in
rosetrainer/step.py, with PyTorch's AdamW): the AdamW update itself, its two parameter
groups, the learning-rate schedule, gradient clipping by the global norm, and the step
over several micro-batches. One process, no gradient scaler; float32, or bfloat16 where
cfg.dtype says so: as rose's trainer trains in it, autocast around each forward pass,
the weights, their gradients and AdamW's state float32.

`cfg` is a `rosetrainer.config.TrainConfig`; the fields read here are learning_rate,
min_lr, warmup_steps, max_steps, lr_decay_steps, weight_decay, beta1, beta2,
grad_accum_steps, grad_clip and dtype.

`rose-course check training_step` compares your AdamW (a group with betas and eps of
its own among them) and clipping with PyTorch's, your groups and schedule with rose's,
and then trains rose's GPT (a tiny one) for 12 steps from one seed with your pieces
beside rose's trainer doing the same (and again in bfloat16): every step's loss, every
step's returned gradient norm and the final parameters must agree within the check's
tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from rosetrainer.config import TrainConfig

# The schedule is rose's own (rosetrainer/schedule.py); the stub leaves this import out, with
# the body of learning_rate.
from rosetrainer.schedule import learning_rate_at as rose_learning_rate_at


class AdamW(torch.optim.Optimizer):
    """Adam with decoupled weight decay (Loshchilov and Hutter, "Decoupled Weight Decay
    Regularization"), computing what torch.optim.AdamW computes with its default
    options (its documentation writes the algorithm out)."""

    def __init__(
        self,
        params: Iterable[nn.Parameter] | Iterable[dict],
        lr: float,
        betas: tuple[float, float],
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        """params: parameters, or groups (dicts with "params" and any of lr, betas, eps,
        weight_decay, which override these defaults for the group), as for any
        torch.optim.Optimizer: hand them to its constructor with the defaults."""
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self) -> None:
        """Update every parameter that has a gradient, with its group's settings as they
        are now (a schedule changes group["lr"] between steps; a group's betas and eps
        may differ from the defaults): the update torch.optim.AdamW makes with its
        default options, the weight decay decoupled from the gradient. A parameter
        without a gradient is left alone, and so is everything the optimizer keeps for
        it (its count of updates too)."""
        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                state["t"] += 1
                t, m, v, grad = state["t"], state["m"], state["v"], p.grad
                p.mul_(1 - lr * group["weight_decay"])
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                m_hat = m / (1 - beta1**t)
                v_hat = v / (1 - beta2**t)
                p.sub_(lr * m_hat / (v_hat.sqrt() + group["eps"]))


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups: every parameter of `model` that requires a gradient in
    exactly one group (a tied weight, one Parameter under two names, once). The matrices
    (weights of at least two dimensions: Linear and Embedding weights) decay with
    `weight_decay`; biases and LayerNorm weights (one dimension) do not (weight_decay 0).
    Each group is a dict with "params" (a list) and "weight_decay"."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> AdamW:
    """Your AdamW over `parameter_groups(model, cfg.weight_decay)`, learning rate
    cfg.learning_rate, betas (cfg.beta1, cfg.beta2), eps left at its default."""
    groups = parameter_groups(model, cfg.weight_decay)
    return AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2))


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """The learning rate of optimizer step `step` (0 for the first step of a run).

    A linear warmup over the first warmup_steps steps that climbs in equal steps from
    learning_rate / warmup_steps at step 0 (no step runs at rate 0) to learning_rate at
    step warmup_steps - 1. Then half a period of a cosine, from learning_rate at step
    warmup_steps down to min_lr at step D (lr_decay_steps, or max_steps when that is
    None). From step D on, min_lr for good.
    """
    return rose_learning_rate_at(step, cfg)


def clip_gradients(parameters: Iterable[nn.Parameter], max_norm: float) -> float:
    """Scale the gradients of `parameters` (those that have one) down so that their
    global norm, the L2 norm of all their entries together, is at most max_norm; return
    the norm before clipping. As torch.nn.utils.clip_grad_norm_ does it: every gradient is
    multiplied by max_norm / (norm + 1e-6) when that is below 1, and left alone otherwise
    (max_norm may be math.inf: nothing is clipped)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.stack([g.norm() for g in grads]).norm().item()  # the norm of the norms
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
    return norm


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    step: int,
    cfg: TrainConfig,
) -> tuple[float, float]:
    """Optimizer step number `step` (0 for the first), as rose's trainer takes it: every
    group's learning rate is `learning_rate(step, cfg)`; the gradients are those of the
    mean loss `model(x, y).loss` over cfg.grad_accum_steps micro-batches, each the next
    (x, y) of `batches`; they are clipped to cfg.grad_clip (0: not clipped) before the
    optimizer's step, and cleared after it. Returns (the mean loss over the
    micro-batches, the gradients' norm before clipping, measured when not clipped too),
    as floats.

    cfg.dtype is "float32" or "bfloat16": in bfloat16 each forward pass runs under
    torch.autocast for the device type of the model's parameters, in torch.bfloat16 (its
    products compute in bfloat16); the backward pass and the step run outside it, and the
    weights, their gradients and the optimizer's state stay float32.
    """
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, cfg)
    device_type = next(model.parameters()).device.type
    total = 0.0
    for _ in range(cfg.grad_accum_steps):
        x, y = next(batches)
        with torch.autocast(device_type, torch.bfloat16, enabled=cfg.dtype == "bfloat16"):
            loss = model(x, y).loss / cfg.grad_accum_steps
        loss.backward()
        total += loss.item()
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    norm = clip_gradients(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, norm


# `rose-course hint training_step` gives these one at a time, the idea first and the
# near-code last (`rose-course check training_step` counts how many were used); the stub
# leaves them out.
HINTS = (
    "The pieces are small and separate: learning_rate and clip_gradients are plain "
    "functions, parameter_groups a filter, AdamW one loop; train_step only calls them. "
    "`rose-course check training_step` grades each on its own before it trains with all "
    "of them.",
    "AdamW.step: torch.optim.Optimizer keeps `self.param_groups` (each a dict with "
    '"params" and every setting, the defaults filled in) and `self.state[p]`, a dict per '
    "parameter, empty until you fill it: keep there the two moving averages (zeros like "
    "p) and the count of updates t.",
    "AdamW.step, the algorithm (torch.optim.AdamW's documentation writes it out): "
    "p <- p * (1 - lr * weight_decay); m <- beta1 * m + (1 - beta1) * g; "
    "v <- beta2 * v + (1 - beta2) * g * g; m_hat = m / (1 - beta1 ** t), "
    "v_hat = v / (1 - beta2 ** t); p <- p - lr * m_hat / (sqrt(v_hat) + eps).",
    "parameter_groups: `model.parameters()` gives a tied weight once (two names, one "
    "Parameter); `p.dim() >= 2` tells a matrix from a bias or a LayerNorm weight.",
    "learning_rate: three pieces by `step`: step < warmup_steps: learning_rate * (step + 1) "
    "/ warmup_steps; step >= D: min_lr; between them, with progress = (step - warmup_steps) "
    "/ (D - warmup_steps) going from 0 to 1: min_lr + 0.5 * (1 + cos(pi * progress)) * "
    "(learning_rate - min_lr).",
    "clip_gradients: the global norm is the norm of the per-tensor norms "
    "(torch.stack([g.norm() for g in grads]).norm()); scale every gradient in place "
    "(g.mul_) only when max_norm / (norm + 1e-6) is below 1; return the norm measured "
    "before.",
    "train_step: to get the gradients of the mean loss, divide each micro-batch's loss by "
    "grad_accum_steps before its backward(): backward() adds to what is there. Clip with "
    "max_norm = inf when grad_clip is 0, so the norm is still measured and returned.",
    "train_step in bfloat16: wrap the forward pass alone (model(x, y).loss) in "
    '`torch.autocast(device_type, torch.bfloat16, enabled=cfg.dtype == "bfloat16")`, '
    "device_type that of the parameters (next(model.parameters()).device.type); never "
    "move the model to bfloat16: the weights AdamW updates stay float32.",
    "AdamW.step, near-code (under @torch.no_grad(), in place):\n"
    "    for group in self.param_groups: for p in group['params'] with p.grad:\n"
    "        state = self.state[p]  # t, m, v, created at the first update\n"
    "        p.mul_(1 - lr * weight_decay)\n"
    "        m.mul_(beta1).add_(g, alpha=1 - beta1); v.mul_(beta2).addcmul_(g, g, value=1 - beta2)\n"
    "        p.sub_(lr * (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps))",
)
