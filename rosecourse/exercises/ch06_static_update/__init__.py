"""Chapter 06's exercise: the static cache's in-place write.

The learner's function replaces StaticLayerCache.update, as a function of the layer's
buffers.

The contract is the docstring of rosecourse/exercises/ch06_static_update/reference.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from unittest import mock

import torch

from rosecourse.exercises.answers import known_mistakes
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
from roseinfer.cache.dense import StaticKVCache, StaticLayerCache


def _static_probe(fn: Callable) -> Probe:
    """Buffers of 2 rows, 2 heads and 7 slots: a prefill of 3, a decode token, then a chunk
    of 2; after each call, what is handed back and what the buffers keep."""
    generator = torch.Generator().manual_seed(0)
    k, v = torch.zeros(2, 2, 7, 3), torch.zeros(2, 2, 7, 3)
    seen: Probe = {}
    for start, length in [(0, 3), (3, 1), (4, 2)]:
        k_new, v_new = (torch.randn(2, 2, length, 3, generator=generator) for _ in range(2))
        input_pos = torch.arange(start, start + length)
        call = f"static_update(k, v, {input_pos.tolist()}, k_new, v_new)"
        seen[f"{call} returns"] = outcome(
            lambda p=input_pos, k_new=k_new, v_new=v_new: cloned(fn(k, v, p, k_new, v_new))
        )
        seen[f"after {call}, the buffers"] = (k.clone(), v.clone())
    return seen


def cloned(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.clone() for t in tensors)  # the buffers change at the next call


# The real write, held before any check swaps a learner's in.
_real_static_update = StaticLayerCache.update


def static_update(k_buffer, v_buffer, input_pos, k_new, v_new):
    """The real write, as a function of the buffers (what StaticLayerCache.update does)."""
    return _real_static_update(StaticLayerCache(k_buffer, v_buffer), input_pos, k_new, v_new)


def _swap_static_update(fn: Callable) -> contextlib.AbstractContextManager:
    def update(layer: StaticLayerCache, input_pos, k_new, v_new):
        return fn(layer.k, layer.v, input_pos, k_new, v_new)

    return mock.patch.object(StaticLayerCache, "update", update)


EXERCISE = Exercise(
    name="static_update",
    reference=static_update,
    probe=_static_probe,
    swapped_in=_swap_static_update,
    writes=frozenset({"k_buffer", "v_buffer"}),  # (in place: the buffers are the cache)
    runs=greedy_runs(lambda: StaticKVCache(oracle_model(), max_len=64))
    + batch_runs(lambda rows: StaticKVCache(oracle_model(), batch_size=rows, max_len=64)),
    known_wrong=known_mistakes(__name__),
    fallback="the buffers handed back are not the past with the new keys/values in their slots",
)


def check_static_update(fn: Callable) -> CheckResult:
    """Chapter 06: `static_update(k_buffer, v_buffer, input_pos, k_new, v_new) -> (k, v)`."""
    return check(EXERCISE, fn)
