"""Chapter 01's exercise: the uncached greedy loop.

The check calls the learner's loop on the chapters' model and compares its tokens with
the teaching loop's.

The contract is the docstring of rosecourse/exercises/ch01_greedy_decode/reference.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rosecourse.demo import (
    NEW_TOKENS,
    PROMPT,
)
from rosecourse.exercises.answers import known_mistakes
from rosecourse.exercises.common import (
    CheckResult,
    Exercise,
    Probe,
    check,
    encoded,
    held_function,
    hold,
    oracle_model,
    outcome,
    reference_tokens,
)
from roseinfer.loops.generate import generate
from roseinfer.request.sampling import SamplingParams
from rosetrainer.model import GPT


def greedy_decode(model: GPT, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The reference: the teaching loop, uncached."""
    params = SamplingParams(max_tokens=max_new_tokens, ignore_eos=True)
    return generate(model, prompt_ids, params, use_cache=False).token_ids


def _greedy_probe(fn: Callable) -> Probe:
    model = oracle_model()
    cases = [((464, 3290, 318), 3), ((50,), 4), ((50, 464), 1)]
    return {
        f"greedy_decode(model, {list(p)}, {n})": outcome(lambda p=p, n=n: fn(model, list(p), n))
        for p, n in cases
    }


def _greedy_runs() -> list[tuple[str, Callable, Callable]]:
    prompt = encoded(PROMPT)

    def go(on_token: Callable[[int, int], None]) -> list[list[int]]:
        with torch.no_grad():
            return [list(held_function()(oracle_model(), list(prompt), NEW_TOKENS))]

    return [("the chapter's prompt", lambda: [reference_tokens(prompt, NEW_TOKENS)], go)]


EXERCISE = Exercise(
    name="greedy_decode",
    reference=greedy_decode,
    probe=_greedy_probe,
    swapped_in=hold,
    runs=_greedy_runs(),
    known_wrong=known_mistakes(__name__),
    fallback="your loop does not choose, at each step, the argmax after the whole sequence",
)


def check_greedy_decode(fn: Callable) -> CheckResult:
    """Chapter 01: `greedy_decode(model, prompt_ids, max_new_tokens) -> new token ids`."""
    return check(EXERCISE, fn)
