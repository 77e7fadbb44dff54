"""Chapter 02's exercise: keep the past keys/values and add the new ones.

The learner's function replaces rosetrainer.model.concat_kv under a concatenating cache.

The contract is the docstring of rosecourse/exercises/ch02_concat_kv/reference.py.
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
    greedy_runs,
    outcome,
    patched,
)
from roseinfer.cache.dense import ConcatKVCache
from rosetrainer.model import concat_kv


def _kv_probe(fn: Callable) -> Probe:
    """Two rows that differ, three heads: a first call (no past), then a past of 3 and 2 new
    tokens, then one decode token; and a call where every axis has the same size."""
    generator = torch.Generator().manual_seed(0)

    def kv(time: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.randn(2, 3, time, 4, generator=generator) for _ in range(2))

    past, new, one = kv(3), kv(2), kv(1)
    # Every axis of one size: a concatenation along the wrong one raises nothing.
    square = [torch.randn(2, 2, 2, 2, generator=generator) for _ in range(4)]
    return {
        "concat_kv(past of (2, 2, 2, 2), k, v of (2, 2, 2, 2))": outcome(
            lambda: fn(tuple(square[:2]), *square[2:])
        ),
        "concat_kv(None, k, v) with k, v (2, 3, 2, 4)": outcome(lambda: fn(None, *new)),
        "concat_kv(past of (2, 3, 3, 4), k, v of (2, 3, 2, 4))": outcome(lambda: fn(past, *new)),
        "concat_kv(past of (2, 3, 3, 4), k, v of (2, 3, 1, 4))": outcome(lambda: fn(past, *one)),
    }


EXERCISE = Exercise(
    name="concat_kv",
    reference=concat_kv,
    probe=_kv_probe,
    swapped_in=patched(rosetrainer.model, "concat_kv"),
    runs=greedy_runs(ConcatKVCache) + batch_runs(lambda rows: ConcatKVCache()),
    known_wrong=known_mistakes(__name__),
    fallback="the keys/values handed back are not the past followed by the new ones",
)


def check_concat_kv(fn: Callable) -> CheckResult:
    """Chapter 02: `concat_kv(layer_past, k, v) -> (k_all, v_all)`."""
    return check(EXERCISE, fn)
