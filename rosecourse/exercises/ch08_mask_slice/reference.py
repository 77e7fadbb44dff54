"""Chapter 08: a chunk's rows of one precomputed (block_size, block_size) causal mask."""

from __future__ import annotations

import torch


def mask_slice(bias: torch.Tensor, past_len: int, q_len: int) -> torch.Tensor:
    """A chunk's causal mask, cut out of one precomputed (block_size, block_size) mask.

    bias: the full lower-triangular bool mask, as nanoGPT registers it; the chunk's
    q_len queries follow past_len cached tokens. Return the (q_len, past_len + q_len)
    part of bias that says what these queries may see.
    """
    # The chunk's queries stand at past_len .. past_len + q_len - 1 (their rows) and
    # attend over every key so far, 0 .. past_len + q_len - 1 (the columns).
    return bias[past_len : past_len + q_len, : past_len + q_len]


# `rose-course hint 08` gives these one at a time, the idea first and the near-code
# last (`rose-course check 08` counts how many were used); the stub leaves them out.
HINTS = (
    "The chunk's queries stand at positions past_len .. past_len + q_len - 1: those are the "
    "rows of the full mask it needs.",
    "They attend over every key so far, positions 0 .. past_len + q_len - 1: those are the "
    "columns. bias[past_len : past_len + q_len, : past_len + q_len].",
)
