"""Chapter 09: where the model's view begins, cut back to `keep` tokens when it is full."""

from __future__ import annotations

# The reference is rose's own piece (roseinfer/request/rows.py); the stub leaves this import out,
# with the body below.
from roseinfer.request.rows import window_start as rose_window_start


def window_start(start: int, seq_len: int, block_size: int, keep: int) -> int:
    """Where the model's view of the sequence begins after this step.

    The view is tokens start .. seq_len of the sequence; the model has learned positions
    for block_size tokens only. While the view fits, it stays; when it holds one token
    too many, it is cut back to its last `keep` tokens (which are then re-prefilled).
    """
    return rose_window_start(start, seq_len, block_size, keep)


# `rose-course hint 09` gives these one at a time, the idea first and the near-code
# last (`rose-course check 09` counts how many were used); the stub leaves them out.
HINTS = (
    "The view is tokens start .. seq_len; while it fits in block_size positions nothing changes.",
    "When seq_len - start exceeds block_size, cut the view back to its last keep tokens: it "
    "then starts at seq_len - keep.",
)
