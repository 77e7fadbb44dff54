"""Chapter 07: per-row positions of a left-padded batch count real tokens only."""

from __future__ import annotations

import torch

# The reference is rose's own piece (rosetrainer/model.py); the stub leaves this import out,
# with the body below.
from rosetrainer.model import padded_position_ids as rose_padded_position_ids


def padded_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """(batch, slots) long positions for a left-padded batch.

    attention_mask: (batch, slots), 1 for a real token, 0 for left padding. Each row's
    tokens must stand where they would stand in that row alone; padding slots need a
    valid position too, though nothing reads what they compute.
    """
    return rose_padded_position_ids(attention_mask)


# `rose-course hint 07` gives these one at a time, the idea first and the near-code
# last (`rose-course check 07` counts how many were used); the stub leaves them out.
HINTS = (
    "A row's first real token stands at position 0 however much padding is before it: a "
    "token's position counts the real tokens before it.",
    "attention_mask.long().cumsum(dim=-1) - 1 counts them. Padding slots would get -1, "
    "which no embedding has: .clamp(min=0) (what a padding slot computes is never read).",
)
