"""Chapter 17's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rosecourse.exercises.answers import alternative, blind, known, mutant
from roseinfer.cache.quantized import Quantized, _to_float16, quantize

# -- the known mistakes: the check names each one it meets (answers.known) ----------


def _recoded(x, bits, group_size, dim, levels: int, rounding: Callable) -> Quantized:
    """Asymmetric groups as the reference, with another number of levels or rounding."""
    groups = x.float().movedim(dim, -1).unflatten(-1, (-1, group_size))
    zero = groups.amin(-1, keepdim=True).to(torch.float16)
    scale = ((groups.amax(-1, keepdim=True) - zero.float()) / levels).to(torch.float16)
    codes = rounding((groups - zero.float()) / scale.float().clamp(min=1e-8)).clamp(0, levels)
    return Quantized(
        codes.to(torch.uint8).flatten(-2).movedim(-1, dim),
        scale.squeeze(-1).movedim(-1, dim),
        zero.squeeze(-1).movedim(-1, dim),
    )


@known(
    "17",
    "you group along the last axis whatever `dim` says: keys are grouped along "
    "time (per channel), so each channel's outlier gets a scale of its own",
)
def _last_dim_always(x, bits, group_size, dim):
    return quantize(x, bits, group_size, x.dim() - 1)


@known(
    "17",
    "your groups are symmetric around 0 with unsigned codes: every negative number "
    "clamps to code 0; store the group's minimum as zero (asymmetric)",
)
def _symmetric(x, bits, group_size, dim):
    q = quantize(x, bits, group_size, dim)
    levels = 2**bits - 1
    groups = x.float().movedim(dim, -1).unflatten(-1, (-1, group_size))
    scale = (groups.abs().amax(-1, keepdim=True) / levels).to(torch.float16)
    codes = (groups / scale.float().clamp(min=1e-8)).round().clamp(0, levels).to(torch.uint8)
    return q._replace(
        codes=codes.flatten(-2).movedim(-1, dim),
        scale=scale.squeeze(-1).movedim(-1, dim),
        zero=torch.zeros_like(q.zero),
    )


@known(
    "17",
    "you truncate (floor) where rounding is right: every number reads back below "
    "itself, off by up to a whole scale, not half",
)
def _truncates(x, bits, group_size, dim):
    return _recoded(x, bits, group_size, dim, 2**bits - 1, torch.floor)


@known(
    "17",
    "your codes run 0 .. 2**bits, one level too many: the top code does not fit "
    "in `bits` bits (int4 packs two codes a byte)",
)
def _one_level_too_many(x, bits, group_size, dim):
    return _recoded(x, bits, group_size, dim, 2**bits, torch.round)


@known(
    "17",
    "you round scale to the nearest float16, not up: where it rounds down, zero + "
    "(2**bits - 1) * scale falls short of the group's largest number, which lies "
    "outside its group's range (round scale up: _to_float16(t, float('inf')))",
)
def _scale_to_nearest(x, bits, group_size, dim):
    levels = 2**bits - 1
    groups = x.float().movedim(dim, -1).unflatten(-1, (-1, group_size))
    zero = _to_float16(groups.amin(-1, keepdim=True), -float("inf"))
    scale = ((groups.amax(-1, keepdim=True) - zero.float()) / levels).half()  # to nearest
    divisor = torch.where(scale == 0, 1.0, scale.float())
    codes = ((groups - zero.float()) / divisor).round().clamp(0, levels).to(torch.uint8)
    return Quantized(
        codes.flatten(-2).movedim(-1, dim),
        scale.squeeze(-1).movedim(-1, dim),
        zero.squeeze(-1).movedim(-1, dim),
    )


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
