"""Chapter 07: per-row positions of a left-padded batch count real tokens only."""

from __future__ import annotations

import torch


def padded_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """(batch, slots) long positions for a left-padded batch.

    attention_mask: (batch, slots), 1 for a real token, 0 for left padding. Each row's
    tokens must stand where they would stand in that row alone; padding slots need a
    valid position too, though nothing reads what they compute.
    """
    # Real tokens so far, minus one: a row's first real token is at 0. Padding slots
    # would get -1, which has no embedding; they get 0 (their output is never read).
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
