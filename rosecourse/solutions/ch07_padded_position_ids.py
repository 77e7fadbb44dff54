"""Chapter 07: per-row positions of a left-padded batch count real tokens only."""

from __future__ import annotations

import torch


def padded_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    # Real tokens so far, minus one: a row's first real token is at 0. Padding slots
    # would get -1, which has no embedding; they get 0 (their output is never read).
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
