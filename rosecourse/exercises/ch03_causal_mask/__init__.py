"""Chapter 03's exercise: the causal mask of a call with a past.

The learner's function replaces rosetrainer.model.causal_mask.

The contract is the docstring of rosecourse/exercises/ch03_causal_mask/reference.py.
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
    batch_runs,
    check,
    greedy_runs,
    patched,
    probe_calls,
)
from rosecourse.naive import top_left_causal_mask
from roseinfer.cache.dense import ConcatKVCache
from rosetrainer.model import causal_mask

# (q_len, kv_len): no past, one decode query, chunks after a past.
# The last asks for the CPU by name: its call is watched on meta too (contract.Watcher), so
# a mask made without `device`, or kept from an earlier call, stands on the wrong device.
MASK_PROBES = [(1, 1), (4, 4), (1, 6), (3, 7), (2, 2), (5, 12), (2, 5, torch.device("cpu"))]


def _mask_probe(fn: Callable) -> Probe:
    return probe_calls(fn, "causal_mask", MASK_PROBES)


def _square_mask(q_len, kv_len, device=None):
    return torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()


def _open_mask(q_len, kv_len, device=None):
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device)


def _strict_mask(q_len, kv_len, device=None):
    query = torch.arange(kv_len - q_len, kv_len, device=device)
    return torch.arange(kv_len, device=device)[None, :] < query[:, None]


TOP_LEFT = (
    "your mask lets the decode query see nothing but key 0: top-left alignment (what "
    "is_causal=True does), the mask rows of the oldest positions, not the newest"
)
SQUARE = (
    "your mask is the (q_len, q_len) triangle of the new tokens alone, nanoGPT's "
    "bias[:, :, :T, :T]: a single decode query broadcasts it over every key and passes, "
    "but a chunk of several tokens after a past has more keys than queries"
)
EXERCISE = Exercise(
    name="causal_mask",
    reference=causal_mask,
    probe=_mask_probe,
    swapped_in=patched(rosetrainer.model, "causal_mask"),
    runs=greedy_runs(ConcatKVCache) + batch_runs(lambda rows: ConcatKVCache()),
    known_wrong=[
        KnownWrong("top_left", top_left_causal_mask, TOP_LEFT),
        KnownWrong("square", _square_mask, SQUARE),
        KnownWrong(
            "open",
            _open_mask,
            "your mask hides nothing: a decode query may see every "
            "key anyway, but a chunk's queries now see the tokens after them",
        ),
        KnownWrong(
            "strict",
            _strict_mask,
            "your mask hides each query's own key (< where <= "
            "is right): the newest token never reads itself",
        ),
    ],
    fallback="some query sees a key it must not, or misses one it must see",
)


def check_causal_mask(fn: Callable) -> CheckResult:
    """Chapter 03: `causal_mask(q_len, kv_len, device=None) -> (q_len, kv_len) bool`."""
    return check(EXERCISE, fn)
