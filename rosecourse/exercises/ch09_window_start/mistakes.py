"""Chapter 09's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

from collections.abc import Callable

from rosecourse.exercises.answers import alternative, blind, known, mutant

# -- the known mistakes: the check names each one it meets (answers.known) ----------


@known(
    "09",
    "your window slides by one token every step (nanoGPT's "
    "crop): a policy of its own, not this one, and with a cache it re-prefills "
    "block_size tokens at every step",
)
def _slides(start, seq_len, block_size, keep):
    return max(start, seq_len - block_size)


@known(
    "09", "you cut a step early (>= where > is right): the window never holds all block_size tokens"
)
def _a_step_early(start, seq_len, block_size, keep):
    return seq_len - keep if seq_len - start >= block_size else start


@known(
    "09",
    "you compare the whole "
    "sequence with block_size, not the window (seq_len - start): past the first "
    "cut it cuts again at every step",
)
def _measures_the_sequence(start, seq_len, block_size, keep):
    return seq_len - keep if seq_len > block_size else start


@known("09", "the window never moves: the model runs out of learned positions at block_size")
def _never_cuts(start, seq_len, block_size, keep):
    return start


# -- 09: window_start(start, seq_len, block_size, keep) -------------------------------------


def _cut(start, seq_len, block_size, keep, full: Callable, to: Callable):
    return to(start, seq_len, block_size, keep) if full(seq_len - start, block_size) else start


@mutant("09")
def half_the_context_kept(start, seq_len, block_size, keep):
    return _cut(start, seq_len, block_size, keep, int.__gt__, lambda s, n, b, k: n - b // 2)


@mutant("09")
def one_token_fewer_kept(start, seq_len, block_size, keep):
    return _cut(start, seq_len, block_size, keep, int.__gt__, lambda s, n, b, k: n - k + 1)


@mutant("09")
def moved_on_by_keep(start, seq_len, block_size, keep):
    return _cut(start, seq_len, block_size, keep, int.__gt__, lambda s, n, b, k: s + k)


@mutant("09")
def measured_against_keep(start, seq_len, block_size, keep):
    return seq_len - keep if seq_len - start > keep else start


@mutant("09")
def keep_as_the_start(start, seq_len, block_size, keep):
    return _cut(start, seq_len, block_size, keep, int.__gt__, lambda s, n, b, k: k)


@mutant("09")
def cut_from_the_start(start, seq_len, block_size, keep):
    return _cut(start, seq_len, block_size, keep, int.__gt__, lambda s, n, b, k: s + n - k)


@alternative("09")
def cut_at_one_token_too_many(start, seq_len, block_size, keep):
    return seq_len - keep if seq_len - start == block_size + 1 else start


# -- Written blind (issue 45) --


# WRONG: >= instead of >: cuts when the view is exactly full
@blind("09", known="a_step_early")
def cut_one_early(start, seq_len, block_size, keep):
    return seq_len - keep if seq_len - start >= block_size else start


# WRONG: returns start + keep (the count taken for a position)
@blind("09")
def keep_as_start(start, seq_len, block_size, keep):
    return start + keep if seq_len - start > block_size else start


# WRONG: slides the window by one token (seq_len - block_size) instead of cutting back to keep
@blind("09", known="slides")
def slides_by_one(start, seq_len, block_size, keep):
    return seq_len - block_size if seq_len - start > block_size else start
