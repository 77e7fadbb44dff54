"""Chapter 04's exercise: the positions of new tokens after a past.

The learner's function replaces rosetrainer.model.position_ids.

The contract is the docstring of rosecourse/solutions/ch04_position_ids.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import rosetrainer.model
from rosecourse.exercises.common import (
    CheckResult,
    Exercise,
    KnownWrong,
    Probe,
    check,
    greedy_runs,
    patched,
    probe_calls,
)
from rosecourse.naive import positions_from_zero
from roseinfer.cache.dense import ConcatKVCache
from rosetrainer.model import position_ids


def _positions_probe(fn: Callable) -> Probe:
    # (past_len, q_len): a prefill, a decode token, chunks after a past.
    return probe_calls(fn, "position_ids", [(0, 5), (5, 1), (7, 3), (0, 1), (12, 4)])


def _one_too_far(past_len, q_len, device=None):
    return torch.arange(past_len + 1, past_len + q_len + 1, device=device)


def _all_at_past_len(past_len, q_len, device=None):
    return torch.full((q_len,), past_len, device=device)


EXERCISE = Exercise(
    name="position_ids",
    reference=position_ids,
    probe=_positions_probe,
    swapped_in=patched(rosetrainer.model, "position_ids"),
    runs=greedy_runs(ConcatKVCache),
    known_wrong=[
        KnownWrong(
            "from_zero",
            positions_from_zero,
            "every new token is numbered from 0 as if "
            "nothing came before: the decode token gets position 0's embedding",
        ),
        KnownWrong(
            "one_too_far",
            _one_too_far,
            "your positions are one too far right: the prompt's first token already stands at 1",
        ),
        KnownWrong(
            "all_at_past_len",
            _all_at_past_len,
            "every token of a call gets the same "
            "position, past_len: right for one decode token, wrong for a prefill",
        ),
    ],
    fallback="a new token stands at the wrong position",
)


def check_position_ids(fn: Callable) -> CheckResult:
    """Chapter 04: `position_ids(past_len, q_len, device=None) -> (q_len,) long`."""
    return check(EXERCISE, fn)
