"""Chapter 18: where the rolling cache keeps the key of position `pos`."""

from __future__ import annotations

import torch

# The reference is rose's own piece (roseinfer/cache/rolling.py); the stub leaves this import out,
# with the body below.
from roseinfer.cache.rolling import rolling_slot as rose_rolling_slot


def rolling_slot(pos: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """The slot of each position in a rolling cache of `sinks + window` slots (same shape,
    integers a tensor can be indexed with: int64 or int32).

    The first `sinks` positions are the attention sinks: each keeps a slot of its own for
    good. Every later position takes one of the `window` slots after them, in turn, so
    that it overwrites the key of the position `window` before it (which no query reads
    any more), and never a sink's.
    """
    return rose_rolling_slot(pos, window, sinks)


# `rose-course hint 18` gives these one at a time, the idea first and the near-code
# last (`rose-course check 18` counts how many were used); the stub leaves them out.
HINTS = (
    "The first sinks positions keep a slot each, their own position; every later position "
    "takes the window's slots after the sinks in turn, wrapping around.",
    "For pos >= sinks the slot is sinks + (pos - sinks) % window; torch.where(pos < sinks, "
    "pos, ...) chooses per element.",
)
