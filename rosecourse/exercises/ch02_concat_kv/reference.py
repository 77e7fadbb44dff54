"""Chapter 02: keep the past keys/values and append the new ones."""

from __future__ import annotations

import torch

# The reference is rose's own piece (rosetrainer/model.py); the stub leaves this import out,
# with the body below.
from rosetrainer.model import concat_kv as rose_concat_kv


def concat_kv(
    layer_past: tuple[torch.Tensor, torch.Tensor] | None, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys/values the new tokens attend over: every cached one, then their own.

    layer_past: this layer's cached (k, v), or None before the first call; k, v: the new
    tokens', (batch, n_head, q_len, head_dim). Return (k_all, v_all), the past's tokens
    first, then the new ones, along the time axis. The check swaps this in for
    rosetrainer.model.concat_kv and decodes with a concatenating cache.
    """
    return rose_concat_kv(layer_past, k, v)


# `rose-course hint 02` gives these one at a time, the idea first and the near-code
# last (`rose-course check 02` counts how many were used); the stub leaves them out.
HINTS = (
    "The cache holds every earlier token's keys and values; the new tokens attend over all "
    "of those and their own, so the answer is the past followed by the new, along the time "
    "axis.",
    "Time is dim 2 of (batch, n_head, time, head_dim): torch.cat([past_k, k], dim=2), the "
    "values alike. Before the first call there is no past (layer_past is None): the new "
    "keys and values alone.",
)
