"""What every exercise's check shares: the verdict, the oracle, the probes, one check.

A check swaps the learner's function in for the real piece (the same
`mock.patch.object` the chapters use to show a bug), runs the real code on the
chapters' random strong-oracle model, and compares every step with the reference: the
uncached greedy run of chapter 01 (for sampling, the reference sampler under the same
seed). It prints the first step that differs and what that means. Each exercise has a
diagnosis table of known wrong answers; when the learner's function behaves like one
of them on a few small inputs (probes), the explanation names the mistake.

Steps count as in the chapters: step 0 is the token the prefill chose, step 1 the
first decode step. A run that raises is reported at the step it was on.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch

from rosecourse.demo import (
    NEW_TOKENS,
    PROMPT,
    RANDOM_MODEL_CONFIG,
    first_divergence,
    wide_random_init,
)
from roseinfer.loops.generate import generate
from roseinfer.request.sampling import SamplingParams
from rosetrainer.model import GPT
from rosetrainer.tokenizer import Tokenizer

# A prefill in chunks of this many tokens: every chunk after the first has a past.
CHUNK = 3
# Ragged prompts for the batching exercise: rows with 0, some and many padding slots.
BATCH_TEXTS = ("JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?", PROMPT, "Good night")


@dataclass(frozen=True)
class CheckResult:
    """What a check found: passed, or the first step that differs and what it means."""

    exercise: str
    passed: bool
    step: int | None  # the first generation step that differs from the reference
    explanation: str
    # What a step is in this check (a generation step unless the check says otherwise).
    step_label: Callable[[int], str] | None = None

    def __str__(self) -> str:
        if self.passed:
            return f"{self.exercise}: passed. {self.explanation}"
        label = self.step_label or step_name
        where = "" if self.step is None else f" at step {self.step} ({label(self.step)})"
        return f"{self.exercise}: FAILED{where}: {self.explanation}"


@dataclass(frozen=True)
class KnownWrong:
    """A wrong answer people write, and what it does to the output."""

    name: str
    fn: Callable
    explanation: str


@dataclass(frozen=True)
class Divergence:
    step: int
    where: str  # which run, which row, what was raised


def step_name(step: int) -> str:
    return "the prefill's token" if step == 0 else f"decode step {step}"


# ---------------------------------------------------------------------------
# The oracle: the chapters' random model, its prompts and their reference runs
# ---------------------------------------------------------------------------


@functools.cache
def oracle_model() -> GPT:
    """The chapters' random strong-oracle model (rosecourse.demo), whatever is trained here,
    so a check's verdict and its step numbers are the same on every machine."""
    return wide_random_init(GPT(RANDOM_MODEL_CONFIG), 0)


@functools.cache
def encoded(text: str) -> tuple[int, ...]:
    return tuple(Tokenizer("gpt2").encode(text))


@functools.cache
def reference_tokens(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    """The uncached greedy run of `prompt` (with the default window policy past block_size)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return tuple(generate(oracle_model(), list(prompt), params, use_cache=False).token_ids)


def compare_run(
    label: str,
    expected: list[tuple[int, ...]],
    run: Callable[[Callable[[int, int], None]], list[list[int]]],
) -> Divergence | None:
    """Run `run(on_token)`; the first step where a row's tokens leave `expected`, if any.

    A learner's function may fail in any way at all; an exception is a divergence at
    the step the slowest row was on when it was raised.
    """
    made = [0] * len(expected)

    def on_token(row: int, _token: int) -> None:
        made[row] += 1

    try:
        rows = run(on_token)
    except Exception as error:  # anything a learner's code raises is a finding
        message = str(error).splitlines()[0] if str(error) else ""
        return Divergence(min(made), f"{label}: raised {type(error).__name__}: {message}")
    steps = [first_divergence(list(want), got) for want, got in zip(expected, rows, strict=True)]
    parted = [(step, row) for row, step in enumerate(steps) if step is not None]
    if not parted:
        return None
    step, row = min(parted)
    which = f", row {row}" if len(expected) > 1 else ""
    return Divergence(step, f"{label}{which}")


# ---------------------------------------------------------------------------
# Probes: a function's behaviour on small inputs, to compare it with known answers
# ---------------------------------------------------------------------------


def outcome(call: Callable[[], object]) -> object:
    """What a call returned (tensors as they are), or the name of what it raised."""
    try:
        return call()
    except Exception as error:  # what it raised is the outcome
        return f"raises {type(error).__name__}"


# Float outcomes computed in another order (a learner's attention, say) differ in the last
# bits; within these tolerances they are the same outcome.
PROBE_RTOL, PROBE_ATOL = 1e-4, 1e-5


def same(a: object, b: object) -> bool:
    """Equal outcomes: tensors of one shape and equal values (floats within PROBE_RTOL /
    PROBE_ATOL, NaN equal to NaN, inf to inf of its sign), recursively."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype.is_floating_point != b.dtype.is_floating_point:
            return False
        a, b = a.detach().cpu(), b.detach().cpu()
        if a.is_floating_point():
            return torch.allclose(
                a.float(), b.float(), rtol=PROBE_RTOL, atol=PROBE_ATOL, equal_nan=True
            )
        return bool((a == b).all())
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return a == b


def shown(value: object, limit: int = 160) -> str:
    """An outcome on one short line (tensors as nested lists)."""

    def brief(v: object) -> object:
        if not isinstance(v, torch.Tensor):
            return v
        if v.numel() <= 24:
            return v.tolist()
        start = ", ".join(f"{x:.3g}" for x in v.flatten()[:4].tolist())
        return f"<shape {tuple(v.shape)}: {start}, ...>"

    value = [brief(v) for v in value] if isinstance(value, (tuple, list)) else brief(value)
    text = str(value).replace("'", "")
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------
# One check, for every exercise
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Exercise:
    name: str
    reference: Callable
    probe: Callable[[Callable], list[object]]  # fn -> its outcomes on small inputs
    swapped_in: Callable[[Callable], contextlib.AbstractContextManager]
    runs: list[tuple[str, Callable[[], list[tuple[int, ...]]], Callable]]  # label, expected, run
    known_wrong: list[KnownWrong]
    fallback: str  # what a divergence means when the function is none of the known ones
    # What the runs' steps are: generation steps (step_name) unless the exercise says otherwise
    # (engine steps, cases of a measurement, ...).
    step_label: Callable[[int], str] = step_name

    def wrong_answer(self, name: str) -> Callable:
        """A known wrong answer by its name in the diagnosis table (the chapters show some)."""
        for wrong in self.known_wrong:
            if wrong.name == name:
                return wrong.fn
        raise KeyError(f"{self.name} has no known wrong answer called {name!r}")


def check(exercise: Exercise, fn: Callable) -> CheckResult:
    """Swap `fn` in, run every run against its reference, print and return the verdict."""
    seen = exercise.probe(fn)
    diagnosis = next(
        (w.explanation for w in exercise.known_wrong if same(exercise.probe(w.fn), seen)),
        None,
    )
    result = None
    for label, expected, run in exercise.runs:
        want = expected()  # the reference runs before anything is swapped in
        with exercise.swapped_in(fn):
            divergence = compare_run(label, want, run)
        if divergence is not None:
            why = diagnosis or exercise.fallback
            if "raised NotImplementedError" in divergence.where:
                why = "not written yet: replace the stub with your function"
            result = CheckResult(
                exercise.name,
                False,
                divergence.step,
                f"{why} [{divergence.where}]",
                exercise.step_label,
            )
            break
    if result is None:
        wanted = exercise.probe(exercise.reference)
        bad = [i for i, (a, b) in enumerate(zip(seen, wanted, strict=True)) if not same(a, b)]
        if bad:
            why = diagnosis or "it differs from the reference on a case these runs never reach"
            result = CheckResult(
                exercise.name,
                False,
                None,
                f"every step matches, but on small input #{bad[0]} it gives {shown(seen[bad[0]])} "
                f"where {shown(wanted[bad[0]])} is right: {why}",
            )
    if result is None:
        labels = "; ".join(label for label, _, _ in exercise.runs)
        result = CheckResult(
            exercise.name, True, None, f"every step equals the reference ({labels})"
        )
    print(result)
    return result


def greedy_runs(cache: Callable[[], object]) -> list[tuple[str, Callable, Callable]]:
    """The chapter's prompt greedy on `cache`: a one-shot prefill, then a prefill in chunks."""
    prompt = encoded(PROMPT)

    def expected() -> list[tuple[int, ...]]:
        return [reference_tokens(prompt, NEW_TOKENS)]

    def run(chunk: int | None) -> Callable:
        def go(on_token: Callable[[int, int], None]) -> list[list[int]]:
            params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
            result = generate(
                oracle_model(),
                list(prompt),
                params,
                cache=cache(),
                prefill_chunk=chunk,
                on_token=on_token,
            )
            return [result.token_ids]

        return go

    return [
        ("one-shot prefill, then decode", expected, run(None)),
        (f"prefill in chunks of {CHUNK}", expected, run(CHUNK)),
    ]


def patched(module: object, name: str) -> Callable[[Callable], contextlib.AbstractContextManager]:
    return lambda fn: mock.patch.object(module, name, fn)


_held: list[Callable] = []


def hold(fn: Callable) -> contextlib.AbstractContextManager:
    """For a piece the check calls itself (a whole loop, a formula): nothing to patch, the
    run calls `held_function()`."""
    _held[:] = [fn]
    return contextlib.nullcontext()


def held_function() -> Callable:
    return _held[0]
