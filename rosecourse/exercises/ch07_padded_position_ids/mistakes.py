"""Chapter 07's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

import torch

from rosecourse.exercises.answers import alternative, blind, known, mutant

# -- the known mistakes: the check names each one it meets (answers.known) ----------


@known(
    "07",
    "your positions count the padding: "
    "every real token of a padded row stands as far right as its padding is "
    "long (the row without padding cannot tell)",
)
def _counting_padding(attention_mask):
    return torch.arange(attention_mask.size(1)).expand(attention_mask.shape)


@known(
    "07",
    "your positions start at 1 (cumsum without the - 1): "
    "every row's tokens stand one too far right",
)
def _from_one(attention_mask):
    return attention_mask.long().cumsum(-1)


@known(
    "07",
    "padding slots get position -1, which has no "
    "embedding row: clamp them to 0 (what they compute is never read)",
)
def _unclamped(attention_mask):
    return attention_mask.long().cumsum(-1) - 1


# -- 07: padded_position_ids(attention_mask) ------------------------------------------------


@mutant("07")
def counted_down_the_batch(attention_mask):
    return (attention_mask.long().cumsum(0) - 1).clamp(min=0)


@mutant("07")
def first_row_positions_for_all(attention_mask):
    return (attention_mask[:1].long().cumsum(-1) - 1).clamp(min=0).expand(attention_mask.shape)


@mutant("07")
def counted_from_the_right(attention_mask):
    return attention_mask.long().sum(-1, keepdim=True) - attention_mask.long().cumsum(-1)


@mutant("07")
def padding_counted(attention_mask):
    return (1 - attention_mask.long()).cumsum(-1)


@mutant("07")
def slot_numbers(attention_mask):
    return (torch.arange(attention_mask.size(1)) - 1).clamp(min=0).expand(attention_mask.shape)


@mutant("07")
def real_tokens_in_the_row(attention_mask):
    return attention_mask.long().sum(-1, keepdim=True).expand(attention_mask.shape) - 1


@alternative("07")
def slot_minus_padding(attention_mask):
    padding = (attention_mask == 0).sum(-1, keepdim=True)
    slots = torch.arange(attention_mask.size(1), device=attention_mask.device)
    return (slots - padding).clamp(min=0)


@alternative("07")
def tokens_before(attention_mask):
    mask = attention_mask.long()
    return mask.cumsum(-1) - mask


@alternative("07")
def padding_at_position_one(attention_mask):
    return (attention_mask.long().cumsum(-1) - 1).abs()


# -- Written blind (issue 45) --


# WRONG: positions start at 1 (cumsum without the - 1)
@blind("07", known="from_one")
def count_from_one(attention_mask):
    return attention_mask.long().cumsum(-1)


# WRONG: cumsum over the batch axis (dim 0)
@blind("07")
def cumsum_wrong_axis(attention_mask):
    return (attention_mask.long().cumsum(0) - 1).clamp(min=0)


# WRONG: positions are the slot numbers, the padding counted
@blind("07", known="counting_padding")
def ignores_mask(attention_mask):
    slots = torch.arange(attention_mask.size(-1), device=attention_mask.device)
    return slots.expand_as(attention_mask).clone()
