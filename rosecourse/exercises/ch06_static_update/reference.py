"""Chapter 06: write the new keys/values into their slots of the preallocated buffers."""

from __future__ import annotations

import torch


def static_update(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    input_pos: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the new keys/values into their slots of the preallocated buffers.

    k_buffer, v_buffer: (batch, n_head, max_len, head_dim), allocated once; input_pos:
    (q_len,) the slots of the new tokens; k_new, v_new: (batch, n_head, q_len, head_dim).
    The next call must find this call's slots written. Return the buffers the
    attention reads (all max_len slots; the mask hides the unwritten ones).
    """
    # In place: the buffers themselves change, so the next step
    # finds these slots written. Attention reads every slot; the mask hides the unwritten.
    k_buffer[:, :, input_pos] = k_new
    v_buffer[:, :, input_pos] = v_new
    return k_buffer, v_buffer


# `rose-course hint 06` gives these one at a time, the idea first and the near-code
# last (`rose-course check 06` counts how many were used); the stub leaves them out.
HINTS = (
    "The buffers are allocated once: each call writes the new keys and values into their "
    "slots of the buffers themselves, so the next call finds them there, and returns the "
    "whole buffers.",
    "Index the time axis with the slots and assign: k_buffer[:, :, input_pos] = k_new (the "
    "values alike), then return k_buffer, v_buffer. A new tensor (torch.cat, .clone()) "
    "would leave the buffers the next step reads unwritten.",
)
