"""Chapter 21: one decode query per head, grouped-query attention over the cache."""

from __future__ import annotations

import math

import torch


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None
) -> torch.Tensor:
    """The attention output of each query head's one new query, over every cached key.

    q: (B, n_head, 1, head_dim), one query per head (a decode step); k, v: (B, n_kv_head,
    kv_len, head_dim), with n_kv_head dividing n_head (a group of n_head // n_kv_head
    query heads shares each key/value head). Query head h reads key/value head
    h // (n_head // n_kv_head): heads 0 .. group - 1 the first, the next group the second.
    attn_mask: bool, True where the query may look, the same for every head of a row:
    (B, 1, 1, kv_len) (a left-padded batch) or (1, kv_len) (one row of the causal mask,
    for every row alike); None: every key. Returns (B, n_head, 1, head_dim) in v's dtype.
    The scores are scaled by 1 / sqrt(head_dim), and the softmax over the keys runs in
    float32 (any scores, however large, give finite weights). No copy of k or v is
    needed. The check swaps this in for rosetrainer.model.one_query_attention, where the
    model attends at a decode step.
    """
    batch, n_head, _, head_dim = q.shape
    n_kv_head = k.size(1)
    # Head h = g * group + i is query i of group g: a group's queries side by side.
    queries = q.reshape(batch, n_kv_head, n_head // n_kv_head, head_dim)
    scores = queries @ k.transpose(2, 3) / math.sqrt(head_dim)  # (B, n_kv, group, kv_len)
    if attn_mask is not None:  # broadcasts over the heads and their groups
        scores = scores.masked_fill(attn_mask.logical_not(), -math.inf)
    # softmax subtracts each row's largest score first: exp never overflows.
    weights = scores.float().softmax(dim=-1).to(v.dtype)
    return (weights @ v).reshape(batch, n_head, 1, head_dim)


# `rose-course hint 21` gives these one at a time, the idea first and the near-code
# last (`rose-course check 21` counts how many were used); the stub leaves them out.
HINTS = (
    "Query head h uses key/value head h // group, group = n_head // n_kv_head: heads 0 .. "
    "group - 1 share the first. Each head's output is the usual softmax(q . k / sqrt(d)) "
    "weighted sum of its own key/value head's values.",
    "Without copying k and v: read q (B, n_head, 1, d) as (B, n_kv_head, group, d), a "
    "group's queries as the rows of one product with their key/value head's keys, then "
    "read the output back as (B, n_head, 1, d). Either shape of mask broadcasts over that.",
    "Near-code:\n"
    "    scores = q.view(B, n_kv, group, d) @ k.transpose(-2, -1) / math.sqrt(d)\n"
    "    scores = scores.masked_fill(~attn_mask, float('-inf'))  # when there is a mask\n"
    "    weights = torch.softmax(scores.float(), dim=-1).to(v.dtype)\n"
    "    return (weights @ v).view(B, n_head, 1, d)",
)
