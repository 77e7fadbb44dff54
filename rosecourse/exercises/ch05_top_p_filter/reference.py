"""Chapter 05: keep the smallest set of most likely tokens whose probability reaches p."""

from __future__ import annotations

import torch

# The reference is rose's own piece (roseinfer/request/sampling.py); the stub leaves this import out,
# with the body below.
from roseinfer.request.sampling import top_p_filter as rose_top_p_filter


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """`logits` with every token outside the nucleus set to -inf (the rest unchanged).

    logits: (..., vocab). The nucleus is the smallest set of most likely tokens whose
    probabilities (softmax of the logits) add up to at least p; ties are broken by
    token order. p >= 1 keeps everything. The check swaps this in for the sampler's.
    """
    return rose_top_p_filter(logits, p)


# `rose-course hint 05` gives these one at a time, the idea first and the near-code
# last (`rose-course check 05` counts how many were used); the stub leaves them out.
HINTS = (
    "Sort the tokens by probability, most likely first, and walk down the list adding up "
    "their probabilities: the nucleus is every token up to and including the one whose "
    "probability carries the sum to p.",
    "A token is kept when the mass of the tokens before it in that order is still below p: "
    "cumsum(probs) - probs < p. torch.sort(..., stable=True) keeps equal probabilities in "
    "token order.",
    "The decision is made in sorted order: put it back in vocabulary order with the sort's "
    "indices (`drop_sorted.scatter(-1, order, drop_sorted)`), then logits.masked_fill(drop, "
    "float('-inf')).",
)
