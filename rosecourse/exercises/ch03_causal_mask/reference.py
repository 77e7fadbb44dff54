"""Chapter 03: the causal mask of q_len new queries over kv_len keys, bottom-right aligned."""

from __future__ import annotations

import torch

# The reference is rose's own piece (rosetrainer/model.py); the stub leaves this import out,
# with the body below.
from rosetrainer.model import causal_mask as rose_causal_mask


def causal_mask(q_len: int, kv_len: int, device: torch.device | None = None) -> torch.Tensor:
    """(q_len, kv_len) bool, True where a query may look at a key.

    The q_len queries are the newest q_len of kv_len tokens (the others are the cached
    past); each may see every key at or before its own position. The check swaps this
    in for rosetrainer.model.causal_mask.
    """
    return rose_causal_mask(q_len, kv_len, device)


# `rose-course hint 03` gives these one at a time, the idea first and the near-code
# last (`rose-course check 03` counts how many were used); the stub leaves them out.
HINTS = (
    "The q_len queries are the last q_len of the kv_len positions: query i stands at "
    "position kv_len - q_len + i, and may see every key at or before it.",
    "Either keep the last q_len rows of the full (kv_len, kv_len) lower triangle "
    "(torch.ones(..., dtype=torch.bool).tril()), or compare positions: key_pos[None, :] <= "
    "query_pos[:, None].",
)
