"""Chapter 18: where the rolling cache keeps the key of position `pos`."""

from __future__ import annotations

import torch


def rolling_slot(pos: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    # The first `sinks` positions keep a slot each, for good; every later position goes
    # round the `window` slots after them, taking the slot of the position W before it.
    return torch.where(pos < sinks, pos, sinks + (pos - sinks) % window)
