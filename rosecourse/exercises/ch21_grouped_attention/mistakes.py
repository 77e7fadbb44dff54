"""Chapter 21's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from rosecourse.exercises.answers import alternative, known, mutant

# -- the known mistakes: the check names each one it meets (answers.known) ----------


def _masked(scores: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
    return scores if attn_mask is None else scores.masked_fill(~attn_mask, -math.inf)


def _copied_heads(q, k, v, attn_mask, spread_k, spread_v):
    """Attention with each key/value head copied out for its query heads by `spread_*`."""
    group = q.size(1) // k.size(1)
    k, v = spread_k(k, group), spread_v(v, group)
    scores = _masked(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), attn_mask)
    return (torch.softmax(scores.float(), dim=-1).to(v.dtype)) @ v


def _tiled(t: torch.Tensor, group: int) -> torch.Tensor:
    return t.repeat(1, group, 1, 1)


def _interleaved(t: torch.Tensor, group: int) -> torch.Tensor:
    return t.repeat_interleave(group, dim=1)


def _by_view(q, k, v, attn_mask, scale=None, softmax_dim=-1, softmax=None):
    """The view form, with one part replaceable: the scale, the softmax's axis, the softmax."""
    batch, n_head, _, head_dim = q.shape
    n_kv_head = k.size(1)
    queries = q.view(batch, n_kv_head, n_head // n_kv_head, head_dim)
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    scores = _masked(queries @ k.transpose(-2, -1) * scale, attn_mask).float()
    weights = (softmax or torch.softmax)(scores, softmax_dim).to(v.dtype)
    return (weights @ v).view(batch, n_head, 1, head_dim)


def _exp_over_sum(scores: torch.Tensor, dim: int) -> torch.Tensor:
    e = scores.exp()
    return e / e.sum(dim, keepdim=True)


@known(
    "21",
    "your query heads read the wrong key/value heads: `repeat` tiles the heads "
    "(0, 1, 0, 1, ...), so query head h reads head h % n_kv_head; head h's is "
    "h // group (0, 0, 0, 1, 1, 1: `repeat_interleave`, or q viewed as groups)",
)
def _heads_in_wrong_order(q, k, v, attn_mask):
    return _copied_heads(q, k, v, attn_mask, _tiled, _tiled)


@known(
    "21",
    "keys and values are copied out in different orders (keys with "
    "`repeat_interleave`, values with `repeat`): a query head weighs its own "
    "key/value head's keys but sums another head's values",
)
def _values_tiled(q, k, v, attn_mask):
    return _copied_heads(q, k, v, attn_mask, _interleaved, _tiled)


@known(
    "21",
    "the query heads are grouped the wrong way round: q.view(B, group, n_kv_head, d)"
    ".transpose(1, 2) puts heads g, g + n_kv_head, ... in group g, and the outputs "
    "come back in another order; head h belongs to group h // group, so view q as "
    "(B, n_kv_head, group, d)",
)
def _queries_regrouped_wrong(q, k, v, attn_mask):
    batch, n_head, _, head_dim = q.shape
    n_kv_head = k.size(1)
    queries = q.view(batch, n_head // n_kv_head, n_kv_head, head_dim).transpose(1, 2)
    scores = _masked(queries @ k.transpose(-2, -1) / math.sqrt(head_dim), attn_mask)
    weights = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return (weights @ v).reshape(batch, n_head, 1, head_dim)


@known(
    "21",
    "the scores are divided by sqrt(group * head_dim): scale by 1 / sqrt(head_dim), "
    "the size of one head, whatever the group",
)
def _scaled_by_group_width(q, k, v, attn_mask):
    group = q.size(1) // k.size(1)
    return _by_view(q, k, v, attn_mask, scale=1 / math.sqrt(group * q.size(-1)))


@known(
    "21",
    "the scores are divided by sqrt(n_head * head_dim), the model's width: scale "
    "by 1 / sqrt(head_dim), the size of one head",
)
def _scaled_by_n_embd(q, k, v, attn_mask):
    return _by_view(q, k, v, attn_mask, scale=1 / math.sqrt(q.size(1) * q.size(-1)))


@known(
    "21",
    "the softmax runs over a group's query heads, not over the keys: each query's "
    "weights over its keys must sum to 1 (the last axis of the scores)",
)
def _softmax_over_group(q, k, v, attn_mask):
    return _by_view(q, k, v, attn_mask, softmax_dim=-2).nan_to_num()


@known(
    "21",
    "the queries of a group are averaged: every head of a group gives the same "
    "output; each query head keeps its own query, only the keys and values are shared",
)
def _group_mean_query(q, k, v, attn_mask):
    batch, n_head, _, head_dim = q.shape
    group = n_head // k.size(1)
    mean = q.view(batch, k.size(1), group, head_dim).mean(2, keepdim=True)
    return _by_view(mean.expand(-1, -1, group, -1).reshape(q.shape), k, v, attn_mask)


@known(
    "21",
    "exp(scores) / sum overflows: a score past about 88 is inf in float32, and "
    "inf / inf is NaN; subtract each row's largest score first (torch.softmax does)",
)
def _no_max_subtraction(q, k, v, attn_mask):
    return _by_view(q, k, v, attn_mask, softmax=_exp_over_sum)


@known(
    "21",
    "attn_mask is ignored: queries read keys they may not see (another row's "
    "padding, the cache's slots not yet written); set their scores to -inf",
)
def _mask_ignored(q, k, v, attn_mask):
    return _by_view(q, k, v, None)


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
