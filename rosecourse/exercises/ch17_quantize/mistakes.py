"""Chapter 17's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

import torch

from rosecourse.exercises.answers import alternative, blind, mutant
from roseinfer.cache.quantized import Quantized, _to_float16

# -- 17: quantize(x, bits, group_size, dim) ---------------------------------------------------


def _quantized(x, bits, group_size, dim, *, to_half=None, rounding=torch.round, **mistake):
    from roseinfer.cache.quantized import Quantized, _to_float16

    to_half = to_half or _to_float16
    levels = 2**bits - 1
    moved = x.float().movedim(dim, -1)
    if mistake.get("strided_groups"):  # every n-th number in a group, not n in a row
        groups = moved.unflatten(-1, (group_size, -1)).transpose(-1, -2)
    else:
        groups = moved.unflatten(-1, (-1, group_size))
    low = (
        groups.amax(-1, keepdim=True)
        if mistake.get("zero_at_max")
        else groups.amin(-1, keepdim=True)
    )
    zero = to_half(low, -float("inf"))
    base = low if mistake.get("unrounded_minimum") else zero.float()
    scale = to_half((groups.amax(-1, keepdim=True) - base) / levels, float("inf"))
    divisor = torch.where(scale == 0, 1.0, scale.float())
    codes = rounding((groups - zero.float()) / divisor).clamp(0, levels)
    codes = codes.to(torch.int64 if mistake.get("long_codes") else torch.uint8)
    if mistake.get("strided_groups"):
        codes = codes.transpose(-1, -2)
    return Quantized(
        codes.flatten(-2).movedim(-1, dim),
        scale.squeeze(-1).movedim(-1, dim),
        zero.squeeze(-1).movedim(-1, dim),
    )


def _nearest_half(t, direction):
    return t.to(torch.float16)


@mutant("17")
def float16_to_nearest(x, bits, group_size, dim):
    return _quantized(x, bits, group_size, dim, to_half=_nearest_half)


@mutant("17")
def rounded_up(x, bits, group_size, dim):
    return _quantized(x, bits, group_size, dim, rounding=torch.ceil)


@mutant("17")
def zero_at_the_maximum(x, bits, group_size, dim):
    return _quantized(x, bits, group_size, dim, zero_at_max=True)


@mutant("17")
def strided_groups(x, bits, group_size, dim):
    return _quantized(x, bits, group_size, dim, strided_groups=True)


@mutant("17")
def scale_from_the_unrounded_minimum(x, bits, group_size, dim):
    return _quantized(x, bits, group_size, dim, unrounded_minimum=True)


@mutant("17")
def codes_in_int64(x, bits, group_size, dim):
    return _quantized(x, bits, group_size, dim, long_codes=True)


@alternative("17")
def quantized_as_written_out(x, bits, group_size, dim):
    return _quantized(x, bits, group_size, dim)


# -- Written blind (issue 45) --


def _blind_17(
    x, bits, group_size, dim, levels=None, rounding=torch.round, scale_up=True, along=None
) -> Quantized:
    levels = 2**bits - 1 if levels is None else levels
    dim = dim if along is None else along
    xm = x.float().movedim(dim, -1)
    shape = xm.shape
    g = xm.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    zero = _to_float16(g.amin(-1, keepdim=True), -float("inf"))
    spread = (g.amax(-1, keepdim=True) - zero.float()) / levels
    scale = _to_float16(spread, float("inf")) if scale_up else spread.half()
    div = torch.where(scale == 0, torch.ones_like(scale, dtype=torch.float32), scale.float())
    codes = rounding((g - zero.float()) / div).clamp(0, min(levels, 2**bits - 1))
    codes = codes.to(torch.uint8).reshape(shape).movedim(-1, dim)
    return Quantized(codes, scale.squeeze(-1).movedim(-1, dim), zero.squeeze(-1).movedim(-1, dim))


# WRONG: codes truncated (floor) instead of rounded
@blind("17")
def floor_codes(x, bits, group_size, dim):
    return _blind_17(x, bits, group_size, dim, rounding=torch.floor)


# WRONG: groups always along the last dim (dim ignored)
@blind("17", known="last_dim_always")
def last_dim_always(x, bits, group_size, dim):
    return _blind_17(x, bits, group_size, dim, along=x.dim() - 1)


# WRONG: levels = 2**bits (not 2**bits - 1), codes clamped to 2**bits - 1
@blind("17")
def levels_2_pow_bits(x, bits, group_size, dim):
    return _blind_17(x, bits, group_size, dim, levels=2**bits)


# WRONG: scale rounded to nearest float16 (plain .half()), not up
@blind("17", known="scale_to_nearest")
def scale_nearest(x, bits, group_size, dim):
    return _blind_17(x, bits, group_size, dim, scale_up=False)


# WRONG: the scale clamped to at least 1e-6 (to avoid dividing by zero): a group of one
# number float16 holds gets a small scale where the contract's is 0 (a second blind batch)
@blind("17")
def scale_clamped_at_a_small_number(x, bits, group_size, dim):
    levels = 2**bits - 1
    groups = x.float().movedim(dim, -1).unflatten(-1, (-1, group_size))
    zero = _to_float16(groups.amin(-1, keepdim=True), -float("inf"))
    spread = (groups.amax(-1, keepdim=True) - zero.float()) / levels
    scale = _to_float16(spread.clamp_min(1e-6), float("inf"))
    codes = ((groups - zero.float()) / scale.float()).round().clamp(0, levels).to(torch.uint8)
    return Quantized(
        codes.flatten(-2).movedim(-1, dim),
        scale.squeeze(-1).movedim(-1, dim),
        zero.squeeze(-1).movedim(-1, dim),
    )
