"""The chapter exercises' known answers, kept as data beside each check.

Each exercise's folder holds, in `mistakes.py`, the answers its check is proven against
(tests/course/test_mutants.py runs them): plausible wrong answers (`mutant`), wrong answers
written blind by someone who had read neither these lists nor the known mistakes
(`blind`, issue 45), wrong answers by class that break a clause of the contract their
values do not show (`breaks`, issue 54: device, dtype, numerics, side effects), and
other answers that meet the contract (`alternative`). Importing a folder's mistakes
registers them here; `load()` imports every chapter's. The builds keep theirs in tests/.

The known mistakes (`known`) are the wrong answers a check names: when a learner's
function gives what one of them gives on every probe, the FAILED line says which mistake
it is, in that mistake's words. The check reads them from its folder (`known_mistakes`).
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


def known_mistakes(package: str) -> list[KnownWrong]:
    """The known mistakes of the exercise in `package` (rosecourse.exercises.chNN_name),
    from its mistakes.py, in the order its check tries them."""
    importlib.import_module(f"{package}.mistakes")
    return KNOWN[package.rpartition(".")[2][2:4]]


def load() -> None:
    """Import every chapter exercise's mistakes.py (registering its answers here)."""
    for path in sorted(Path(__file__).parent.glob("ch*/mistakes.py")):
        importlib.import_module(f"{__package__}.{path.parent.name}.mistakes")
