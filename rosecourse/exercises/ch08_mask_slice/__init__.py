"""Chapter 08's exercise: a chunk's rows of one precomputed causal mask (nanoGPT's bias).

The learner's slice becomes the model's causal mask.

The contract is the docstring of rosecourse/exercises/ch08_mask_slice/reference.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from unittest import mock

import torch

import rosetrainer.model
from rosecourse.exercises.answers import known_mistakes
from rosecourse.exercises.ch08_mask_slice.reference import mask_slice
from rosecourse.exercises.common import (
    CheckResult,
    Exercise,
    Probe,
    batch_runs,
    check,
    greedy_runs,
    oracle_model,
    outcome,
)
from roseinfer.cache.dense import ConcatKVCache


def _slice_probe(fn: Callable) -> Probe:
    bias = torch.ones(8, 8, dtype=torch.bool).tril()
    # (past_len, q_len): a prefill, decode tokens, a chunk, the whole bias.
    cases = [(0, 4), (5, 1), (3, 3), (0, 8), (7, 1), (2, 5)]
    return {
        f"mask_slice(bias (8, 8), {past}, {q})": outcome(lambda past=past, q=q: fn(bias, past, q))
        for past, q in cases
    }


def _swap_mask_slice(fn: Callable) -> contextlib.AbstractContextManager:
    size = oracle_model().config.block_size
    bias = torch.ones(size, size, dtype=torch.bool).tril()  # nanoGPT's registered buffer

    def sliced_mask(q_len: int, kv_len: int, device: torch.device | None = None):
        return fn(bias.to(device), kv_len - q_len, q_len)

    return mock.patch.object(rosetrainer.model, "causal_mask", sliced_mask)


EXERCISE = Exercise(
    name="mask_slice",
    reference=mask_slice,
    probe=_slice_probe,
    swapped_in=_swap_mask_slice,
    runs=greedy_runs(ConcatKVCache) + batch_runs(lambda rows: ConcatKVCache()),
    known_wrong=known_mistakes(__name__),
    fallback="the slice is not rows past_len .. past_len + q_len, columns 0 .. past_len + q_len",
)


def check_mask_slice(fn: Callable) -> CheckResult:
    """Chapter 08: `mask_slice(bias, past_len, q_len) -> (q_len, past_len + q_len) bool`."""
    return check(EXERCISE, fn)
