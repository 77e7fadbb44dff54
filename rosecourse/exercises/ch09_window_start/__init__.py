"""Chapter 09's exercise: the window policy past the context.

The learner's function replaces roseinfer.request.rows.window_start in a run twice the
context long.

The contract is the docstring of rosecourse/exercises/ch09_window_start/reference.py.
"""

from __future__ import annotations

from collections.abc import Callable

import roseinfer.cache.quantized
import roseinfer.cache.rolling
import roseinfer.loops.generate
import roseinfer.request.rows
import roseinfer.request.sampling
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
    oracle_model,
    patched,
    probe_calls,
    reference_tokens,
)
from roseinfer.loops.generate import generate
from roseinfer.request.rows import window_start
from roseinfer.request.sampling import SamplingParams


def _window_probe(fn: Callable) -> Probe:
    # (start, seq_len, block_size, keep): the view just full, one too many, past a first
    # cut, a keep other than half the context, and a later window.
    cases = [
        (0, 8, 8, 4), (0, 9, 8, 4), (5, 12, 8, 4), (5, 13, 8, 4), (0, 9, 8, 7),
        (12, 17, 8, 4), (4, 13, 8, 3), (0, 33, 32, 1),
    ]  # fmt: skip
    return probe_calls(fn, "window_start", cases)


def _window_runs() -> list[tuple[str, Callable, Callable]]:
    prompt = encoded(PROMPT)
    n_new = 2 * oracle_model().config.block_size

    def go(on_token: Callable[[int, int], None]) -> list[list[int]]:
        params = SamplingParams(max_tokens=n_new, ignore_eos=True)
        run = generate(oracle_model(), list(prompt), params, on_token=on_token)
        return [run.token_ids]

    return [
        (f"{n_new} tokens, keep = block_size // 2", lambda: [reference_tokens(prompt, n_new)], go)
    ]


EXERCISE = Exercise(
    name="window_start",
    reference=window_start,
    probe=_window_probe,
    swapped_in=patched(roseinfer.request.rows, "window_start"),
    runs=_window_runs(),
    known_wrong=known_mistakes(__name__),
    fallback="the window does not start where the cut-back policy puts it",
)


def check_window_start(fn: Callable) -> CheckResult:
    """Chapter 09: `window_start(start, seq_len, block_size, keep) -> int`."""
    return check(EXERCISE, fn)
