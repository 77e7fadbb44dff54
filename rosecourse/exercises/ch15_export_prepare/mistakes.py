"""Chapter 15's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

import torch

import rosetrainer.model
from rosecourse.exercises.answers import alternative, blind, known, mutant
from roseinfer.loops.export_onnx import ExportCache
from rosetrainer.model import causal_mask, padding_mask

# -- the known mistakes: the check names each one it meets (answers.known) ----------


@known(
    "15",
    "your mask is made without `device`: right on the CPU, but the model passes its "
    "input's device, and a mask on the CPU meets the graph's inputs on a GPU "
    "(pass device to causal_mask)",
)
def _device_ignored(cache, batch, q_len, device):
    kv_len = cache.attention_mask.size(1)
    mask = rosetrainer.model.causal_mask(q_len, kv_len)  # the mistake: no device
    return cache.position_ids, rosetrainer.model.padding_mask(mask, cache.attention_mask)


@known(
    "15",
    "right in eager mode, but the graph exported at the example's shapes breaks "
    "at others: something in it is fixed to the example's shapes (a length read "
    "as a Python number, int(...), is the usual cause: the trace turns it into a "
    "constant; keep the tensor's .size(), which stays a symbol)",
)
def _baked_length(cache, batch, q_len, device):
    kv_len = int(cache.attention_mask.shape[1])  # a Python int: the graph keeps the example's
    mask = rosetrainer.model.causal_mask(q_len, kv_len, device)
    mask = rosetrainer.model.padding_mask(mask, cache.attention_mask.to(device))
    return cache.position_ids, mask.expand(batch, 1, q_len, kv_len).clone()


@known("15", "your mask ignores attention_mask: a padded row's queries read its padding slots")
def _no_padding(cache, batch, q_len, device):
    kv_len = cache.attention_mask.size(1)
    return cache.position_ids, rosetrainer.model.causal_mask(q_len, kv_len, device)


@known(
    "15",
    "you count positions from the past's length: a left-padded row's real tokens "
    "then stand as far right as its padding is long; take the graph's position_ids",
)
def _positions_from_past(cache, batch, q_len, device):
    kv_len = cache.attention_mask.size(1)
    mask = rosetrainer.model.padding_mask(
        rosetrainer.model.causal_mask(q_len, kv_len, device), cache.attention_mask
    )
    past = kv_len - q_len
    return torch.arange(past, kv_len, device=device)[None, :].expand(batch, q_len), mask


@known(
    "15",
    "your mask is aligned top-left (rows 0 .. q_len of the full triangle): with a "
    "past, the new queries get the rows of the oldest positions",
)
def _top_left(cache, batch, q_len, device):
    kv_len = cache.attention_mask.size(1)
    mask = torch.ones(kv_len, kv_len, dtype=torch.bool, device=device).tril()[:q_len]
    return cache.position_ids, rosetrainer.model.padding_mask(mask, cache.attention_mask)


# -- 15: export_prepare(cache, batch, q_len, device) ----------------------------------------


def _prepared(cache, q_len, device, mask=None, positions=None, padding=None):
    from rosetrainer.model import causal_mask, padding_mask

    kv_len = cache.attention_mask.size(1)
    mask = causal_mask(q_len, kv_len, device) if mask is None else mask
    padding = cache.attention_mask if padding is None else padding
    return cache.position_ids if positions is None else positions, padding_mask(mask, padding)


@mutant("15")
def padding_only(cache, batch, q_len, device):
    kv_len = cache.attention_mask.size(1)
    return _prepared(cache, q_len, device, mask=torch.ones(q_len, kv_len, dtype=torch.bool))


@mutant("15")
def graph_positions_from_zero(cache, batch, q_len, device):
    positions = torch.arange(q_len, device=device)[None, :].expand(batch, q_len)
    return _prepared(cache, q_len, device, positions=positions)


@mutant("15")
def mask_of_the_new_tokens(cache, batch, q_len, device):
    from rosetrainer.model import causal_mask

    mask = causal_mask(q_len, q_len, device)
    return _prepared(cache, q_len, device, padding=cache.attention_mask[:, -q_len:], mask=mask)


@mutant("15")
def inverted_mask(cache, batch, q_len, device):
    positions, mask = _prepared(cache, q_len, device)
    return positions, ~mask


@mutant("15")
def first_row_padding_for_all(cache, batch, q_len, device):
    padding = cache.attention_mask[:1].expand_as(cache.attention_mask)
    return _prepared(cache, q_len, device, padding=padding)


@mutant("15")
def positions_one_late(cache, batch, q_len, device):
    return _prepared(cache, q_len, device, positions=cache.position_ids + 1)


@alternative("15")
def mask_built_by_hand(cache, batch, q_len, device):
    kv_len = cache.attention_mask.size(1)
    causal = torch.ones(kv_len, kv_len, dtype=torch.bool, device=device).tril()[kv_len - q_len :]
    mask = causal[None, None] & cache.attention_mask[:, None, None, :].bool()
    return cache.position_ids, mask | ~mask.any(-1, keepdim=True)


# -- Written blind (issue 45) --


# WRONG: kv_len read as a Python int (int(size)): baked into the exported graph
@blind("15", known="baked_length")
def int_kv_len(cache: ExportCache, batch, q_len, device):
    kv_len = int(cache.attention_mask.size(1))
    return cache.position_ids, padding_mask(
        causal_mask(q_len, kv_len, device), cache.attention_mask
    )


# WRONG: kv_len computed as q_len + row 0's first position (a Python number read out of a
# tensor; wrong with padding)
@blind("15")
def kv_len_from_position(cache: ExportCache, batch, q_len, device):
    kv_len = q_len + int(cache.position_ids[0, 0])
    return cache.position_ids, padding_mask(
        causal_mask(q_len, kv_len, device), cache.attention_mask
    )


# WRONG: mask is causal only: padding slots not masked
@blind("15", known="no_padding")
def no_padding(cache: ExportCache, batch, q_len, device):
    return cache.position_ids, causal_mask(q_len, cache.attention_mask.size(1), device)
