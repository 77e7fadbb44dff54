"""Chapter 17: asymmetric group quantization (keys grouped per channel, values per token)."""

from __future__ import annotations

import torch

from roseinfer.cache.quantized import Quantized, _to_float16


def quantize(x: torch.Tensor, bits: int, group_size: int, dim: int) -> Quantized:
    """x in groups of `group_size` consecutive numbers along `dim`, each group as codes.

    Each group keeps a float16 `zero` (its minimum) and `scale`, and each number an
    integer code in 0 .. 2**bits - 1 (uint8, one per number, x's shape) such that
    zero + code * scale reads it back within scale / 2. Round zero down and scale up
    when storing them in float16 (`_to_float16(t, -inf)` / `(t, +inf)`), so no number
    falls outside its group's range. A group of equal numbers has scale 0. scale and
    zero have x's shape with `dim` divided by group_size. The cache calls it with
    dim = 2 (time) for keys, so each channel is a group of its own, and dim = 3 for values.
    """
    levels = 2**bits - 1
    # dim last, then split into (n_groups, group_size): each group on the last axis.
    groups = x.float().movedim(dim, -1).unflatten(-1, (-1, group_size))
    zero = _to_float16(groups.amin(-1, keepdim=True), -float("inf"))
    scale = _to_float16((groups.amax(-1, keepdim=True) - zero.float()) / levels, float("inf"))
    divisor = torch.where(scale == 0, 1.0, scale.float())
    codes = ((groups - zero.float()) / divisor).round().clamp(0, levels).to(torch.uint8)
    return Quantized(
        codes.flatten(-2).movedim(-1, dim),
        scale.squeeze(-1).movedim(-1, dim),
        zero.squeeze(-1).movedim(-1, dim),
    )


# `rose-course hint 17` gives these one at a time, the idea first and the near-code
# last (`rose-course check 17` counts how many were used); the stub leaves them out.
HINTS = (
    "Put dim last and cut it into groups: x.float().movedim(dim, -1).unflatten(-1, (-1, "
    "group_size)); each group is then the last axis, and amin/amax(-1, keepdim=True) give "
    "its range.",
    "zero is the group's minimum, scale its range over 2**bits - 1 levels, each stored in "
    "float16 rounded the safe way (_to_float16: zero down, scale up); a code is round((x - "
    "zero) / scale) clamped to 0 .. 2**bits - 1, as uint8. Divide by 1 where the scale is "
    "0.",
    "Move the axes back: codes.flatten(-2).movedim(-1, dim); scale and zero drop their last "
    "axis (squeeze(-1)) before .movedim(-1, dim).",
)
