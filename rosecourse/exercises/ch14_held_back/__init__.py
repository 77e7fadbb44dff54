"""Chapter 14's exercise: the stream's stop-string hold-back.

The learner's function replaces the detokenizer's held_back inside the engine.

The contract is the docstring of rosecourse/exercises/ch14_held_back/reference.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from unittest import mock

from rosecourse.demo import (
    PROMPT,
)
from rosecourse.exercises.answers import known_mistakes
from rosecourse.exercises.common import (
    CheckResult,
    Exercise,
    Probe,
    check,
    encoded,
    probe_calls,
    reference_tokens,
)
from rosecourse.exercises.engine import (
    ENGINE_NEW,
    engine_runs,
    engine_step_name,
    greedy,
    tokenizer,
)
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.engine.outputs import RequestOutput
from roseinfer.request.detokenizer import held_back
from roseinfer.request.sampling import SamplingParams


def _hold_probe(fn: Callable) -> Probe:
    cases = [
        ("Good mor", ("morning",)),
        ("Good morning", ("morning",)),
        ("ab", ("abc", "bcd")),
        ("xxab", ("bz", "abz")),
        ("", ("a",)),
        ("hello", ()),
        ("say aa", ("aab",)),  # "a" and "aa" both begin the stop: the longer is held
        ("The end", ("end.", "e")),  # a whole one-letter stop is no beginning
        ("xyz", ("yzw", "zq")),  # the first stop's beginning is the longer
        ("a", ("abc",)),  # the text shorter than the stop
    ]
    return probe_calls(fn, "held_back", cases)


@functools.cache
def stop_strings() -> tuple[str, ...]:
    """Stops that the chapter prompt's greedy text begins partway through its tokens: the
    text of 3 tokens from token 6 on, and one that never comes."""
    ids = reference_tokens(encoded(PROMPT), ENGINE_NEW)
    decode = tokenizer().decode
    return (decode(list(ids[6:9])), decode(list(ids[2:4])) + "\u00a7")


def _stream_workload() -> list[tuple[list[int], SamplingParams]]:
    return [(list(encoded(PROMPT)), greedy(stop=list(stop_strings())))]


def shown_text(engine: LLMEngine, outputs: list[RequestOutput]) -> tuple:
    return tuple(o.text for o in outputs)


EXERCISE = Exercise(
    name="held_back",
    reference=held_back,
    probe=_hold_probe,
    swapped_in=lambda fn: mock.patch("roseinfer.request.detokenizer.held_back", fn),
    runs=engine_runs(
        _stream_workload,
        shown_text,
        "the text the stream shows at every step",
        tokens_too=False,  # a stop string ends it early: its steps are the oracle
        num_kv_blocks=40,
    ),
    known_wrong=known_mistakes(__name__),
    fallback="the tail you hold back is not the longest one that could begin a stop string",
    step_label=engine_step_name,
)


def check_held_back(fn: Callable) -> CheckResult:
    """Chapter 14: `held_back(text, stops) -> characters to hold back`."""
    return check(EXERCISE, fn)
