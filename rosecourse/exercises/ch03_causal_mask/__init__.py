"""Chapter 03's exercise: the causal mask of a call with a past.

The learner's function replaces rosetrainer.model.causal_mask.

The contract is the docstring of rosecourse/exercises/ch03_causal_mask/reference.py.
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
    patched,
    probe_calls,
)
from roseinfer.cache.dense import ConcatKVCache
from rosetrainer.model import causal_mask

# (q_len, kv_len): no past, one decode query, chunks after a past.
# The last asks for the CPU by name: its call runs on another device too (contract.Watcher), so
# a mask made without `device`, or kept from an earlier call, stands on the wrong device.
MASK_PROBES = [(1, 1), (4, 4), (1, 6), (3, 7), (2, 2), (5, 12), (2, 5, torch.device("cpu"))]


def _mask_probe(fn: Callable) -> Probe:
    return probe_calls(fn, "causal_mask", MASK_PROBES)


EXERCISE = Exercise(
    name="causal_mask",
    reference=causal_mask,
    probe=_mask_probe,
    swapped_in=patched(rosetrainer.model, "causal_mask"),
    runs=greedy_runs(ConcatKVCache) + batch_runs(lambda rows: ConcatKVCache()),
    known_wrong=known_mistakes(__name__),
    fallback="some query sees a key it must not, or misses one it must see",
)


def check_causal_mask(fn: Callable) -> CheckResult:
    """Chapter 03: `causal_mask(q_len, kv_len, device=None) -> (q_len, kv_len) bool`."""
    return check(EXERCISE, fn)
