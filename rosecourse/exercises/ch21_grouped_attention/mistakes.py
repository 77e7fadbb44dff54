"""Chapter 21's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from rosecourse.exercises.answers import alternative, mutant

# -- 21: grouped_attention(q, k, v, attn_mask) --------------------------------------------


def _grouped(q, k, v, attn_mask, scale=None, fill=-math.inf, keep_float32=False, mask=None):
    """The contract's attention (a group's queries as a view), with one part swapped: the
    scale, what a hidden key's score becomes, the output's dtype, how the mask is read."""
    b, n_head, _, d = q.shape
    scores = q.view(b, k.size(1), -1, d) @ k.transpose(-2, -1) * (scale or d**-0.5)
    if attn_mask is not None:
        scores = scores.masked_fill(mask(attn_mask) if mask else ~attn_mask, fill)
    weights = torch.softmax(scores.float(), dim=-1)
    out = weights @ v.float() if keep_float32 else weights.to(v.dtype) @ v
    return out.reshape(b, n_head, 1, d)


@mutant("21")
def scaled_by_head_dim_not_its_root(q, k, v, attn_mask):
    return _grouped(q, k, v, attn_mask, scale=1 / q.size(-1))


@mutant("21")
def hidden_keys_scored_zero(q, k, v, attn_mask):
    return _grouped(q, k, v, attn_mask, fill=0.0)


@mutant("21")
def mask_read_upside_down(q, k, v, attn_mask):
    return _grouped(q, k, v, attn_mask, mask=lambda allowed: allowed)


@mutant("21")
def output_left_in_float32(q, k, v, attn_mask):
    return _grouped(q, k, v, attn_mask, keep_float32=True)


@mutant("21")
def group_of_three_hard_coded(q, k, v, attn_mask):
    # Chapter 21's model has groups of 3 (6 heads over 2), and so does this view.
    b, n_head, _, d = q.shape
    scores = q.view(b, -1, 3, d) @ k.transpose(-2, -1) / math.sqrt(d)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -math.inf)
    return (torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v).reshape(b, n_head, 1, d)


@mutant("21")
def first_key_value_head_for_all(q, k, v, attn_mask):
    return _grouped(q, k[:, :1].expand_as(k), v[:, :1].expand_as(v), attn_mask)


@mutant("21")
def last_key_left_out(q, k, v, attn_mask):
    mask = None if attn_mask is None else attn_mask[..., :-1]
    return _grouped(q, k[:, :, :-1], v[:, :, :-1], mask)


@mutant("21")
def mask_of_the_first_row_for_every_row(q, k, v, attn_mask):
    return _grouped(q, k, v, None if attn_mask is None else attn_mask[:1])


@alternative("21")
def both_repeat_interleaved(q, k, v, attn_mask):
    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


@alternative("21")
def sdpa_with_groups(q, k, v, attn_mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)


@alternative("21")
def by_einsum(q, k, v, attn_mask):
    b, n_head, _, d = q.shape
    queries = q.view(b, k.size(1), n_head // k.size(1), d)
    scores = torch.einsum("bkgd,bksd->bkgs", queries, k) / math.sqrt(d)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -math.inf)
    weights = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.einsum("bkgs,bksd->bkgd", weights, v).reshape(b, n_head, 1, d)


@alternative("21")
def head_by_head(q, k, v, attn_mask):
    group = q.size(1) // k.size(1)
    outputs = []
    for h in range(q.size(1)):
        scores = q[:, h] @ k[:, h // group].transpose(-2, -1) / math.sqrt(q.size(-1))
        if attn_mask is not None:  # (B, 1, 1, S) or (1, S): (B or 1, 1, S), as scores
            scores = scores.masked_fill(~attn_mask.reshape(-1, 1, k.size(2)), -math.inf)
        weights = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        outputs.append(weights @ v[:, h // group])
    return torch.stack(outputs, dim=1)
