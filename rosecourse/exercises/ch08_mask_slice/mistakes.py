"""Chapter 08's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

from rosecourse.exercises.answers import alternative, blind, known, mutant
from rosecourse.exercises.ch03_causal_mask.mistakes import SQUARE, TOP_LEFT

# -- the known mistakes: the check names each one it meets (answers.known) ----------


@known("08", SQUARE, name="nanogpt")
def _nanogpt_slice(bias, past_len, q_len):
    return bias[:q_len, :q_len]


@known("08", TOP_LEFT)
def _top_rows(bias, past_len, q_len):
    return bias[:q_len, : past_len + q_len]


@known(
    "08",
    "the rows are right, but you kept every "
    "column of the bias: there are only past_len + q_len keys to mask",
)
def _every_column(bias, past_len, q_len):
    return bias[past_len : past_len + q_len]


# -- 08: mask_slice(bias, past_len, q_len) --------------------------------------------------


@mutant("08")
def bias_rows_one_early(bias, past_len, q_len):
    start = max(past_len - 1, 0)
    return bias[start : start + q_len, : past_len + q_len]


@mutant("08")
def one_column_short(bias, past_len, q_len):
    return bias[past_len : past_len + q_len, : past_len + q_len - 1]


@mutant("08")
def bias_transposed(bias, past_len, q_len):
    return bias[: past_len + q_len, past_len : past_len + q_len].T


@mutant("08")
def last_rows_of_the_bias(bias, past_len, q_len):
    return bias[-q_len:, : past_len + q_len]


@mutant("08")
def bias_inverted(bias, past_len, q_len):
    return ~bias[past_len : past_len + q_len, : past_len + q_len]


@mutant("08")
def rows_counted_by_q_len(bias, past_len, q_len):
    return bias[q_len - 1 : 2 * q_len - 1, : past_len + q_len]


@alternative("08")
def narrowed(bias, past_len, q_len):
    return bias.narrow(0, past_len, q_len).narrow(1, 0, past_len + q_len)


# -- Written blind (issue 45) --


# WRONG: rows start one early (past_len - 1) when there is a past
@blind("08")
def rows_off_by_one(bias, past_len, q_len):
    return bias[max(past_len - 1, 0) : max(past_len - 1, 0) + q_len, : past_len + q_len]


# WRONG: takes the first q_len rows of bias (top-left)
@blind("08", known="top_rows")
def first_rows_top_left(bias, past_len, q_len):
    return bias[:q_len, : past_len + q_len]
