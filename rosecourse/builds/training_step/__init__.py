"""Build (chapter 00): the training step, run beside rose's trainer.

Contract: rosecourse/builds/training_step/reference.py. The parts:

* AdamW: a few updates of parameters in three groups (one with betas and eps of its
  own, which override the optimizer's), learning rate changed between steps, one
  parameter without a gradient, against torch.optim.AdamW's;
* the parameter groups: each of rose's GPT's parameters in one group, with the weight
  decay rose's `configure_optimizer` gives it;
* the schedule: every step's learning rate equal to `learning_rate_at`'s, for a run with
  a warmup, one without, and one whose decay ends before max_steps;
* clipping: gradients and the returned norm equal to `clip_grad_norm_`'s, above and
  below the threshold and without one;
* training: a tiny GPT trained for STEPS steps from one seed by the learner's optimizer
  and step, beside the same GPT trained by rose's own pieces (`configure_optimizer`,
  `learning_rate_at`, `rosetrainer.step.train_step`) on the same batches: once with one
  micro-batch a step, once with three and a clipping threshold that some steps cross.
  Every step's loss and every final parameter agree within LOSS_RTOL and PARAM_RTOL of
  their scale, and every step's returned gradient norm (before clipping, measured when
  nothing is clipped too) within NORM_RTOL of rose's;
* training in bfloat16: one step of the same, accumulated and clipped, with cfg.dtype
  "bfloat16", as rose's trainer trains in it (autocast around each forward pass; the
  weights, their gradients and AdamW's state stay float32), held to the BF16_ tolerances.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Callable, Iterator

import numpy as np
import torch

from rosecourse.builds.grading import (
    Build,
    Mismatch,
    Part,
    expect_close,
    first_gap,
    judging,
    made,
    seen,
)
from rosecourse.builds.training_step.mistakes import KNOWN_WRONG
from rosetrainer.config import GPTConfig, TrainConfig
from rosetrainer.data import get_batch
from rosetrainer.model import GPT
from rosetrainer.runtime import DTYPES, Runtime
from rosetrainer.schedule import learning_rate_at
from rosetrainer.step import train_step

MODEL = GPTConfig(vocab_size=97, block_size=12, n_layer=2, n_head=3, n_embd=24)
STEPS = 12  # a warmup of 4, the cosine, 3 steps at its floor: every known mistake shows
BATCH = 4
# Float32 Adam steps taken with sums in another order (a loss added up as a float, a
# clipping factor computed in double) part by a few float32 epsilons in each step's loss:
# LOSS_RTOL of the loss. The weights part more: a key's bias gets no gradient but rounding
# noise (softmax ignores what a query adds to every score), and Adam divides that noise by
# its own size, so such an entry wanders by up to about 2e-4 (measured over 20 steps):
# PARAM_RTOL of each parameter's largest entry (at least 1). The mistakes graded here move
# a loss by 3e-3 and the weights by 2e-2 or more (measured over 20 steps).
LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-3
# The returned gradient norms part as the weights do (measured: under 1e-5 of the norm);
# a norm taken after clipping, per micro-batch or left at 0 is off by 10% or more.
NORM_RTOL = 1e-3
# The run: a warmup, a cosine that ends three steps early (the floor is reached), a weight
# decay large enough to show, and a learning rate high enough that every step counts.
RUN = dict(learning_rate=1e-2, min_lr=1e-3, warmup_steps=4, max_steps=STEPS,
           lr_decay_steps=STEPS - 3, weight_decay=0.5, beta1=0.9, beta2=0.95)  # fmt: skip
ONE_MICRO_BATCH = TrainConfig(**RUN, grad_accum_steps=1, grad_clip=0.0, batch_size=BATCH)
# Clipped at a norm that about half of the steps' gradients cross.
ACCUMULATED = TrainConfig(**RUN, grad_accum_steps=3, grad_clip=1.2, batch_size=BATCH)
IN_BFLOAT16 = dataclasses.replace(ACCUMULATED, grad_accum_steps=2, dtype="bfloat16")
# In bfloat16 a product keeps 8 bits: two right answers whose weights part in the last bits
# of float32 (another AdamW's rounding) round some entries the other way, and after a few
# steps their runs part more than a run in float32 does from either. So the bfloat16 run is
# one step, from the same weights: its loss is rose's to BF16_LOSS_RTOL (a right answer's
# is rose's but for the sum's last bits; in float32 it is off by 1.9e-5, measured), its
# weights after it to BF16_PARAM_RTOL of each parameter's largest entry (a right answer's
# are off by 2e-6, in float32 5e-3), its norm to BF16_NORM_RTOL (both micro-batches'
# gradients summed in bfloat16 first, as one backward of their mean does: 2.5e-4).
BF16_LOSS_RTOL, BF16_PARAM_RTOL, BF16_NORM_RTOL = 1e-6, 1e-4, 1e-3


@dataclasses.dataclass(frozen=True)
class Run:
    """A training run the learner's pieces take beside rose's: its config, its steps, and
    the tolerances (loss, gradient norm, parameters) it is held to."""

    cfg: TrainConfig
    steps: int = STEPS
    tolerances: tuple[float, float, float] = (LOSS_RTOL, NORM_RTOL, PARAM_RTOL)


RUNS = {
    "one micro-batch": Run(ONE_MICRO_BATCH),
    "accumulated": Run(ACCUMULATED),
    "bfloat16": Run(IN_BFLOAT16, 1, (BF16_LOSS_RTOL, BF16_NORM_RTOL, BF16_PARAM_RTOL)),
}
AUTOCAST = (
    " (cfg.dtype bfloat16: rose's trainer runs each forward pass under "
    "torch.autocast(the parameters' device type, dtype=torch.bfloat16), and keeps the "
    "weights, their gradients and AdamW's state in float32)"
)


def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A token stream with something to learn (a few phrases repeated in a random order),
    cut into the same batches every time."""
    generator = np.random.default_rng(0)
    phrases = [generator.integers(0, MODEL.vocab_size, size) for size in (5, 7, 9, 11)]
    tokens = np.concatenate([phrases[i] for i in generator.integers(0, 4, 400)])
    stream = torch.Generator().manual_seed(1)
    while True:
        yield get_batch(tokens.astype(np.uint16), BATCH, MODEL.block_size, stream)


def fresh_model() -> GPT:
    torch.manual_seed(0)
    return GPT(MODEL)


@functools.cache
def roses_run(run: str) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """rose's trainer's pieces, the steps of RUNS[run]: each step's loss and gradient norm
    before clipping, and the final parameters."""
    cfg, model, stream = RUNS[run].cfg, fresh_model(), batches()
    optimizer = model.configure_optimizer(
        cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), "cpu"
    )
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    runtime = Runtime(torch.device("cpu"), DTYPES[cfg.dtype])
    losses, norms = [], []
    for step in range(RUNS[run].steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(step, cfg)
        loss, norm = train_step(model, optimizer, scaler, stream, cfg, runtime)
        losses.append(float(loss))
        norms.append(float(norm))
    return losses, norms, {name: p.detach().clone() for name, p in model.named_parameters()}


def learners_run(module: types.ModuleType, cfg: TrainConfig, steps: int = STEPS) -> tuple:
    """The learner's `steps` steps: the losses, the norms, the final parameters, and the
    parameters left with a gradient on return (train_step clears them after its step)."""
    model, stream = fresh_model(), batches()
    optimizer = module.make_optimizer(model, cfg)
    taken = [module.train_step(model, optimizer, stream, step, cfg) for step in range(steps)]
    left = [n for n, p in model.named_parameters() if p.grad is not None and bool(p.grad.any())]
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return [float(loss) for loss, _ in taken], [float(norm) for _, norm in taken], params, left


def training(run: str) -> Callable[[types.ModuleType], None]:
    """A part: RUNS[run], the learner's training beside rose's."""

    def run_part(module: types.ModuleType) -> None:
        cfg, steps = RUNS[run].cfg, RUNS[run].steps
        loss_rtol, norm_rtol, param_rtol = RUNS[run].tolerances
        why = AUTOCAST if cfg.dtype == "bfloat16" else ""
        losses, norms, params, left = made(
            f"{run}: the run", lambda: learners_run(module, cfg, steps)
        )
        if not judging():  # rose's run is the grader's to make, for its comparisons
            return
        want_losses, want_norms, want_params = roses_run(run)
        for step, (got, want) in enumerate(zip(losses, want_losses, strict=True)):
            if not abs(got - want) <= loss_rtol * max(1.0, abs(want)):
                raise Mismatch(
                    f"step {step}'s loss is {got:.7g} where rose's trainer has {want:.7g}{why}"
                )
        clip = f"clipped at {cfg.grad_clip}" if cfg.grad_clip else "not clipped"
        for step, (got, want) in enumerate(zip(norms, want_norms, strict=True)):
            if not abs(got - want) <= norm_rtol * want:
                raise Mismatch(
                    f"step {step} ({clip}) returns the gradient norm {got:.6g} where rose's "
                    f"trainer has {want:.6g}: train_step returns the norm of the mean loss's "
                    f"gradients before clipping, measured when nothing is clipped too{why}"
                )
        for name, want in want_params.items():
            tolerance = param_rtol * max(1.0, float(want.abs().max()))
            gap = first_gap(params[name], want, tolerance)
            if gap is not None:
                raise Mismatch(f"after {steps} step(s), {name}: {gap}{why}")
        if left:
            raise Mismatch(
                f"after train_step returns, {left[0]} still has a gradient: the step ends "
                "with the gradients cleared, after the optimizer's step"
            )

    return run_part


def _groups(module: types.ModuleType) -> None:
    model = fresh_model()
    _groups_of(module, model, "")
    # Only the parameters that require a gradient are optimised.
    model.transformer.wpe.weight.requires_grad_(False)
    model.transformer.ln_f.bias.requires_grad_(False)
    _groups_of(module, model, "with wpe.weight and ln_f.bias frozen (requires_grad False), ")


def _groups_of(module: types.ModuleType, model: GPT, case: str) -> None:
    names = {id(p): name for name, p in model.named_parameters()}
    want = {
        names[id(p)]: group["weight_decay"]
        for group in model.configure_optimizer(0.1, 1e-3, (0.9, 0.95), "cpu").param_groups
        for p in group["params"]
    }
    grouped = [
        (names.get(id(p), "a tensor that is no parameter of the model"), group.get("weight_decay"))
        for group in module.parameter_groups(model, 0.1)
        for p in group["params"]
    ]
    got: dict[str, float] = {}
    for name, decay in seen(f"{case}the groups", grouped):
        if name in got:
            raise Mismatch(f"{case}{name} is in two groups (or twice in one)")
        got[name] = decay
    for name in [*want, *got]:
        if name not in got:
            raise Mismatch(f"{case}{name} is in no group")
        if name in names.values() and name not in want:
            raise Mismatch(
                f"{case}{name} is in a group: it does not require a gradient, and only the "
                "parameters that require one are optimised (and decayed)"
            )
        if name not in want:
            raise Mismatch(f"{case}{name} is in a group but is no parameter of the model")
        if got[name] != want[name]:
            raise Mismatch(
                f"{case}{name} has weight_decay {got[name]} where rose gives it {want[name]}"
            )


SCHEDULES = (
    ONE_MICRO_BATCH,
    TrainConfig(learning_rate=3e-3, min_lr=3e-4, warmup_steps=0, max_steps=9),
    TrainConfig(learning_rate=1e-3, min_lr=0.0, warmup_steps=7, max_steps=30),
)


def _schedule(module: types.ModuleType) -> None:
    for i, cfg in enumerate(SCHEDULES):
        steps = range(cfg.max_steps + 3)
        rates = seen(f"schedule {i}'s rates", [module.learning_rate(step, cfg) for step in steps])
        for step, got in zip(steps, rates, strict=True):
            want = learning_rate_at(step, cfg)
            if not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-15):
                raise Mismatch(
                    f"with learning_rate {cfg.learning_rate}, min_lr {cfg.min_lr}, "
                    f"warmup_steps {cfg.warmup_steps}, decay over {cfg.lr_decay_steps or cfg.max_steps} "
                    f"steps: step {step}'s rate is {got:.6g} where {want:.6g} is right"
                )


# (parameter, step) of adam_run whose gradient is all zeros, not None.
ZERO_GRADIENT = (1, 2)


def adam_run(optimizer_cls: type, steps: int = 5) -> list[list[torch.Tensor]]:
    """`steps` updates of four parameters in three groups (decay 0.3 and 0, and one with
    betas and eps of its own) by `optimizer_cls`, with fresh gradients and a new learning
    rate each step; the third parameter gets no gradient at steps 1 and 3. Returns the
    parameters after each step."""
    generator = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((3, 4), (4,), (2,), (3,))]  # fmt: skip
    groups = [
        {"params": params[:1], "weight_decay": 0.3},
        {"params": params[1:3], "weight_decay": 0.0},
        # Its own betas and eps, which override the optimizer's (eps large enough to show).
        {"params": params[3:], "weight_decay": 0.1, "betas": (0.5, 0.7), "eps": 0.05},
    ]
    optimizer = optimizer_cls(groups, lr=0.1, betas=(0.9, 0.95))
    after = []
    for step in range(steps):
        for i, p in enumerate(params):
            skipped = i == 2 and step in (1, 3)
            p.grad = None if skipped else torch.randn(p.shape, generator=generator) * 10**-step
            if (i, step) == ZERO_GRADIENT:
                p.grad.zero_()  # a gradient all zeros is a gradient: the moments still move p
        for group in optimizer.param_groups:
            group["lr"] = 0.1 / (step + 1)
        optimizer.step()
        after.append([p.detach().clone() for p in params])
    return after


def _adamw(module: types.ModuleType) -> None:
    got = made("the parameters after each update", lambda: adam_run(module.AdamW))
    if not judging():  # torch's run is the grader's to make, for its comparisons
        return
    want = adam_run(torch.optim.AdamW)
    for step, (mine, right) in enumerate(zip(got, want, strict=True)):
        for i, (a, b) in enumerate(zip(mine, right, strict=True)):
            what = f"after update {step + 1}, parameter {i}"
            if i == 3:
                what += " (its group's own betas and eps override the optimizer's)"
            if (i, step) == ZERO_GRADIENT:
                what += " (its gradient all zeros: still a gradient, the moments move it)"
            gap = first_gap(a, b, 1e-6 * max(1.0, float(b.abs().max())))
            if gap is not None:
                raise Mismatch(f"{what}: {gap}")


def gradients(seed: int, scale: float) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((3, 4), (5,), (2, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator) * scale
    return [*params, torch.nn.Parameter(torch.zeros(2))]  # one without a gradient


def _clipping(module: types.ModuleType) -> None:
    for seed, scale, max_norm in ((0, 1.0, 0.5), (1, 0.1, 5.0), (2, 3.0, math.inf)):
        mine, want = gradients(seed, scale), gradients(seed, scale)
        # Given as a generator, as model.parameters() is: it can be iterated only once.
        norm = seen(
            f"the norm clipped at {max_norm}", module.clip_gradients((p for p in mine), max_norm)
        )
        want_norm = float(torch.nn.utils.clip_grad_norm_(want, max_norm))
        case = (
            f"gradients of norm {want_norm:.4g} clipped at {max_norm}, the parameters given "
            "as a generator (as model.parameters() is: it can be iterated only once)"
        )
        if not math.isclose(float(norm), want_norm, rel_tol=1e-6):
            raise Mismatch(f"{case}: it returns {float(norm):.6g} where {want_norm:.6g} is right")
        for i, (got, right) in enumerate(zip(mine[:3], want[:3], strict=True)):
            expect_close(f"{case}: gradient {i}", got.grad, right.grad, 1e-6)


def _probe(module: types.ModuleType) -> list[object]:
    decays = [
        (tuple(p.shape), group["weight_decay"])
        for group in module.parameter_groups(fresh_model(), 0.1)
        for p in group["params"]
    ]
    rates = [module.learning_rate(step, ONE_MICRO_BATCH) for step in range(STEPS + 1)]
    losses, norms, params, _ = learners_run(module, ACCUMULATED, steps=6)
    clipped = gradients(0, 1.0)
    module.clip_gradients((p for p in clipped), 0.5)  # a generator, as model.parameters()
    adam = adam_run(module.AdamW, steps=2)
    return [sorted(decays), rates, losses, params["transformer.ln_f.weight"], adam, norms,
            [p.grad for p in clipped[:3]]]  # fmt: skip


TRAINING_STEP = Build(
    name="training_step",
    chapters="00",
    task="AdamW, its groups, warmup + cosine, clipping, accumulation: one optimizer step",
    parts=(
        Part("AdamW", _adamw),
        Part("parameter groups", _groups),
        Part("learning rate", _schedule),
        Part("clipping", _clipping),
        Part(f"{STEPS} steps, one micro-batch each", training("one micro-batch")),
        Part(
            f"{STEPS} steps, {ACCUMULATED.grad_accum_steps} micro-batches each, clipped",
            training("accumulated"),
        ),
        Part(
            f"a step in bfloat16 (autocast), {IN_BFLOAT16.grad_accum_steps} micro-batches",
            training("bfloat16"),
        ),
    ),
    probe=_probe,
    known_wrong=KNOWN_WRONG,
    passed="equal to rose's trainer within the tolerance",
)
