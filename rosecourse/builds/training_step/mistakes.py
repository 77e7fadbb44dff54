"""The training step build's known answers, as data (rosecourse/exercises/answers.py says
what each kind is; tests/course/test_builds.py runs them against this build's check).

Each is the reference solution (reference.py, beside this file) with one class, function or
method replaced by the code below, as a learner writes it into build_training_step.py: it
runs as if written there (grading.replaced rebinds a function to the module's globals, so
the names it reads are the module's; those imported below from the reference are for the
reader and the linter). First the known mistakes (`KNOWN_WRONG`: what `rose-course check
training_step` names when a learner's module probes like one); then the other wrong answers
(`build_mutant`) and the right ones written another way (`build_alternative`); last the
wrong answers written blind (`blind_build`). Where a piece was written as an edit of the
reference's text, `# the mistake` marks the line.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from rosecourse.builds.grading import KnownWrong
from rosecourse.builds.training_step import reference
from rosecourse.builds.training_step.reference import (
    AdamW,
    clip_gradients,
    learning_rate,
    parameter_groups,
)
from rosecourse.exercises.answers import blind_build, build_alternative, build_mutant
from rosetrainer.config import TrainConfig

# == The known mistakes: the check names each one it meets (KNOWN_WRONG) ======================


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


# == Other wrong answers (build_mutant), and right ones (build_alternative) ==================
# tests/course/test_builds.py asserts that each wrong one fails a part of the check without
# being taken for a known mistake, and that each right one passes every part.

# -- written as code -----------------------------------------------------------------------

# These run with the learner module's globals: learning_rate, clip_gradients, math, torch.


def _train_step_norm(model, optimizer, batches, step, cfg, norm_of):
    """The reference's train_step, its returned norm norm_of(norm before clipping,
    max_norm, model)."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, cfg)  # noqa: F821
    total = 0.0
    for _ in range(cfg.grad_accum_steps):
        x, y = next(batches)
        loss = model(x, y).loss / cfg.grad_accum_steps
        loss.backward()
        total += loss.item()
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    norm = clip_gradients(model.parameters(), max_norm)  # noqa: F821
    returned = norm_of(norm, max_norm, model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, returned


@build_mutant("training_step", "train_step")
def norm_zero_when_not_clipped(model, optimizer, batches, step, cfg):
    return _train_step_norm(
        model,
        optimizer,
        batches,
        step,
        cfg,
        lambda norm, max_norm, m: norm if cfg.grad_clip else 0.0,
    )


@build_mutant("training_step", "train_step")
def norm_measured_after_clipping(model, optimizer, batches, step, cfg):
    def after(norm, max_norm, m):
        grads = [p.grad for p in m.parameters() if p.grad is not None]
        return float(torch.stack([g.norm() for g in grads]).norm())

    return _train_step_norm(model, optimizer, batches, step, cfg, after)


@build_mutant("training_step", "train_step")
def norm_capped_at_the_threshold(model, optimizer, batches, step, cfg):
    return _train_step_norm(
        model, optimizer, batches, step, cfg, lambda norm, max_norm, m: min(norm, max_norm)
    )


@build_mutant("training_step", "train_step")
def norm_per_micro_batch(model, optimizer, batches, step, cfg):
    return _train_step_norm(
        model, optimizer, batches, step, cfg,
        lambda norm, max_norm, m: norm / cfg.grad_accum_steps,
    )  # fmt: skip


@build_mutant("training_step", "train_step")
def gradients_cleared_first(model, optimizer, batches, step, cfg):
    # Cleared at the start of the step instead of after it: the same updates, and the
    # gradients left set on return.
    optimizer.zero_grad(set_to_none=True)
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, cfg)  # noqa: F821
    total = 0.0
    for _ in range(cfg.grad_accum_steps):
        x, y = next(batches)
        loss = model(x, y).loss / cfg.grad_accum_steps
        loss.backward()
        total += loss.item()
    norm = clip_gradients(model.parameters(), cfg.grad_clip or math.inf)  # noqa: F821
    optimizer.step()
    return total, norm


@build_mutant("training_step", "clip_gradients")
def clip_iterates_the_parameters_twice(parameters, max_norm):
    # Right for a list; a generator (model.parameters()) is empty the second time round.
    norm = torch.stack([p.grad.norm() for p in parameters if p.grad is not None]).norm().item()
    if max_norm / (norm + 1e-6) < 1.0:
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(max_norm / (norm + 1e-6))
    return norm


@build_mutant("training_step", "parameter_groups")
def frozen_parameters_grouped(model, weight_decay):
    params = list(model.parameters())  # those that do not require a gradient too
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


class _AdamReading(reference.AdamW):
    """The reference's AdamW with each group's settings read through `setting`."""

    def setting(self, group, name):
        return group[name]

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr = group["lr"]
            beta1, beta2 = self.setting(group, "betas")
            eps = self.setting(group, "eps")
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
                p.sub_(lr * (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps))


@build_mutant("training_step", "AdamW", name="betas_from_the_constructor")
class BetasFromTheConstructor(_AdamReading):
    def setting(self, group, name):
        return self.defaults[name] if name == "betas" else group[name]


@build_mutant("training_step", "AdamW", name="eps_from_the_constructor")
class EpsFromTheConstructor(_AdamReading):
    def setting(self, group, name):
        return self.defaults[name] if name == "eps" else group[name]


@build_mutant("training_step", "AdamW", name="settings_kept_from_the_constructor")
class SettingsKeptFromTheConstructor(_AdamReading):
    # betas and eps copied onto the optimizer when it is built, as plain attributes.
    def __init__(self, params, lr, betas, eps=1e-8, weight_decay=0.0):
        super().__init__(params, lr, betas, eps, weight_decay)
        self.betas, self.eps = betas, eps

    def setting(self, group, name):
        return getattr(self, name)


@build_alternative("training_step", "AdamW", name="adam_reading_every_group_setting")
class AdamReadingEveryGroupSetting(_AdamReading):
    pass


# -- first written as edits of the reference's text: `# the mistake` marks the line ----------
# A mutant that replaces two pieces is registered twice under one name.


@build_mutant("training_step", "AdamW.step")
@torch.no_grad()
def adam_with_l2(self) -> None:
    for group in self.param_groups:
        lr, (beta1, beta2) = group["lr"], group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
            state["t"] += 1
            # the mistake: was `t, m, v, grad = state["t"], state["m"], state["v"], p.grad`
            t, m, v, grad = state["t"], state["m"], state["v"], p.grad + group["weight_decay"] * p
            # the mistake: `p.mul_(1 - lr * group["weight_decay"])` left out
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            m_hat = m / (1 - beta1**t)
            v_hat = v / (1 - beta2**t)
            p.sub_(lr * m_hat / (v_hat.sqrt() + group["eps"]))


@build_mutant("training_step", "AdamW.step")
@torch.no_grad()
def no_bias_correction(self) -> None:
    for group in self.param_groups:
        lr, (beta1, beta2) = group["lr"], group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
            state["t"] += 1
            m, v, grad = state["m"], state["v"], p.grad
            p.mul_(1 - lr * group["weight_decay"])
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            # the mistake: was `m_hat = m / (1 - beta1**t)`, t = state["t"]
            m_hat = m
            # the mistake: was `v_hat = v / (1 - beta2**t)`
            v_hat = v
            p.sub_(lr * m_hat / (v_hat.sqrt() + group["eps"]))


@build_mutant("training_step", "AdamW.step")
@torch.no_grad()
def eps_inside_the_root(self) -> None:
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
            # the mistake: was `p.sub_(lr * m_hat / (v_hat.sqrt() + group["eps"]))`
            p.sub_(lr * m_hat / (v_hat + group["eps"]).sqrt())


@build_mutant("training_step", "AdamW.step")
@torch.no_grad()
def decay_before_the_rate_is_known(self) -> None:
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
            # the mistake: was `p.mul_(1 - lr * group["weight_decay"])`
            p.mul_(1 - group["weight_decay"])
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            m_hat = m / (1 - beta1**t)
            v_hat = v / (1 - beta2**t)
            p.sub_(lr * m_hat / (v_hat.sqrt() + group["eps"]))


@build_mutant("training_step", "parameter_groups")
def everything_decays(model: nn.Module, weight_decay: float) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    # the mistake: was `decay = [p for p in params if p.dim() >= 2]`
    decay = params
    # the mistake: was `no_decay = [p for p in params if p.dim() < 2]`
    no_decay = []
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


@build_mutant("training_step", "train_step")
def gradients_never_cleared(
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
    norm = clip_gradients(model.parameters(), max_norm)
    optimizer.step()
    # the mistake: `optimizer.zero_grad(set_to_none=True)` left out
    return total, norm


@build_mutant("training_step", "train_step")
def rate_never_set(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    step: int,
    cfg: TrainConfig,
) -> tuple[float, float]:
    # the mistake: `for group in optimizer.param_groups: group["lr"] = learning_rate(step,
    # cfg)` left out
    total = 0.0
    for _ in range(cfg.grad_accum_steps):
        x, y = next(batches)
        loss = model(x, y).loss / cfg.grad_accum_steps
        loss.backward()
        total += loss.item()
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    norm = clip_gradients(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, norm


@build_mutant("training_step", "learning_rate")
def cosine_to_zero(step: int, cfg: TrainConfig) -> float:
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    if step >= decay_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / (decay_steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    # the mistake: was `return cfg.min_lr + cosine * (cfg.learning_rate - cfg.min_lr)`
    return cosine * cfg.learning_rate


@build_mutant("training_step", "learning_rate")
def no_floor(step: int, cfg: TrainConfig) -> float:
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    # the mistake: `if step >= decay_steps: return cfg.min_lr` left out
    progress = (step - cfg.warmup_steps) / (decay_steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + cosine * (cfg.learning_rate - cfg.min_lr)


@build_mutant("training_step", "learning_rate")
def progress_from_step_0(step: int, cfg: TrainConfig) -> float:
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    if step >= decay_steps:
        return cfg.min_lr
    # the mistake: was `progress = (step - cfg.warmup_steps) / (decay_steps - cfg.warmup_steps)`
    progress = step / decay_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + cosine * (cfg.learning_rate - cfg.min_lr)


@build_mutant("training_step", "train_step")
def a_micro_batch_short(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    step: int,
    cfg: TrainConfig,
) -> tuple[float, float]:
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, cfg)
    total = 0.0
    # the mistake: was `for _ in range(cfg.grad_accum_steps):`
    for _ in range(cfg.grad_accum_steps - 1):
        x, y = next(batches)
        loss = model(x, y).loss / cfg.grad_accum_steps
        loss.backward()
        total += loss.item()
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    norm = clip_gradients(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, norm


@build_mutant("training_step", "clip_gradients")
def always_scaled(parameters: Iterable[nn.Parameter], max_norm: float) -> float:
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.stack([g.norm() for g in grads]).norm().item()  # the norm of the norms
    scale = max_norm / (norm + 1e-6)
    # the mistake: was `if scale < 1.0: for g in grads: g.mul_(scale)`
    for g in grads:
        g.mul_(scale)
    return norm


@build_mutant("training_step", "make_optimizer")
def betas_swapped(model: nn.Module, cfg: TrainConfig) -> AdamW:
    groups = parameter_groups(model, cfg.weight_decay)
    # the mistake: was `return AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2))`
    return AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta2, cfg.beta1))


@build_mutant("training_step", "train_step")
def last_micro_batch_loss(
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
        # the mistake: was `total += loss.item()`
        total = loss.item()
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    norm = clip_gradients(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, norm


# == Written blind (blind_build; rosecourse/exercises/answers.py says how) ===================
# Each one's writer said in one line what is wrong: the `# WRONG:` comment above it.


def _blind_adam_step(self, decay_first=True, settings=None, eps_inside=False, step_of=None):
    """The reference's AdamW.step; `settings(group)`: (betas, eps) (the group's own by
    default); `step_of(state)`: the step count the bias correction uses (the parameter's
    own, bumped here, by default)."""
    for group in self.param_groups:
        lr, wd = group["lr"], group["weight_decay"]
        (beta1, beta2), eps = (settings or (lambda g: (g["betas"], g["eps"])))(group)
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
            state["t"] += 1
            t = state["t"] if step_of is None else step_of(state)
            m, v, grad = state["m"], state["v"], p.grad
            if decay_first:
                p.mul_(1 - lr * wd)
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            m_hat = m / (1 - beta1**t)
            v_hat = v / (1 - beta2**t)
            p.sub_(lr * m_hat / ((v_hat + eps).sqrt() if eps_inside else v_hat.sqrt() + eps))
            if not decay_first:
                p.mul_(1 - lr * wd)


# WRONG: decoupled decay applied after the Adam update (shrinks the updated parameter)
@blind_build("training_step", "AdamW.step")
@torch.no_grad()
def decay_after_adam(self):
    _blind_adam_step(self, decay_first=False)  # the mistake: `p.mul_(1 - lr * wd)` moved


# WRONG: betas and eps read from the optimizer's defaults, ignoring a group's own
@blind_build("training_step", "AdamW.step")
@torch.no_grad()
def defaults_betas_eps(self):
    # the mistake: was `group["betas"], group["eps"]`
    _blind_adam_step(self, settings=lambda group: (self.defaults["betas"], self.defaults["eps"]))


# WRONG: eps added inside the square root: sqrt(v_hat + eps)
@blind_build("training_step", "AdamW.step")
@torch.no_grad()
def eps_inside_sqrt(self):
    _blind_adam_step(self, eps_inside=True)  # the mistake: was `v_hat.sqrt() + eps`


# WRONG: one step counter for the whole optimizer (bumped every step()), not per parameter:
# a parameter that skipped a step gets the wrong bias correction
@blind_build("training_step", "AdamW.step")
@torch.no_grad()
def shared_step_counter(self):
    self.steps_taken = getattr(self, "steps_taken", 0) + 1  # the mistake: one count for all
    _blind_adam_step(self, step_of=lambda state: self.steps_taken)


def _blind_groups(model, weight_decay, decays, frozen_too=False):
    """The reference's groups, a parameter decayed when `decays(name, p)`."""
    named = [(n, p) for n, p in model.named_parameters() if frozen_too or p.requires_grad]
    return [
        {"params": [p for n, p in named if decays(n, p)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
    ]


# WRONG: groups by name: everything not named '*bias' decays, so LayerNorm weights decay too
@blind_build("training_step", "parameter_groups", known="decay_on_layernorm")
def decay_by_name(model, weight_decay):
    # the mistake: was `decays=lambda name, p: p.dim() >= 2`
    return _blind_groups(model, weight_decay, lambda name, p: not name.endswith("bias"))


# WRONG: parameter_groups keeps parameters that do not require a gradient (frozen ones get
# optimised/decayed)
@blind_build("training_step", "parameter_groups")
def frozen_params_grouped(model, weight_decay):
    # the mistake: the frozen parameters (requires_grad False) grouped too
    return _blind_groups(model, weight_decay, lambda name, p: p.dim() >= 2, frozen_too=True)


def _blind_rate(step, cfg, decay_steps, warmup_from=1):
    """The reference's learning_rate, decaying to `decay_steps`, the warmup's first step at
    `warmup_from` / warmup_steps of the rate."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + warmup_from) / cfg.warmup_steps
    if step >= decay_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / (decay_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (
        cfg.learning_rate - cfg.min_lr
    )


# WRONG: cosine always ends at max_steps, lr_decay_steps ignored
@blind_build("training_step", "learning_rate")
def ignores_lr_decay_steps(step, cfg):
    return _blind_rate(step, cfg, cfg.max_steps)  # the mistake: was `cfg.lr_decay_steps or ...`


# WRONG: warmup starts at rate 0 at step 0 (step / warmup_steps), off by one
@blind_build("training_step", "learning_rate", known="schedule_one_step_off")
def warmup_from_zero(step, cfg):
    # the mistake: was `(step + 1) / cfg.warmup_steps` in the warmup
    return _blind_rate(step, cfg, cfg.lr_decay_steps or cfg.max_steps, warmup_from=0)


def _blind_norm(grads) -> float:
    return torch.stack([g.norm() for g in grads]).norm().item()


def _blind_clip(parameters, max_norm, norm_of=_blind_norm):
    """The reference's clip_gradients, the gradients' norm as `norm_of(grads)` says."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = norm_of(grads)
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
    return norm


# WRONG: global norm computed as the sum of each gradient's L2 norm
@blind_build("training_step", "clip_gradients")
def clip_sum_of_norms(parameters, max_norm):
    # the mistake: was the norm of the norms
    return _blind_clip(parameters, max_norm, lambda grads: sum(g.norm().item() for g in grads))


# WRONG: clip_gradients iterates `parameters` twice (a generator is empty the 2nd time, so
# nothing is clipped); train_step happens to pass a list
@blind_build("training_step", "clip_gradients", name="clip_iterates_twice_list")
def _clip_iterating_twice(parameters, max_norm):
    norm = _blind_norm([p.grad for p in parameters if p.grad is not None])
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for p in parameters:  # the mistake: `parameters` read again (a generator is spent)
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


def _blind_train_step(
    model,
    optimizer,
    batches,
    step,
    cfg,
    first_group_only=False,
    last_loss=False,
    zero_clips=False,
    cleared_first=False,
    as_list=False,
):
    """The reference's train_step, with the mistakes its arguments name."""
    if cleared_first:
        optimizer.zero_grad(set_to_none=True)
    groups = optimizer.param_groups[:1] if first_group_only else optimizer.param_groups
    for group in groups:
        group["lr"] = learning_rate(step, cfg)
    total = 0.0
    for _ in range(cfg.grad_accum_steps):
        x, y = next(batches)
        loss = model(x, y).loss / cfg.grad_accum_steps
        loss.backward()
        total = loss.item() * cfg.grad_accum_steps if last_loss else total + loss.item()
    max_norm = cfg.grad_clip if zero_clips or cfg.grad_clip > 0 else math.inf
    parameters = list(model.parameters()) if as_list else model.parameters()
    norm = clip_gradients(parameters, max_norm)
    optimizer.step()
    if not cleared_first:
        optimizer.zero_grad(set_to_none=True)
    return total, norm


@blind_build("training_step", "train_step", name="clip_iterates_twice_list")
def _clip_given_a_list(model, optimizer, batches, step, cfg):
    return _blind_train_step(model, optimizer, batches, step, cfg, as_list=True)


# WRONG: grad_clip 0 passed straight to clipping (every gradient zeroed) instead of meaning
# 'no clipping'
@blind_build("training_step", "train_step")
def clip_zero_clips(model, optimizer, batches, step, cfg):
    return _blind_train_step(model, optimizer, batches, step, cfg, zero_clips=True)


# WRONG: gradients cleared at the start of train_step instead of after the optimizer step
# (left set on return)
@blind_build("training_step", "train_step")
def grads_cleared_first(model, optimizer, batches, step, cfg):
    return _blind_train_step(model, optimizer, batches, step, cfg, cleared_first=True)


# WRONG: returns the last micro-batch's loss (unscaled), not the mean over micro-batches
@blind_build("training_step", "train_step")
def loss_last_micro(model, optimizer, batches, step, cfg):
    return _blind_train_step(model, optimizer, batches, step, cfg, last_loss=True)


# WRONG: the schedule's rate is set on the first parameter group only
@blind_build("training_step", "train_step")
def lr_first_group_only(model, optimizer, batches, step, cfg):
    return _blind_train_step(model, optimizer, batches, step, cfg, first_group_only=True)


# == A whole module written another way (build_alternative's, not one piece: all) ==========
# Every class and function written afresh, as another learner would write the file;
# tests/course/test_builds.py asserts that it passes every part.

ALTERNATIVE_MODULE = """
import math

import torch


class AdamW(torch.optim.Optimizer):
    def __init__(self, params, lr, betas, eps=1e-8, weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in (q for q in group["params"] if q.grad is not None):
                s = self.state[p]
                s.setdefault("exp_avg", torch.zeros_like(p))
                s.setdefault("exp_avg_sq", torch.zeros_like(p))
                s["n"] = s.get("n", 0) + 1
                p.mul_(1 - group["lr"] * group["weight_decay"])
                s["exp_avg"].lerp_(p.grad, 1 - b1)
                s["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (s["exp_avg_sq"].sqrt() / math.sqrt(1 - b2 ** s["n"])).add_(group["eps"])
                p.addcdiv_(s["exp_avg"], denom, value=-group["lr"] / (1 - b1 ** s["n"]))


def parameter_groups(model, weight_decay):
    seen, decay, keep = set(), [], []
    for _, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (decay if p.ndim > 1 else keep).append(p)
    return [dict(params=keep, weight_decay=0.0), dict(params=decay, weight_decay=weight_decay)]


def make_optimizer(model, cfg):
    return AdamW(
        parameter_groups(model, cfg.weight_decay), lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2)
    )


def learning_rate(step, cfg):
    end = cfg.max_steps if cfg.lr_decay_steps is None else cfg.lr_decay_steps
    if step < cfg.warmup_steps:
        return (step + 1) * cfg.learning_rate / cfg.warmup_steps
    t = min(1.0, (step - cfg.warmup_steps) / (end - cfg.warmup_steps))
    return cfg.min_lr + (cfg.learning_rate - cfg.min_lr) * (1 + math.cos(math.pi * t)) / 2


def clip_gradients(parameters, max_norm):
    return float(torch.nn.utils.clip_grad_norm_(list(parameters), max_norm))


def train_step(model, optimizer, batches, step, cfg):
    rate = learning_rate(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = rate
    device = next(model.parameters()).device.type
    with torch.autocast(device, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16"):
        losses = [model(*next(batches)).loss for _ in range(cfg.grad_accum_steps)]
    mean = torch.stack(losses).mean()
    mean.backward()
    norm = clip_gradients(model.parameters(), cfg.grad_clip or math.inf)
    optimizer.step()
    optimizer.zero_grad()
    return mean.item(), norm
"""
