"""Chapter 07's exercise: the per-row positions of a left-padded batch.

The learner's function replaces rosetrainer.model.padded_position_ids in a batched run.

The contract is the docstring of rosecourse/exercises/ch07_padded_position_ids/reference.py.
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
    batch_runs,
    check,
    oracle_model,
    outcome,
    patched,
)
from roseinfer.cache.dense import ConcatKVCache
from rosetrainer.model import padded_position_ids

# Left-padded masks: rows with no, some and much padding; one real token; a bool mask.
MASKS = [
    torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]),
    torch.tensor([[0, 0, 0, 0, 0, 0, 0, 1], [0, 0, 0, 1, 1, 1, 1, 1]]),
    torch.tensor([[False, True, True], [True, True, True]]),
]


def _padded_probe(fn: Callable) -> Probe:
    """What fn gives for each mask, a padding slot's position shown as 0 when it is any
    position the model has (the contract leaves it free: nothing reads it)."""
    block_size = oracle_model().config.block_size

    def positions(mask: torch.Tensor) -> object:
        got = fn(mask.clone())
        if not isinstance(got, torch.Tensor) or got.shape != mask.shape:
            return got
        free = (mask == 0) & (got >= 0) & (got < block_size)
        return got.masked_fill(free, 0)

    return {
        f"padded_position_ids({mask.tolist()})": outcome(lambda mask=mask: positions(mask))
        for mask in MASKS
    }


EXERCISE = Exercise(
    name="padded_position_ids",
    reference=padded_position_ids,
    probe=_padded_probe,
    swapped_in=patched(rosetrainer.model, "padded_position_ids"),
    runs=batch_runs(lambda rows: ConcatKVCache()),
    known_wrong=known_mistakes(__name__),
    fallback="a row's tokens do not stand where they would stand alone",
)


def check_padded_position_ids(fn: Callable) -> CheckResult:
    """Chapter 07: `padded_position_ids(attention_mask) -> (batch, slots) long`."""
    return check(EXERCISE, fn)
