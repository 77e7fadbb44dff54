"""Every exercise's check is proven against wrong answers (each folder's mistakes.py).

For each chapter: at least five plausible wrong answers beyond its known-wrong list, each
failing its check without being taken for a known mistake; the reference solution and
the alternatives that meet the contract passing; and each known wrong answer told apart
from the reference and from the other known ones by the probes alone, so its diagnosis
is given only to that mistake.

Among the mutants are wrong answers written blind (`blind`, `blind_build`), by someone who
had not read these lists nor the known wrong answers: those the check names as a known
mistake must get its diagnosis, and every chapter and build has at least as many of the
others as issue 45 listed wrong answers for it.
"""

from __future__ import annotations

import importlib

import pytest

from rosecourse.course import LESSONS, Lesson
from rosecourse.exercises.answers import ALTERNATIVES, BLIND, BLIND_KNOWN, CLAUSES, MUTANTS, load
from rosecourse.exercises.common import Exercise, same

pytestmark = pytest.mark.usefixtures("one_torch_thread")

load()  # every exercise's and build's mistakes.py, its answers registered

BY_CHAPTER = {chosen.chapter: chosen for chosen in LESSONS}


def exercise_of(chosen: Lesson) -> Exercise:
    return importlib.import_module(f"rosecourse.exercises.{chosen.file_name[:-3]}").EXERCISE


def test_every_exercise_has_five_mutants_beyond_its_known_wrong_answers() -> None:
    for chosen in LESSONS:
        mutants = MUTANTS.get(chosen.chapter, [])
        known = {wrong.name for wrong in exercise_of(chosen).known_wrong}
        assert len(mutants) >= 5, f"chapter {chosen.chapter}: {len(mutants)} mutants"
        assert not known & {fn.__name__ for fn in mutants}, chosen.chapter


CASES = [(chapter, fn) for chapter, fns in MUTANTS.items() for fn in fns]


@pytest.mark.slow
@pytest.mark.parametrize(("chapter", "fn"), CASES, ids=[f"{c}-{f.__name__}" for c, f in CASES])
def test_mutant_fails_and_is_not_taken_for_a_known_mistake(chapter, fn) -> None:
    chosen = BY_CHAPTER[chapter]
    result = chosen.check(fn)
    assert not result.passed, str(result)
    for wrong in exercise_of(chosen).known_wrong:
        assert wrong.explanation not in result.explanation, str(result)
    assert "\n" not in str(result)
    assert "<shape" not in str(result)  # values a learner can read, not a tensor's header


RIGHT = [(c.chapter, c.solution()) for c in LESSONS] + [
    (chapter, fn) for chapter, fns in ALTERNATIVES.items() for fn in fns
]


@pytest.mark.parametrize(
    ("chapter", "fn"),
    RIGHT,
    ids=[f"{c}-{f.__module__.split('.')[-1]}.{f.__name__}" for c, f in RIGHT],
)
@pytest.mark.slow
def test_reference_and_every_answer_that_meets_the_contract_pass(chapter, fn) -> None:
    result = BY_CHAPTER[chapter].check(fn)
    assert result.passed, str(result)


# Known wrong answers that only a run can tell from the reference: a length read as a
# Python number is right in eager mode, and wrong only in the exported graph.
ONLY_A_RUN_TELLS = {"baked_length"}


@pytest.mark.parametrize("chosen", LESSONS, ids=[c.chapter for c in LESSONS])
def test_probes_tell_each_known_wrong_answer_apart(chosen) -> None:
    exercise = exercise_of(chosen)
    probes = {"reference": exercise.probed(exercise.reference)}
    for wrong in exercise.known_wrong:
        if wrong.name in ONLY_A_RUN_TELLS:
            continue
        probe = exercise.probed(wrong.fn)
        alike = [name for name, other in probes.items() if same(probe, other)]
        assert not alike, f"{wrong.name}'s probe is the same as {alike}'s"
        probes[wrong.name] = probe


TOLD = [
    (chapter, fn, known)
    for chapter, told in BLIND_KNOWN.items()
    if chapter in BY_CHAPTER
    for _, fn, known in told
]


@pytest.mark.parametrize(
    ("chapter", "fn", "known"), TOLD, ids=[f"{c}-{f.__name__}" for c, f, _ in TOLD]
)
@pytest.mark.slow
def test_blind_answer_of_a_known_mistake_gets_its_diagnosis(chapter, fn, known) -> None:
    """A known mistake written blind, in its writer's own code, is told it is that one."""
    chosen = BY_CHAPTER[chapter]
    result = chosen.check(fn)
    (wrong,) = [wrong for wrong in exercise_of(chosen).known_wrong if wrong.name == known]
    assert not result.passed and wrong.explanation in result.explanation, str(result)


# Issue 45's own wrong answers, per build and chapter: at least as many more, written blind.
ISSUE_45 = {"cached_loop": 6, "block_manager": 5, "verify": 3, "training_step": 2, "model": 1,
            "12": 2, "16": 2, "20": 2}  # fmt: skip


def test_blind_mutants_at_least_as_many_as_the_issue_listed() -> None:
    for name, listed in ISSUE_45.items():
        assert len(BLIND.get(name, [])) >= listed, f"{name}: {BLIND.get(name)}"


BY_CLASS = [(chapter, fn) for chapter, fn in CASES if fn.__name__ in CLAUSES]


@pytest.mark.parametrize(("chapter", "fn"), BY_CLASS, ids=[f.__name__ for _, f in BY_CLASS])
def test_a_wrong_answer_of_each_class_fails_naming_its_clause(chapter, fn) -> None:
    """Device, dtype, numerics, side effects, a rare path: the FAILED line names the
    clause the answer breaks, not a raw torch error."""
    result = BY_CHAPTER[chapter].check(fn)
    assert not result.passed and CLAUSES[fn.__name__] in str(result), str(result)
