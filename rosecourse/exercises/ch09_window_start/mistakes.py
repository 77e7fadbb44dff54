"""Chapter 09's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

from collections.abc import Callable

from rosecourse.exercises.answers import alternative, blind, mutant

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
