"""Chapter 15's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

import torch

from rosecourse.exercises.answers import alternative, blind, mutant
from roseinfer.loops.export_onnx import ExportCache
from rosetrainer.model import causal_mask, padding_mask

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
