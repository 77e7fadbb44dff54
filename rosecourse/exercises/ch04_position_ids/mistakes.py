"""Chapter 04's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

import torch

from rosecourse.exercises.answers import alternative, blind, breaks, known, mutant
from rosecourse.naive import positions_from_zero

# -- the known mistakes: the check names each one it meets (answers.known) ----------


known(
    "04",
    "every new token is numbered from 0 as if "
    "nothing came before: the decode token gets position 0's embedding",
    name="from_zero",
)(positions_from_zero)


@known("04", "your positions are one too far right: the prompt's first token already stands at 1")
def _one_too_far(past_len, q_len, device=None):
    return torch.arange(past_len + 1, past_len + q_len + 1, device=device)


@known(
    "04",
    "every token of a call gets the same "
    "position, past_len: right for one decode token, wrong for a prefill",
)
def _all_at_past_len(past_len, q_len, device=None):
    return torch.full((q_len,), past_len, device=device)


@known(
    "04",
    "your positions are made on the CPU whatever `device` says: a model on a GPU "
    "passes idx.device, and its position embedding cannot read CPU indices "
    "(torch.arange(..., device=device))",
)
def _on_the_cpu(past_len, q_len, device=None):
    return torch.arange(past_len, past_len + q_len)


# -- 04: position_ids(past_len, q_len, device) ----------------------------------------------


@mutant("04")
def end_is_q_len(past_len, q_len, device=None):
    return torch.arange(past_len, q_len, device=device)


@mutant("04")
def one_too_early(past_len, q_len, device=None):
    return torch.arange(past_len - 1, past_len + q_len - 1, device=device).clamp(min=0)


@mutant("04")
def every_position_so_far(past_len, q_len, device=None):
    return torch.arange(past_len + q_len, device=device)


@mutant("04")
def counting_down(past_len, q_len, device=None):
    return torch.arange(past_len + q_len - 1, past_len - 1, -1, device=device)


@mutant("04")
def all_at_the_last(past_len, q_len, device=None):
    return torch.full((q_len,), past_len + q_len - 1, device=device)


@mutant("04")
def float_positions(past_len, q_len, device=None):
    return torch.arange(past_len, past_len + q_len, dtype=torch.float32, device=device)


@alternative("04")
def offset_added(past_len, q_len, device=None):
    return past_len + torch.arange(q_len, device=device)


# -- Written blind (issue 45) --


# WRONG: device argument ignored: positions always on the CPU
@blind("04", known="on_the_cpu")
def device_ignored(past_len, q_len, device=None):
    return torch.arange(past_len, past_len + q_len)


# WRONG: positions start at past_len - 1
@blind("04")
def off_by_one(past_len, q_len, device=None):
    return torch.arange(past_len - 1, past_len + q_len - 1, device=device).clamp(min=0)


# WRONG: positions restart at 0 every call (past ignored)
@blind("04", known="from_zero")
def restart_at_zero(past_len, q_len, device=None):
    return torch.arange(q_len, device=device)


# -- By class (issue 54): each breaks a clause its values do not show --


@breaks("04", "torch.int32 where the contract's is torch.int64")
def positions_in_int32(past_len, q_len, device=None):
    return torch.arange(past_len, past_len + q_len, device=device, dtype=torch.int32)
