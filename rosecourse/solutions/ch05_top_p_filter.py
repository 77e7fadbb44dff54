"""Chapter 05: keep the smallest set of most likely tokens whose probability reaches p."""

from __future__ import annotations

import torch


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """`logits` with every token outside the nucleus set to -inf (the rest unchanged).

    logits: (..., vocab). The nucleus is the smallest set of most likely tokens whose
    probabilities (softmax of the logits) add up to at least p; ties are broken by
    token order. p >= 1 keeps everything. The check swaps this in for the sampler's.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep a token while the mass *before* it is below p: the crossing token stays.
    drop_sorted = torch.cumsum(probs, dim=-1) - probs >= p
    # The decision was made in sorted order; put it back in vocabulary order.
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
