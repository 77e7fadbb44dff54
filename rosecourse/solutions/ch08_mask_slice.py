"""Chapter 08: a chunk's rows of one precomputed (block_size, block_size) causal mask."""

from __future__ import annotations

import torch


def mask_slice(bias: torch.Tensor, past_len: int, q_len: int) -> torch.Tensor:
    # The chunk's queries stand at past_len .. past_len + q_len - 1 (their rows) and
    # attend over every key so far, 0 .. past_len + q_len - 1 (the columns).
    return bias[past_len : past_len + q_len, : past_len + q_len]
