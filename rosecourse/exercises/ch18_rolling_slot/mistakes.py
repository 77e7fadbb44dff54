"""Chapter 18's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

import torch

from rosecourse.exercises.answers import alternative, blind, known, mutant

# -- the known mistakes: the check names each one it meets (answers.known) ----------


@known(
    "18",
    "every position goes round all sinks + window slots: once the sequence is "
    "longer than them, a later token overwrites a sink that every query still reads",
)
def _modulo_all_slots(pos, window, sinks):
    return pos % (window + sinks)


@known(
    "18",
    "the window's positions go round slots 0 .. W - 1, the sinks' own slots among "
    "them: the sinks are overwritten (and the last S slots are never used)",
)
def _sinks_share_the_window(pos, window, sinks):
    return pos % window


@known(
    "18",
    "every position after the sinks lands in one slot: the cache remembers the "
    "latest token only, not the window",
)
def _last_slot_only(pos, window, sinks):
    return torch.where(pos < sinks, pos, torch.full_like(pos, sinks + window - 1))


# -- 18: rolling_slot(pos, window, sinks) ---------------------------------------------------


@mutant("18")
def window_of_eight(pos, window, sinks):
    return torch.where(pos < sinks, pos, sinks + (pos - sinks) % 8)


@mutant("18")
def sinks_of_two(pos, window, sinks):
    return torch.where(pos < 2, pos, 2 + (pos - 2) % window)


@mutant("18")
def last_sink_in_the_window(pos, window, sinks):
    return torch.where(pos < sinks - 1, pos, sinks + (pos - sinks) % window)


@mutant("18")
def one_slot_short(pos, window, sinks):
    return torch.where(pos < sinks, pos, sinks + (pos - sinks) % max(window - 1, 1))


@mutant("18")
def window_rounds_down(pos, window, sinks):
    return torch.where(pos < sinks, pos, sinks + (pos - sinks) // window)


@mutant("18")
def no_sinks_branch(pos, window, sinks):
    return sinks + (pos - sinks) % window


@mutant("18")
def sinks_not_skipped(pos, window, sinks):
    return torch.where(pos < sinks, pos, (pos - sinks) % window)


@alternative("18")
def window_counted_from_zero(pos, window, sinks):
    return torch.where(pos < sinks, pos, sinks + pos % window)


@alternative("18")
def sinks_in_reverse(pos, window, sinks):
    return torch.where(pos < sinks, sinks - 1 - pos, sinks + (pos - sinks) % window)


@alternative("18")
def slots_as_int32(pos, window, sinks):
    # int32 indexes as int64 does; the contract names no dtype beyond that.
    slots = torch.where(pos < sinks, pos, sinks + (pos - sinks) % window)
    return slots.to(torch.int32)


@mutant("18")
def slots_as_int16(pos, window, sinks):
    # A tensor cannot be indexed with int16.
    return torch.where(pos < sinks, pos, sinks + (pos - sinks) % window).to(torch.int16)


# -- Written blind (issue 45) --


# WRONG: (pos - sinks) % (window + sinks): the window slots counted with the sinks
@blind("18")
def modulo_whole_cache(pos, window, sinks):
    return torch.where(pos < sinks, pos, sinks + (pos - sinks) % (window + sinks))


# WRONG: pos % (sinks + window) for every position: sinks get overwritten
@blind("18", known="modulo_all_slots")
def sinks_overwritten(pos, window, sinks):
    return pos % (sinks + window)


# WRONG: modulo window - 1 (off by one)
@blind("18")
def window_minus_one(pos, window, sinks):
    return torch.where(pos < sinks, pos, sinks + (pos - sinks) % (window - 1))
