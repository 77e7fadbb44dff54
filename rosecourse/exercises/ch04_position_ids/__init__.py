"""Chapter 04's exercise: the positions of new tokens after a past.

The learner's function replaces rosetrainer.model.position_ids.

The contract is the docstring of rosecourse/exercises/ch04_position_ids/reference.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import rosetrainer.model
from rosecourse.exercises.answers import known_mistakes
from rosecourse.exercises.common import (
    CheckResult,
    Exercise,
    Probe,
    check,
    greedy_runs,
    outcome,
    patched,
    probe_calls,
)
from roseinfer.cache.dense import ConcatKVCache
from rosetrainer.model import position_ids


def _positions_probe(fn: Callable) -> Probe:
    # (past_len, q_len): a prefill, a decode token, chunks after a past.
    probe = dict(probe_calls(fn, "position_ids", [(0, 5), (5, 1), (7, 3), (0, 1), (12, 4)]))
    # The device the model asks for (rose passes idx.device): the check's runs are on the
    # CPU, where positions made anywhere else would pass; the meta device tells.
    meta = torch.device("meta")
    probe["position_ids(3, 2, torch.device('meta')).device"] = outcome(
        lambda: str(fn(3, 2, meta).device)
    )
    return probe


EXERCISE = Exercise(
    name="position_ids",
    reference=position_ids,
    probe=_positions_probe,
    swapped_in=patched(rosetrainer.model, "position_ids"),
    runs=greedy_runs(ConcatKVCache),
    known_wrong=known_mistakes(__name__),
    fallback="a new token stands at the wrong position",
)


def check_position_ids(fn: Callable) -> CheckResult:
    """Chapter 04: `position_ids(past_len, q_len, device=None) -> (q_len,) long`."""
    return check(EXERCISE, fn)
