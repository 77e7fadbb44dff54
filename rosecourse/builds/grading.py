"""How a build is graded: each part run against rose, one line per part, mistakes named.

A build's learner file is a whole module (classes and functions). Its grader is a list of
`Part`s: each builds the learner's piece, runs it beside rose's own piece on tiny seeded
inputs and raises `Mismatch` with what differs, in values a learner can read. A part that
the learner's code breaks in any other way (it raises, returns the wrong kind of thing)
fails with what was raised; a stub's NotImplementedError is "not written yet".

A known wrong answer is the reference solution with a method or a function replaced by
code written with the mistake (`KnownWrong.replacements`, in the build's module: a reader
opens each as code), so the mistakes graded are exactly the ones a learner writes into
this file, and reformatting the solution breaks none of them. When a part fails, the
build's probe (a few small outcomes of the learner's module) is compared with each known
wrong answer's probe; the mistake is named only when they are the same.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

from rosecourse.exercises import same
from rosecourse.plain import plain
from rosetrainer.errors import one_line

T = TypeVar("T")


class Mismatch(Exception):
    """What a part found to differ from rose, in one line."""


class TapeEnded(Mismatch):
    """The grader asked the tape for a value it does not hold: the check's process stopped
    (or sent less) before the part did."""


@dataclass(frozen=True, eq=False)  # (hashed as itself: a Build's known answers are cached by it)
class KnownWrong:
    """A mistake learners make, as the reference with some of its pieces replaced (see
    `replaced`: "Class.method" or a module-level name -> the code written wrong), and
    what it does."""

    name: str
    replacements: dict[str, object]
    explanation: str


@dataclass(frozen=True)
class Part:
    """One piece of a build, graded on its own: `run(module)` raises Mismatch when the
    learner's module differs from rose there."""

    name: str
    run: Callable[[types.ModuleType], None]


@dataclass(frozen=True)
class PartResult:
    build: str
    part: str
    passed: bool
    explanation: str
    unwritten: bool = False  # a stub's part: no answer yet, not a wrong one

    def __str__(self) -> str:
        verdict = "passed: " if self.passed else "" if self.unwritten else "FAILED: "
        return f"{self.build}/{self.part}: {verdict}{self.explanation}"


@dataclass(frozen=True)
class Build:
    """A piece of rose the learner writes whole, and how it is graded."""

    name: str  # "model": the workspace file is build_model.py
    chapters: str  # where the learner meets it: "00", "02-06"
    task: str  # one line: what to write
    parts: tuple[Part, ...]
    probe: Callable[[types.ModuleType], list[object]]  # module -> outcomes on small inputs
    known_wrong: tuple[KnownWrong, ...]
    passed: str  # what a passing part's line adds (what it was compared with)

    @property
    def file_name(self) -> str:
        return f"build_{self.name}.py"

    def solution_module(self) -> types.ModuleType:
        return importlib.import_module(f"rosecourse.builds.{self.name}.reference")


def module_from_source(source: str, name: str) -> types.ModuleType:
    """Execute `source` as a module called `name` (registered while it runs, as dataclasses
    and pickling expect)."""
    module = types.ModuleType(name)
    module.__file__ = f"<{name}>"
    sys.modules[name] = module
    try:
        exec(compile(source, module.__file__, "exec"), module.__dict__)  # noqa: S102
    finally:
        del sys.modules[name]
    return module


@functools.cache
def solution_source(build: Build) -> str:
    """The reference solution's source, read once (the grader reads it before any learner
    code runs, which could rewrite the file)."""
    return inspect.getsource(build.solution_module())


def replaced(
    build: Build, replacements: dict[str, object], name: str = "replaced"
) -> types.ModuleType:
    """The reference solution with some of its classes, functions or methods replaced: a
    wrong answer (or another right one) written as code. `replacements` maps a module-level
    name, or "Class.method" for a method of one of its classes, to the code put there. A
    replacing function (a method too) is rebound to the new module's globals, so it calls
    the module's own names (what a check swaps in), as if written in the learner's file;
    the helpers it calls that the module lacks come along, rebound the same way."""
    module = module_from_source(solution_source(build), f"rose_build_{build.name}_{name}")
    for attribute, value in replacements.items():
        owner_name, _, member = attribute.rpartition(".")
        owner = getattr(module, owner_name) if owner_name else module
        assert hasattr(owner, member), f"{build.file_name} has no {attribute}"
        setattr(owner, member, _rebound(value, module.__dict__))
    return module


def _rebound(fn: object, namespace: dict[str, object]) -> object:
    """`fn`, a function, reading `namespace` as its globals; whatever else, as it is. A
    decorated function (`@torch.no_grad()`: a wrapper holding it, functools.wraps) keeps
    its decorator, and the function inside is rebound too."""
    if not isinstance(fn, types.FunctionType):
        return fn
    closure = fn.__closure__
    wrapped = getattr(fn, "__wrapped__", None)
    if closure and isinstance(wrapped, types.FunctionType):
        inner = _rebound(wrapped, namespace)
        closure = tuple(
            types.CellType(inner) if cell.cell_contents is wrapped else cell for cell in closure
        )
    for needed in _global_names(fn.__code__):
        if needed not in namespace and needed in fn.__globals__:
            namespace[needed] = None  # taken: a helper that calls itself stops here
            namespace[needed] = _rebound(fn.__globals__[needed], namespace)
    function = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, closure)
    function.__kwdefaults__ = fn.__kwdefaults__
    if closure is not fn.__closure__:
        function.__wrapped__ = inner
    return function


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for constant in code.co_consts:  # nested functions and lambdas
        if isinstance(constant, types.CodeType):
            names |= _global_names(constant)
    return names


@functools.cache
def known_probes(build: Build) -> tuple[tuple[KnownWrong, list[object] | None], ...]:
    """Each known wrong answer of `build` with its probe's outcomes (computed once)."""
    return tuple(
        (wrong, probed(build, replaced(build, wrong.replacements, wrong.name)))
        for wrong in build.known_wrong
    )


def probed(build: Build, module: types.ModuleType) -> list[object] | None:
    """The probe's outcomes as plain data, or None when the module cannot even be probed."""
    torch.manual_seed(0)
    try:
        return plain(build.probe(module))
    except Exception:  # a module that breaks the probe matches no known mistake
        return None


def diagnosis(build: Build, outcomes_seen: list[object] | None) -> str | None:
    """The explanation of the known mistake whose probe's outcomes are `outcomes_seen`
    (the learner's module's, as plain data), if any."""
    known = known_probes(build) if outcomes_seen is not None else ()
    matches = (w.explanation for w, o in known if o is not None and same(o, outcomes_seen))
    return next(matches, None)


# ---------------------------------------------------------------------------
# Where the verdict is decided: what the learner's code made, on a tape
# ---------------------------------------------------------------------------
# A part runs twice. In the check's process it runs with the learner's module, and every
# value the learner's code made that the part compares goes through `seen`, which notes
# it on the part's tape as plain data. In the grader, which never imports the learner's
# module, the same part runs again with the reference module, and `seen` hands back the
# tape's values in place of the reference's: every comparison, with references computed
# here by rose's own code, is made where the learner's code never ran. What the check's
# process says is believed only when it is a failure the tape does not show (what stopped
# it there), so a part may skip in that process what only its comparisons need.

_noting: list[tuple[str, object]] | None = None  # the running part's tape, being written
_replaying: Iterator[tuple[str, object]] | None = None  # or being read back


def seen(what: str, value: T) -> T:
    """`value`, made by the learner's code, as the part compares it: noted on the tape in
    the check's process; in the grader, the tape's value in its place."""
    if _replaying is not None:
        noted, value = next(_replaying, (None, None))
        if noted is None:
            raise TapeEnded(f"the check's process sent no value for {what}")
        if noted != what:
            raise Mismatch(f"the check's process sent {noted!r} where the check asks {what!r}")
    elif _noting is not None:
        _noting.append((what, plain(value)))
    return value


def judging() -> bool:
    """Whether this process's comparisons decide the part: not in the check's process,
    whose values the grader judges again from the tape (a part may skip there the
    references only its comparisons read: rose's runs)."""
    return _noting is None


def made(what: str, make: Callable[[], T]) -> T:
    """`seen(what, make())`, where in the grader `make` is never called: the tape holds
    its value (for a learner's value the reference is slow to make again)."""
    return seen(what, None if _replaying is not None else make())


def run_part(
    part: Part, module: types.ModuleType, noting: list | None, replaying: Iterator | None
) -> tuple[str, str] | None:
    """Run `part` on `module`, its tape being written (`noting`) or read back
    (`replaying`): why it failed ("unwritten" | "mismatch" | "raised", explanation), or
    None."""
    global _noting, _replaying
    torch.manual_seed(0)
    _noting, _replaying = noting, replaying
    try:
        part.run(module)
    except NotImplementedError as error:
        return "unwritten", f"not written yet: replace the stub's body ({error})"
    except TapeEnded as error:
        return "ended", str(error)
    except Mismatch as error:
        return "mismatch", str(error)
    except Exception as error:  # whatever the learner's code raises is a finding
        return "raised", f"raised {one_line(error)}"
    finally:
        _noting = _replaying = None
    return None


def observe(build: Build, part: Part, module: types.ModuleType) -> tuple[list, tuple | None]:
    """Run `part` on the learner's `module` (in the check's process): its tape, and why it
    failed there (None: it did not)."""
    tape: list[tuple[str, object]] = []
    return tape, run_part(part, module, tape, None)


def verdict(
    build: Build, part: Part, tape: list, failure: tuple | None, named: Callable[[], str]
) -> PartResult:
    """The part's result, decided here (in the grader) from what the check's process sent:
    the part run again on the reference with the tape's values; where the tape ends first,
    the failure that stopped the check's process there (or, without one, a failure)."""
    replayed = run_part(part, build.solution_module(), None, iter(tape))
    if failure is None or (replayed is not None and replayed[0] != "ended"):
        failure = replayed
    if failure is None and not tape:
        failure = "mismatch", "the check's process sent nothing to compare"
    if failure is None:
        return PartResult(build.name, part.name, True, build.passed)
    kind, why = failure
    kind = "mismatch" if kind == "ended" else kind
    said = named() if kind == "mismatch" else ""
    why += f": {said}" if said else ""
    return PartResult(build.name, part.name, False, why, unwritten=kind == "unwritten")


def check_build(build: Build, module: types.ModuleType) -> list[PartResult]:
    """Grade every part of `module` in this process (both halves: the tests use it); print
    and return one result per part."""
    named = functools.cache(lambda: diagnosis(build, probed(build, module)) or "")
    results = [verdict(build, part, *observe(build, part, module), named) for part in build.parts]
    print("\n".join(map(str, results)))
    return results


# ---------------------------------------------------------------------------
# Comparisons the parts share: values a learner can read
# ---------------------------------------------------------------------------


def first_gap(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> str | None:
    """Where `got` leaves `want` by more than `tolerance`, in words; None when it does not."""
    if not isinstance(got, torch.Tensor):
        return f"a {type(got).__name__} where a tensor of shape {tuple(want.shape)} is right"
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} where {tuple(want.shape)} is right"
    if got.dtype != want.dtype:  # a float64 answer is no float32 one, however close
        return f"dtype {got.dtype} where {want.dtype} is right (the contract's dtype, as rose's)"
    gap = (got.detach().float() - want.detach().float()).abs()
    gap = torch.where(gap.isnan(), torch.inf, gap)
    if float(gap.max()) <= tolerance:
        return None
    index = tuple(int(i) for i in torch.nonzero(gap > tolerance)[0])
    return (
        f"at index {list(index)} it is {float(got[index]):.6g} where {float(want[index]):.6g} "
        f"is right ({int((gap > tolerance).sum())} of {gap.numel()} entries off by more than "
        f"{tolerance:.2g})"
    )


def expect_close(what: str, got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    gap = first_gap(seen(what, got), want, tolerance)
    if gap is not None:
        raise Mismatch(f"{what}: {gap}")
