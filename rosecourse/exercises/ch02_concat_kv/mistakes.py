"""Chapter 02's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rosecourse.exercises.answers import alternative, blind, known, mutant
from rosecourse.naive import lose_past_kv

# -- the known mistakes: the check names each one it meets (answers.known) ----------


known(
    "02",
    "the past's slots are there but hold zeros: "
    "the new token attends to keys that say nothing about the prompt",
)(lose_past_kv)


@known(
    "02",
    "you hand back the new keys/values alone: the cache "
    "forgets the past, and the new token attends to itself only",
)
def _new_only(layer_past, k, v):
    return k, v


@known(
    "02",
    "the new keys go in front of the past: a decode "
    "query sees every key anyway (attention is a sum, order-free), but a chunk's "
    "mask columns are positions, and its queries now see the wrong keys",
)
def _new_first(layer_past, k, v):
    if layer_past is None:
        return k, v
    return torch.cat([k, layer_past[0]], dim=2), torch.cat([v, layer_past[1]], dim=2)


@known(
    "02",
    "you concatenated along the heads (dim 1); time is dim 2 of (batch, heads, time, head_dim)",
)
def _along_heads(layer_past, k, v):
    if layer_past is None:
        return k, v
    return torch.cat([layer_past[0], k], dim=1), torch.cat([layer_past[1], v], dim=1)


# -- 02: concat_kv(layer_past, k, v) -------------------------------------------------------


def _concat(layer_past, k, v, join: Callable):
    if layer_past is None:
        return k, v
    return join(layer_past[0], k), join(layer_past[1], v)


@mutant("02")
def first_row_only(layer_past, k, v):
    return _concat(layer_past, k, v, lambda past, new: torch.cat([past[:1], new[:1]], dim=2))


@mutant("02")
def along_head_dim(layer_past, k, v):
    return _concat(layer_past, k, v, lambda past, new: torch.cat([past, new], dim=3))


@mutant("02")
def oldest_dropped(layer_past, k, v):
    return _concat(layer_past, k, v, lambda past, new: torch.cat([past[:, :, 1:], new], dim=2))


@mutant("02")
def newest_past_only(layer_past, k, v):
    return _concat(layer_past, k, v, lambda past, new: torch.cat([past[:, :, -1:], new], dim=2))


@mutant("02")
def past_only(layer_past, k, v):
    return layer_past if layer_past is not None else (k, v)


@mutant("02")
def keys_for_values(layer_past, k, v):
    if layer_past is None:
        return k, v
    return torch.cat([layer_past[0], k], dim=2), torch.cat([layer_past[0], v], dim=2)


@alternative("02")
def concatenated_at_negative_two(layer_past, k, v):
    if layer_past is not None:
        k, v = (torch.cat(pair, dim=-2) for pair in zip(layer_past, (k, v), strict=True))
    return k, v


# -- Written blind (issue 45) --


# WRONG: keys concatenated, but only the new values returned (past values dropped)
@blind("02")
def keeps_only_new_values(layer_past, k, v):
    if layer_past is None:
        return k, v
    pk, pv = layer_past
    return torch.cat([pk, k], dim=2), v


# WRONG: new keys/values put before the past along time
@blind("02", known="new_first")
def new_before_past(layer_past, k, v):
    if layer_past is None:
        return k, v
    pk, pv = layer_past
    return torch.cat([k, pk], dim=2), torch.cat([v, pv], dim=2)


# WRONG: values concatenated with the new keys (typo k for v)
@blind("02")
def v_typo_uses_k(layer_past, k, v):
    if layer_past is None:
        return k, v
    pk, pv = layer_past
    return torch.cat([pk, k], dim=2), torch.cat([pv, k], dim=2)
