"""Chapter 04's exercise: the positions of new tokens after a past.

The learner's function replaces rosetrainer.model.position_ids.

The contract is the docstring of rosecourse/exercises/ch04_position_ids/reference.py.
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
    outcome,
    patched,
    probe_calls,
)
from rosecourse.naive import positions_from_zero
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


def _one_too_far(past_len, q_len, device=None):
    return torch.arange(past_len + 1, past_len + q_len + 1, device=device)


def _all_at_past_len(past_len, q_len, device=None):
    return torch.full((q_len,), past_len, device=device)


def _on_the_cpu(past_len, q_len, device=None):
    return torch.arange(past_len, past_len + q_len)


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
        KnownWrong(
            "on_the_cpu",
            _on_the_cpu,
            "your positions are made on the CPU whatever `device` says: a model on a GPU "
            "passes idx.device, and its position embedding cannot read CPU indices "
            "(torch.arange(..., device=device))",
        ),
    ],
    fallback="a new token stands at the wrong position",
)


def check_position_ids(fn: Callable) -> CheckResult:
    """Chapter 04: `position_ids(past_len, q_len, device=None) -> (q_len,) long`."""
    return check(EXERCISE, fn)
