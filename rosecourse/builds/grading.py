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
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rosecourse.exercises import same
from rosetrainer.errors import one_line


class Mismatch(Exception):
    """What a part found to differ from rose, in one line."""


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
        return importlib.import_module(f"rosecourse.solutions.build_{self.name}")


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


def replaced(
    build: Build, replacements: dict[str, object], name: str = "replaced"
) -> types.ModuleType:
    """The reference solution with some of its classes, functions or methods replaced: a
    wrong answer (or another right one) written as code. `replacements` maps a module-level
    name, or "Class.method" for a method of one of its classes, to the code put there. A
    replacing function (a method too) is rebound to the new module's globals, so it calls
    the module's own names (what a check swaps in), as if written in the learner's file;
    the helpers it calls that the module lacks come along, rebound the same way."""
    module = module_from_source(
        inspect.getsource(build.solution_module()), f"rose_build_{build.name}_{name}"
    )
    for attribute, value in replacements.items():
        owner_name, _, member = attribute.rpartition(".")
        owner = getattr(module, owner_name) if owner_name else module
        assert hasattr(owner, member), f"{build.file_name} has no {attribute}"
        setattr(owner, member, _rebound(value, module.__dict__))
    return module


def _rebound(value: object, namespace: dict[str, object]) -> object:
    """`value`, a function, reading `namespace` as its globals; whatever else, as it is. A
    decorated function (`@torch.no_grad()`: a wrapper holding it, functools.wraps) keeps
    its decorator, and the function inside is rebound too."""
    if not isinstance(value, types.FunctionType):
        return value
    closure = value.__closure__
    wrapped = getattr(value, "__wrapped__", None)
    if closure and isinstance(wrapped, types.FunctionType):
        inner = _rebound(wrapped, namespace)
        closure = tuple(
            types.CellType(inner) if _holds(cell, wrapped) else cell for cell in closure
        )
    for needed in _global_names(value.__code__):
        if needed not in namespace and needed in value.__globals__:
            namespace[needed] = None  # taken: a helper that calls itself stops here
            namespace[needed] = _rebound(value.__globals__[needed], namespace)
    function = types.FunctionType(
        value.__code__, namespace, value.__name__, value.__defaults__, closure
    )
    function.__kwdefaults__ = value.__kwdefaults__
    if closure is not value.__closure__:
        function.__wrapped__ = inner
    return function


def _holds(cell: types.CellType, value: object) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


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
    """The probe's outcomes, or None when the module cannot even be probed."""
    torch.manual_seed(0)
    try:
        return build.probe(module)
    except Exception:  # a module that breaks the probe matches no known mistake
        return None


def diagnosis(build: Build, module: types.ModuleType) -> str | None:
    """The explanation of the known mistake whose probe `module` matches, if any."""
    seen = probed(build, module)
    if seen is None:
        return None
    for wrong, outcomes in known_probes(build):
        if outcomes is not None and same(outcomes, seen):
            return wrong.explanation
    return None


def check_build(build: Build, module: types.ModuleType) -> list[PartResult]:
    """Grade every part of `module`; print and return one result per part."""
    results, named = [], None
    for part in build.parts:
        torch.manual_seed(0)
        try:
            part.run(module)
        except NotImplementedError as error:
            why = f"not written yet: replace the stub's body ({error})"
            result = PartResult(build.name, part.name, False, why, unwritten=True)
        except Mismatch as error:
            if named is None:
                named = diagnosis(build, module) or ""
            why = f"{error}" + (f": {named}" if named else "")
            result = PartResult(build.name, part.name, False, why)
        except Exception as error:  # whatever the learner's code raises is a finding
            result = PartResult(build.name, part.name, False, f"raised {one_line(error)}")
        else:
            result = PartResult(build.name, part.name, True, build.passed)
        print(result)
        results.append(result)
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
    gap = first_gap(got, want, tolerance)
    if gap is not None:
        raise Mismatch(f"{what}: {gap}")
