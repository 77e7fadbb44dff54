"""Chapter 09: where the model's view begins, cut back to `keep` tokens when it is full."""

from __future__ import annotations


def window_start(start: int, seq_len: int, block_size: int, keep: int) -> int:
    window = seq_len - start  # the tokens the model would see
    if window > block_size:  # one too many for the learned positions: cut back
        return seq_len - keep
    return start
