"""Chapter 00: causal self-attention over a whole sequence, as a training step computes it."""

from __future__ import annotations

import math

import torch


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Each position's output: the values of the positions it may see, weighted by attention.

    q, k, v: (batch, n_head, T, head_dim), the T positions of one sequence (no past).
    Returns (batch, n_head, T, head_dim). Position i may see positions 0 .. i only; the
    scores are scaled as in "Attention Is All You Need", and each query's weights over
    the keys it sees sum to 1. The check swaps this in for the model's attention when it
    runs without a cache, and decodes greedily (uncached) with it.
    """
    T = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    # Query i (a row) may read key j (a column) only when j <= i: the lower triangle.
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return weights @ v


# `rose-course hint 00` gives these one at a time, the idea first and the near-code
# last (`rose-course check 00` counts how many were used); the stub leaves them out.
HINTS = (
    "Attention mixes values: each position's output is a weighted average of the value "
    "vectors, its weights a softmax over its scores against the keys. Causal: the weights "
    "of every later position are 0.",
    "scores = q @ k.transpose(-2, -1) / sqrt(head_dim), (batch, n_head, T, T): row i is "
    "query i, column j key j. Set the scores where j > i to -inf before the softmax over "
    "the last axis (exp(-inf) is 0).",
    "Near-code:\n"
    "    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()\n"
    "    weights = torch.softmax(scores.masked_fill(~allowed, float('-inf')), dim=-1)\n"
    "    return weights @ v",
)
