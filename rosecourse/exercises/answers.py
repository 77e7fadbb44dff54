"""The known answers of every exercise and build, kept as data beside each check.

Each chapter exercise's folder (rosecourse/exercises/chNN_name/) and each build's
(rosecourse/builds/name/) holds, in `mistakes.py`, the answers its check is proven against
(tests/course/test_mutants.py runs a chapter's, tests/course/test_builds.py a build's):
plausible wrong answers (`mutant`, a build's `build_mutant`), each failing its check without
being taken for a known mistake; wrong answers written blind (`blind`, `blind_build`);
wrong answers by class that break a clause of the contract their values do not show
(`breaks`, issue 54: device, dtype, numerics, side effects); and other answers that meet
the contract (`alternative`, `build_alternative`), each passing. Importing a folder's
mistakes registers them here; `load()` imports every folder's.

A chapter's answer is a function, its learner's whole answer. A build's is its reference
solution (reference.py, beside it) with one class, function or method replaced by the
code registered (`replaces`: a module-level name, or "Class.method"), as a learner writes
it into the build's file: it runs with that module's globals (grading.replaced). A build's
mistakes.py also holds `ALTERNATIVE_MODULE`, the source of its whole file written afresh
another way, which must pass too.

The wrong answers written blind (issue 45) are by someone who had read each exercise's
and each build's contract (the stubs, the chapters) but neither these lists nor the known
mistakes; for each they wrote the mistake a learner seemed likely to make, and said which
in one line (the `# WRONG:` comment above each). A blind answer is a mutant, or, where the
check names it as one of the known mistakes (its writer found that one too), registered
with `known=` that mistake, whose diagnosis it must get. A chapter's is its writer's own
function; a build's writer wrote the whole module, and here the mistake is put into the
build's reference, in the method it was in (`# the mistake` marks the line). Left out, of
the 126 written: three that compute what the reference computes on every input the engine
can give them, so that no check can fail them:
  12 no_final_sort     (`running` not sorted by arrival at the end of a step): running holds
                       the oldest requests in arrival order (preemption takes the newest,
                       and a preempted one waits ahead of every newer one), so the sort
                       never moves a sequence;
  17 zero_scale_nan    (no guard for a scale of 0): a constant group's codes come from
                       0 / 0, a NaN that the cast to uint8 makes 0, the right code;
  cached_loop chunk_remainder_first (the short prefill chunk first): the same calls, none
                       longer than prefill_chunk, in another order, an answer the suite
                       takes as right (loop_that_feeds_the_last_token_too, an alternative).
Five others passed the checks when written and were caught by checks made since: 04's
positions made on the CPU whatever `device` says (a GPU's model fails), 05's unstable sort
(ties not by token order), 13's block found by its key alone (a collision), the model's
positions made on the CPU, and the block manager's can_start counting the evictable blocks
it is served as room to grow into.

The known mistakes (`known`) are the wrong answers a check names: when a learner's
function gives what one of them gives on every probe, the FAILED line says which mistake
it is, in that mistake's words. A chapter's check reads them from its folder
(`known_mistakes`); a build's are its mistakes.py's `KNOWN_WRONG`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KnownWrong:
    """A wrong answer people write, and what it does to the output."""

    name: str
    fn: Callable
    explanation: str


MUTANTS: dict[str, list[Callable]] = {}  # chapter -> wrong answers that must fail
ALTERNATIVES: dict[str, list[Callable]] = {}  # chapter -> right answers that must pass
BLIND: dict[str, list[str]] = {}  # chapter or build -> the names of its blind mutants
# chapter or build -> (name, the function or the replacements, the known mistake it is)
BLIND_KNOWN: dict[str, list[tuple[str, object, str]]] = {}
CLAUSES: dict[str, str] = {}  # a `breaks` answer's name -> words its FAILED line must hold
KNOWN: dict[str, list[KnownWrong]] = {}  # chapter -> the mistakes its check names, in order
# build -> (name, the replacements: "Class.method" or a module-level name -> the code put there)
BUILD_MUTANTS: dict[str, list[tuple[str, dict[str, object]]]] = {}  # wrong: each must fail
BUILD_ALTERNATIVES: dict[str, list[tuple[str, dict[str, object]]]] = {}  # right: each must pass


def mutant(chapter: str) -> Callable[[Callable], Callable]:
    def register(fn: Callable) -> Callable:
        MUTANTS.setdefault(chapter, []).append(fn)
        return fn

    return register


def alternative(chapter: str) -> Callable[[Callable], Callable]:
    def register(fn: Callable) -> Callable:
        ALTERNATIVES.setdefault(chapter, []).append(fn)
        return fn

    return register


def blind(chapter: str, known: str | None = None) -> Callable[[Callable], Callable]:
    """Register a chapter's wrong answer written blind: a mutant, or the known mistake
    `known` written another way (whose diagnosis it must then get)."""

    def register(fn: Callable) -> Callable:
        if known is None:
            taken = {other.__name__ for other in MUTANTS.get(chapter, [])}
            assert fn.__name__ not in taken, f"{chapter}: {fn.__name__} is a mutant already"
            mutant(chapter)(fn)
            BLIND.setdefault(chapter, []).append(fn.__name__)
        else:
            BLIND_KNOWN.setdefault(chapter, []).append((fn.__name__, fn, known))
        return fn

    return register


def breaks(chapter: str, clause: str) -> Callable[[Callable], Callable]:
    """Register a wrong answer that breaks `clause` of the contract: a mutant whose FAILED
    line must name the clause."""

    def register(fn: Callable) -> Callable:
        CLAUSES[fn.__name__] = clause
        return mutant(chapter)(fn)

    return register


def known(chapter: str, explanation: str, name: str | None = None) -> Callable:
    """Register a known mistake of `chapter`: its check names it (`explanation`) when a
    learner's function gives what it gives on every probe. Its name (the function's, less
    a leading underscore) is what the chapters and the blind answers call it."""

    def register(fn: Callable) -> Callable:
        wrong = KnownWrong(name or fn.__name__.lstrip("_"), fn, explanation)
        KNOWN.setdefault(chapter, []).append(wrong)
        return fn

    return register


def build_mutant(build: str, replaces: str, name: str | None = None) -> Callable:
    """Register the decorated function or class as a wrong answer to `build`: its reference
    with `replaces` (a module-level name, or "Class.method") swapped for it. Registered
    again under the same name, it replaces that piece too (one mistake in two places)."""

    def register(obj: Callable) -> Callable:
        mutants = BUILD_MUTANTS.setdefault(build, [])
        key = name or obj.__name__
        same = [replacements for named, replacements in mutants if named == key]
        if same:
            assert replaces not in same[0], f"{build}: {key} replaces {replaces} twice"
            same[0][replaces] = obj
        else:
            mutants.append((key, {replaces: obj}))
        return obj

    return register


def build_alternative(build: str, replaces: str, name: str | None = None) -> Callable:
    """Register the decorated function or class as an answer to `build` that meets the
    contract: its reference with `replaces` swapped for it."""

    def register(obj: Callable) -> Callable:
        BUILD_ALTERNATIVES.setdefault(build, []).append((name or obj.__name__, {replaces: obj}))
        return obj

    return register


def blind_build(
    build: str, replaces: str, name: str | None = None, known: str | None = None
) -> Callable:
    """Register a build's wrong answer written blind, as `build_mutant` does (registered
    again under one name, it replaces that piece too), or as the known mistake `known`."""

    def register(obj: Callable) -> Callable:
        key = name or obj.__name__
        if known is None:
            names = BLIND.setdefault(build, [])
            taken = {named for named, _ in BUILD_MUTANTS.get(build, [])} - set(names)
            assert key not in taken, f"{build}: {key} is a mutant written with the lists read"
            build_mutant(build, replaces, key)(obj)
            names += [] if key in names else [key]
            return obj
        told = BLIND_KNOWN.setdefault(build, [])
        same = [replacements for named, replacements, _ in told if named == key]
        if same:
            same[0][replaces] = obj
        else:
            told.append((key, {replaces: obj}, known))
        return obj

    return register


def known_mistakes(package: str) -> list[KnownWrong]:
    """The known mistakes of the exercise in `package` (rosecourse.exercises.chNN_name),
    from its mistakes.py, in the order its check tries them."""
    importlib.import_module(f"{package}.mistakes")
    return KNOWN[package.rpartition(".")[2][2:4]]


def load() -> None:
    """Import every chapter exercise's and every build's mistakes.py (registering its
    answers here)."""
    course = Path(__file__).parents[1]  # rosecourse/
    for kind, folders in (("exercises", "ch*"), ("builds", "*")):
        for path in sorted(course.glob(f"{kind}/{folders}/mistakes.py")):
            importlib.import_module(f"{course.name}.{kind}.{path.parent.name}.mistakes")
