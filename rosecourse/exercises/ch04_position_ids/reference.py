"""Chapter 04: the positions of q_len new tokens continue after past_len cached ones."""

from __future__ import annotations

import torch

# The reference is rose's own piece (rosetrainer/model.py); the stub leaves this import out,
# with the body below.
from rosetrainer.model import position_ids as rose_position_ids


def position_ids(past_len: int, q_len: int, device: torch.device | None = None) -> torch.Tensor:
    """(q_len,) long, on `device`: the positions of q_len new tokens fed after past_len
    cached ones.

    The check swaps this in for rosetrainer.model.position_ids.
    """
    return rose_position_ids(past_len, q_len, device)


# `rose-course hint 04` gives these one at a time, the idea first and the near-code
# last (`rose-course check 04` counts how many were used); the stub leaves them out.
HINTS = (
    "The cache holds past_len tokens at positions 0 .. past_len - 1; the new ones go on "
    "from there, one position each.",
    "torch.arange(past_len, past_len + q_len, device=device).",
)
