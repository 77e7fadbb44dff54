"""Chapter 04: the positions of q_len new tokens continue after past_len cached ones."""

from __future__ import annotations

import torch


def position_ids(past_len: int, q_len: int, device: torch.device | None = None) -> torch.Tensor:
    """(q_len,) long: the positions of q_len new tokens fed after past_len cached ones.

    The check swaps this in for rosetrainer.model.position_ids.
    """
    return torch.arange(past_len, past_len + q_len, device=device)
