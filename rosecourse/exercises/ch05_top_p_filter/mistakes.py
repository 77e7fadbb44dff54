"""Chapter 05's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rosecourse.exercises.answers import alternative, blind, breaks, known, mutant

# -- the known mistakes: the check names each one it meets (answers.known) ----------


@known(
    "05",
    "you drop the token that carries the "
    "mass over p (cumsum > p): the kept set falls short of p, and when the top "
    "token alone holds more than p nothing is left to sample",
)
def _drops_crossing(logits, p):
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    drop_sorted = torch.softmax(sorted_logits, dim=-1).cumsum(-1) > p
    return logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


@known(
    "05",
    "you decide in sorted order "
    "but mask the logits in vocabulary order: the kept places land on the wrong "
    "token ids (scatter the decision back through the sort order)",
)
def _sorted_not_scattered(logits, p):
    sorted_logits, _ = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    return logits.masked_fill(probs.cumsum(-1) - probs >= p, float("-inf"))


@known("05", "you summed logits, not probabilities: take the softmax of the sorted logits first")
def _mass_of_logits(logits, p):
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    drop_sorted = sorted_logits.cumsum(-1) - sorted_logits >= p
    return logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


# -- 05: top_p_filter(logits, p) ----------------------------------------------------------


def _nucleus(logits, p, drop: Callable, fill: float = -math.inf, descending: bool = True):
    sorted_logits, order = torch.sort(logits, dim=-1, descending=descending, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    dropped = drop(probs, probs.cumsum(-1) - probs, p)
    return logits.masked_fill(torch.zeros_like(dropped).scatter(-1, order, dropped), fill)


@mutant("05")
def keeps_a_token_at_exactly_p(logits, p):
    return _nucleus(logits, p, lambda probs, before, p: before > p)


@mutant("05")
def constant_p(logits, p):
    return _nucleus(logits, p, lambda probs, before, p: before >= 0.9)


@mutant("05")
def keeps_the_tail(logits, p):
    return _nucleus(logits, p, lambda probs, before, p: before < p)


@mutant("05")
def dropped_to_zero(logits, p):
    return _nucleus(logits, p, lambda probs, before, p: before >= p, fill=0.0)


@mutant("05")
def sorted_ascending(logits, p):
    return _nucleus(logits, p, lambda probs, before, p: before >= p, descending=False)


@mutant("05")
def softmax_over_rows(logits, p):
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=0)
    dropped = probs.cumsum(-1) - probs >= p
    return logits.masked_fill(torch.zeros_like(dropped).scatter(-1, order, dropped), -math.inf)


@mutant("05")
def first_row_decides(logits, p):
    kept = _nucleus(logits[..., :1, :], p, lambda probs, before, p: before >= p).isfinite()
    return logits.masked_fill(~kept.expand_as(logits), -math.inf)


@alternative("05")
def kept_count_per_row(logits, p):
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    before = torch.softmax(sorted_logits, dim=-1).cumsum(-1) - torch.softmax(sorted_logits, dim=-1)
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(logits.size(-1), device=logits.device).expand_as(order)
    )
    kept = (before < p).sum(-1, keepdim=True)
    return logits.masked_fill(rank >= kept, -math.inf)


# -- Written blind (issue 45) --


def _blind_05(logits, p, order_of=None, kept_mass=lambda cumsum, probs: cumsum - probs):
    """The writer's answer; `order_of(logits)`, when given, is (sorted logits, order)."""
    if p >= 1.0:
        return logits
    if order_of is None:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    else:
        sorted_logits, order = order_of(logits)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = kept_mass(torch.cumsum(probs, dim=-1), probs)
    drop_sorted = before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


# WRONG: treats logits as one flat vector (only the chapter's (vocab,) example works): batch
# rows share one nucleus
@blind("05")
def flat_1d_only(logits, p):
    return _blind_05(logits.reshape(-1), p).reshape(logits.shape)


# WRONG: maps the sorted mask back with a gather (drop_sorted[order]) instead of a scatter
@blind("05")
def gather_not_scatter(logits, p):
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    drop_sorted = torch.cumsum(probs, dim=-1) - probs >= p
    return logits.masked_fill(drop_sorted.gather(-1, order), float("-inf"))


# WRONG: keeps a token while the mass up to and including it is below p: drops the token
# that crosses p
@blind("05")
def inclusive_cumsum(logits, p):
    return _blind_05(logits, p, kept_mass=lambda cumsum, probs: cumsum)


# WRONG: sorted ascending then flipped: equal logits ordered by descending token id (ties
# broken the wrong way)
@blind("05")
def ties_reversed(logits, p):
    def flipped(x):
        sorted_logits, order = torch.sort(x, dim=-1, stable=True)
        return sorted_logits.flip(-1), order.flip(-1)

    return _blind_05(logits, p, order_of=flipped)


# WRONG: sort not stable: ties not broken by token order (argsort of negated logits)
@blind("05")
def unstable_sort(logits, p):
    def argsorted(x):
        order = torch.argsort(-x, dim=-1)
        return x.gather(-1, order), order

    return _blind_05(logits, p, order_of=argsorted)


# -- By class (issue 54): each breaks a clause its values do not show --


def _top_p(logits, p, dtype):
    sorted_logits, order = torch.sort(logits.to(dtype), dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    drop_sorted = torch.cumsum(probs, dim=-1) - probs >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


@breaks("05", "GPT-2's vocabulary), 0.5): from index")
def top_p_summed_in_float16(logits, p):
    return logits if p >= 1.0 else _top_p(logits, p, torch.float16)


@breaks("05", "GPT-2's vocabulary), 1.0): from index")
def top_p_without_the_shortcut(logits, p):
    return _top_p(logits, p, logits.dtype)


@breaks("05", "changes its argument logits in place")
def top_p_in_the_callers_logits(logits, p):
    if p < 1.0:
        logits[_top_p(logits, p, logits.dtype).isinf() & ~logits.isinf()] = float("-inf")
    return logits
