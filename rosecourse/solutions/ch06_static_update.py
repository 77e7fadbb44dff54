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
    # In place: the buffers themselves change, so the next step
    # finds these slots written. Attention reads every slot; the mask hides the unwritten.
    k_buffer[:, :, input_pos] = k_new
    v_buffer[:, :, input_pos] = v_new
    return k_buffer, v_buffer
