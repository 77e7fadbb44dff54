"""What every exercise's check shares: the verdict, the oracle, the probes, one check.

A check swaps the learner's function in for the real piece (the same
`mock.patch.object` the chapters use to show a bug), runs the real code on the
chapters' random strong-oracle model, and compares every step with the reference: the
uncached greedy run of chapter 01 (for sampling, the reference sampler under the same
seed). It prints the first step that differs and what that means. Each exercise's
folder lists its known mistakes (mistakes.py, `answers.known`); when the learner's
function behaves like one of them on a few small inputs (probes), the explanation
names the mistake.

Steps count as in the chapters: step 0 is the token the prefill chose, step 1 the
first decode step. A run that raises is reported at the step it was on.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
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
from rosecourse.exercises.answers import KnownWrong
from rosecourse.exercises.contract import PROPERTIES, breach, overflow, watched_outcomes
from roseinfer.loops.generate import generate, generate_batch
from roseinfer.request.sampling import SamplingParams
from rosetrainer.errors import one_line
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
        return Divergence(min(made), f"{label}: raised {one_line(error)}")
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

# What a function gives on each of a few small inputs, by a label that says which input
# (the call as a learner would write it): a dict, or Outcomes computed as they are read.
Probe = Mapping[str, object]


@dataclass(frozen=True)
class Raised:
    """The outcome of a call that raised: the exception's type (its message may vary)."""

    error: str

    def __str__(self) -> str:
        return f"raises {self.error}"


def outcome(call: Callable[[], object]) -> object:
    """What a call returned (tensors as they are), or what it raised."""
    try:
        return call()
    except Exception as error:  # what it raised is the outcome
        return Raised(type(error).__name__)


class Outcomes(Mapping[str, object]):
    """A probe whose outcomes are computed when first read (each once), in its inputs' order.

    Comparing it with another probe (`difference`) stops at the first input where the two
    differ, so a costly probe of a known wrong answer (chapter 20's: masks over GPT-2's
    50,257 tokens, in Python) runs only as far as it takes to tell that answer from the
    learner's; the verdict is the one the whole probe would give.
    """

    def __init__(self, calls: dict[str, Callable[[], object]]) -> None:
        self.calls = calls
        self.made: dict[str, object] = {}

    def __getitem__(self, label: str) -> object:
        if label not in self.made:
            self.made[label] = outcome(self.calls[label])
        return self.made[label]

    def __iter__(self) -> Iterator[str]:
        return iter(self.calls)

    def __len__(self) -> int:
        return len(self.calls)


def probe_calls(fn: Callable, name: str, cases: list[tuple]) -> Probe:
    """`fn(*case)` for each case (plain numbers and strings), labelled as the call."""
    return {
        f"{name}({', '.join(map(repr, case))})": outcome(lambda case=case: fn(*case))
        for case in cases
    }


# Float outcomes computed in another order (a learner's attention, say) differ in the last
# bits; within these tolerances they are the same outcome.
PROBE_RTOL, PROBE_ATOL = 1e-4, 1e-5


def _close(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal (floats within PROBE_RTOL / PROBE_ATOL, NaN to NaN, inf to inf)."""
    if a.is_floating_point():
        return torch.isclose(a.float(), b.float(), rtol=PROBE_RTOL, atol=PROBE_ATOL, equal_nan=True)
    return a == b


def same(a: object, b: object) -> bool:
    """Equal outcomes: tensors of one shape and equal values (see _close), recursively."""
    return difference(a, b) is None


def _values(t: torch.Tensor) -> str:
    return ", ".join(f"{x:.4g}" if isinstance(x, float) else str(x) for x in t.tolist())


def _brief(value: object, limit: int = 80) -> str:
    """An outcome on one short line: a tensor as its values (the first few), else as str."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().flatten()
        text = f"[{_values(flat[:12])}{', ...' if flat.numel() > 12 else ''}]"
    elif isinstance(value, frozenset):  # labels a probe wrote to be read as they are
        text = "{" + ", ".join(sorted(value)) + "}"
    elif isinstance(value, (tuple, list)):  # each item as its values, on the one line
        inner = ", ".join(_brief(item, limit) for item in value)
        text = f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    else:
        text = str(value).replace("'", "")
    return _clip(text, limit)


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def difference(got: object, want: object) -> str | None:
    """How `got` differs from `want`, in words and values a learner can read (the first
    elements that differ); None when they are the same outcome."""
    if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor):
        got, want = got.detach().cpu(), want.detach().cpu()
        if got.shape != want.shape:
            return (
                f"it gives a tensor of shape {tuple(got.shape)} where {tuple(want.shape)} is right"
            )
        if got.dtype != want.dtype:
            return f"it gives {got.dtype} where {want.dtype} is right"
        wrong = ~_close(got, want)
        if not wrong.any():
            return None
        index = tuple(int(i) for i in wrong.nonzero()[0])
        row, at = index[:-1], index[-1] if index else 0
        got_run = got[row][at : at + 6] if got.dim() else got
        want_run = want[row][at : at + 6] if want.dim() else want
        more = ", ..." if got.dim() and at + 6 < got.size(-1) else ""
        where = f"from index {list(index)} on " if index else ""
        return (
            f"{where}it gives {_values(got_run.flatten())}{more} where "
            f"{_values(want_run.flatten())}{more} is right "
            f"({int(wrong.sum())} of {got.numel()} elements differ)"
        )
    if isinstance(got, frozenset) and isinstance(want, frozenset):
        extra, missing = sorted(got - want), sorted(want - got)
        if not extra and not missing:
            return None
        # (the members are labels a probe wrote to be read as they are: quotes kept)
        told = [f"{len(extra)} too many ({_clip(', '.join(extra))})"] if extra else []
        told += [f"{len(missing)} missing ({_clip(', '.join(missing))})"] if missing else []
        return f"it gives {' and '.join(told)}"
    if isinstance(got, Mapping) and isinstance(want, Mapping) and set(got) == set(want):
        for key in want:  # in order, each read only until one differs (see Outcomes)
            found = difference(got[key], want[key])
            if found is not None:
                return f"{key}: {found}"
        return None
    if isinstance(got, (tuple, list)) and isinstance(want, (tuple, list)):
        if len(got) != len(want):
            return (
                f"it gives {len(got)} items ({_brief(got)}) where {len(want)} are right "
                f"({_brief(want)})"
            )
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            found = difference(g, w)
            if found is not None:
                return found if len(want) == 1 else f"item {i}: {found}"
        return None
    if isinstance(got, Raised) and got != want:
        return f"it {got} where {_brief(want)} is right"
    if isinstance(got, torch.Tensor) or isinstance(want, torch.Tensor) or got != want:
        return f"it gives {_brief(got)} where {_brief(want)} is right"
    return None


# ---------------------------------------------------------------------------
# One check, for every exercise
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Exercise:
    name: str
    reference: Callable
    probe: Callable[[Callable], Probe]  # fn -> its outcomes on small inputs
    swapped_in: Callable[[Callable], contextlib.AbstractContextManager]
    runs: list[tuple[str, Callable[[], list[tuple[int, ...]]], Callable]]  # label, expected, run
    known_wrong: list[KnownWrong]
    fallback: str  # what a divergence means when the function is none of the known ones
    # What the runs' steps are: generation steps (step_name) unless the exercise says otherwise
    # (engine steps, cases of a measurement, ...).
    step_label: Callable[[int], str] = step_name
    # The arguments the function writes into by contract, and the dtypes it may return
    # besides the reference's (rosecourse.exercises.contract).
    writes: frozenset[str] = frozenset()
    dtypes: frozenset[str] = frozenset()

    def wrong_answer(self, name: str) -> Callable:
        """A known mistake by its name (the chapters show some)."""
        for wrong in self.known_wrong:
            if wrong.name == name:
                return wrong.fn
        raise KeyError(f"{self.name} has no known wrong answer called {name!r}")

    def probed(self, fn: Callable) -> Probe:
        """The probe of the reference or a known wrong answer, made once (they never change)."""
        key = (self.name, fn)
        if key not in _PROBED:
            _PROBED[key] = self.probe(fn)
        return _PROBED[key]

    def observe(self, fn: Callable) -> dict[str, object]:
        """The probe of `fn`, every call of it watched (contract.watched_outcomes)."""
        return watched_outcomes(self.probe, fn, self.writes)

    def observed_reference(self) -> dict[str, object]:
        if self.name not in _OBSERVED:
            watched = watched_outcomes(self.probe, self.reference, self.writes)
            _OBSERVED[self.name] = watched
        return _OBSERVED[self.name]


_PROBED: dict[tuple[str, Callable], Probe] = {}
_OBSERVED: dict[str, dict[str, object]] = {}


def outcomes_only(observed: Mapping[str, object]) -> dict[str, object]:
    return {label: value for label, value in observed.items() if label != PROPERTIES}


def first_difference(seen: Probe, wanted: Probe) -> str | None:
    """The first small input on which `seen` differs from `wanted`, and how."""
    for label, want in wanted.items():
        found = difference(seen[label], want)
        if found is not None:
            return f"{label}: {found}"
    return None


def check(exercise: Exercise, fn: Callable, show: bool = True) -> CheckResult:
    """Swap `fn` in, run every run against its reference, print (`show`) and return the
    verdict. A check that compares no run passes nothing.

    A known wrong answer's diagnosis is given when `fn` gives what that answer gives on
    every small input; otherwise the exercise's fallback, with the first small input on
    which `fn` and the reference differ, if any.
    """
    observed = exercise.observe(fn)
    seen = outcomes_only(observed)
    wanted = outcomes_only(exercise.observed_reference())
    evidence = first_difference(seen, wanted)
    breached = breach(observed, exercise.observed_reference(), exercise.dtypes)
    breached = breached or overflow(seen, wanted)

    @functools.cache
    def diagnosis() -> str | None:
        # Only a failing answer is named, so the known wrong answers (whose probes may cost
        # more than the whole check of a right one) are probed only for it.
        return next(
            (w.explanation for w in exercise.known_wrong if same(seen, exercise.probed(w.fn))),
            None,
        )

    result = None
    compared = False  # whether any run had a step to compare
    for label, expected, run in exercise.runs:
        want = expected()  # the reference runs before anything is swapped in
        compared = compared or any(len(row) for row in want)
        with exercise.swapped_in(fn):
            divergence = compare_run(label, want, run)
        if divergence is not None:
            if "raised NotImplementedError" in divergence.where:
                why = "not written yet: replace the stub with your function"
            else:
                why = (
                    diagnosis()
                    or breached
                    or exercise.fallback + (f" (on {evidence})" if evidence else "")
                )
            result = CheckResult(
                exercise.name,
                False,
                divergence.step,
                f"{why} [{divergence.where}]",
                exercise.step_label,
            )
            break
    if result is None and (evidence is not None or breached is not None):
        # The fallback says which clause of the contract the answer breaks.
        # The known mistake, or the clause broken, or the fallback on the first probe that
        # differs (the clause and the probe: the fallback says what the contract asks).
        where = f"on {evidence}: " if evidence is not None else ""
        why = diagnosis()
        if why is None and breached is not None:
            where, why = "", breached
        why = why or f"{exercise.fallback} (a case these runs never reach)"
        result = CheckResult(exercise.name, False, None, f"every step matches, but {where}{why}")
    if result is None and not compared:
        why = "the check compared no run: is the course's own code changed?"
        result = CheckResult(exercise.name, False, None, why)
    if result is None:
        labels = "; ".join(label for label, _, _ in exercise.runs)
        result = CheckResult(
            exercise.name, True, None, f"every step equals the reference ({labels})"
        )
    if show:
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


def batch_runs(
    cache: Callable[[int], object], chunked: bool = True
) -> list[tuple[str, Callable, Callable]]:
    """BATCH_TEXTS as one left-padded batch on `cache(rows)`, each row against its solo
    uncached run: a one-shot prefill, then (if `chunked`) a prefill in chunks."""
    prompts = [encoded(text) for text in BATCH_TEXTS]
    pads = [max(map(len, prompts)) - len(p) for p in prompts]

    def expected() -> list[tuple[int, ...]]:
        return [reference_tokens(p, NEW_TOKENS) for p in prompts]

    def run(chunk: int | None) -> Callable:
        def go(on_token: Callable[[int, int], None]) -> list[list[int]]:
            params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
            runs = generate_batch(
                oracle_model(),
                [list(p) for p in prompts],
                params,
                cache=cache(len(prompts)),
                prefill_chunk=chunk,
                on_token=on_token,
            )
            return [run.token_ids for run in runs]

        return go

    label = f"a left-padded batch of {len(prompts)} rows, padding {pads}"
    runs = [(label, expected, run(None))]
    if chunked:
        runs.append((f"{label}, prefill in chunks of {CHUNK}", expected, run(CHUNK)))
    return runs


def patched(module: object, name: str) -> Callable[[Callable], contextlib.AbstractContextManager]:
    return lambda fn: mock.patch.object(module, name, fn)


_held: list[Callable] = []


@contextlib.contextmanager
def hold(fn: Callable) -> Iterator[None]:
    """For a piece the check calls itself (a whole loop, a formula) or passes to rose as
    an argument (a block manager's method): nothing is patched, the run calls
    `held_function()`, `fn` while this holds it."""
    _held.append(fn)
    try:
        yield
    finally:
        _held.pop()


def held_function(default: Callable | None = None) -> Callable:
    """The function `hold` holds now; `default` when none is held."""
    if not _held and default is None:
        raise LookupError("no function is held (see hold)")
    return _held[-1] if _held else default
