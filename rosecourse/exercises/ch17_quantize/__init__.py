"""Chapter 17's exercise: group quantization (keys per channel, values per token).

The learner's function replaces the quantized cache's quantize.

The contract is the docstring of rosecourse/exercises/ch17_quantize/reference.py.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from unittest import mock

import torch

import roseinfer.cache.quantized
import roseinfer.cache.rolling
import roseinfer.loops.generate
import roseinfer.request.rows
import roseinfer.request.sampling
from rosecourse.demo import (
    PROMPT,
)
from rosecourse.exercises.common import (
    CheckResult,
    Exercise,
    KnownWrong,
    Probe,
    check,
    encoded,
    oracle_model,
    outcome,
)
from roseinfer.cache.quantized import (
    Quantized,
    _to_float16,
    dequantize,
    make_kv_cache,
    quantize,
)
from roseinfer.loops.generate import generate
from roseinfer.request.sampling import SamplingParams


def _quantize_probe(fn: Callable) -> Probe:
    """Not the codes themselves (float16 rounding may differ by a code): the shapes and
    dtypes, the code range, and how far each number is read back from itself.

    The numbers hold an outlier channel (as keys do), a group just above 1000 whose
    minimum float16 cannot hold (rounded to nearest, the zero lands above it), groups of
    equal numbers (one float16 holds exactly: scale 0, not a small one) and a group near
    float16's largest numbers.
    """
    x = torch.randn(1, 2, 8, 8, generator=torch.Generator().manual_seed(0)) * 3
    x[..., 3] += 20.0
    x[0, 0, 0] = torch.linspace(1000.3, 1001.0, 8)
    x[0, 0, 1] = 5.1  # (not a float16 number: its zero rounds down, its scale is not 0)
    x[0, 1, 5] = 2.5  # (a float16 number: zero is it, and the contract's scale is 0)
    x[0, 1, 2] = torch.linspace(-65000.0, 60000.0, 8)
    half = x.half()
    ulp = (torch.nextafter(half, torch.full_like(half, torch.inf)) - half).float()

    def summary(bits: int, group_size: int, dim: int) -> object:
        q = fn(x.clone(), bits, group_size, dim)
        back = dequantize(q, group_size, dim, torch.float32)
        scale = q.scale.float().repeat_interleave(group_size, dim)
        # Within half a scale, up to float32 rounding; a scale of 0 reads back its zero,
        # the group's number rounded down to float16.
        bound = scale / 2 + 1e-6 * (1 + x.abs()) + torch.where(scale == 0, ulp, 0.0)
        outside = ((back - x).abs() > bound).nonzero()
        zero = q.zero.float().repeat_interleave(group_size, dim)
        groups = x.movedim(dim, -1).unflatten(-1, (-1, group_size))
        low = groups.amin(-1)  # (..., groups): a group of one number float16 holds exactly
        equal = (groups.amax(-1) == low) & (low.half().float() == low)
        top, tol = zero + (2**bits - 1) * scale, 1e-6 * (1 + x.abs())
        first = "none"
        if len(outside):
            at = tuple(outside[0].tolist())
            first = (
                f"x{list(at)} = {x[at]:.6g} reads back as {back[at]:.6g} (scale {scale[at]:.4g})"
            )
        return {
            "codes": (tuple(q.codes.shape), q.codes.dtype),
            "scale and zero": (tuple(q.scale.shape), q.scale.dtype, tuple(q.zero.shape)),
            "codes above 2**bits - 1": int((q.codes.long() > 2**bits - 1).sum()),
            "the first number read back farther than scale / 2": first,
            "some number read back above itself": bool((back > x + 1e-6 * (1 + x.abs())).any()),
            # The stored zero and scale must cover the group: zero at or below its
            # minimum, zero + (2**bits - 1) * scale at or above its maximum.
            "numbers above zero + (2**bits - 1) * scale": int((x > top + tol).sum()),
            # The contract: a group of equal numbers has scale 0, not a small one (where
            # float16 holds the number: else its zero rounds down below it).
            "groups of one float16 number whose scale is not 0": int(
                (q.scale.float().movedim(dim, -1)[equal] != 0).sum()
            ),
        }

    cases = [(4, 4, 3), (8, 8, 2), (4, 2, 2), (2, 8, 3)]
    return {
        f"quantize(x, bits={b}, group_size={g}, dim={d})": outcome(lambda a=(b, g, d): summary(*a))
        for b, g, d in cases
    }


QUANT_NEW = 24


def _quantized_runs() -> list[tuple[str, Callable, Callable]]:
    prompt = encoded(PROMPT)

    def go(on_token: Callable[[int, int], None]) -> list[list[int]]:
        model = oracle_model()
        cache = make_kv_cache(model, kv_cache_dtype="int4", window=0, group_size=16)
        run = generate(model, list(prompt), GREEDY_QUANT, cache=cache, on_token=on_token)
        return [run.token_ids]

    @functools.cache
    def expected() -> list[tuple[int, ...]]:  # the real quantizer's run: the oracle here
        return [tuple(go(lambda row, token: None)[0])]

    return [("int4 keys per channel and values per token, no exact window", expected, go)]


GREEDY_QUANT = SamplingParams(max_tokens=QUANT_NEW, ignore_eos=True)


def _swap_quantize(fn: Callable) -> contextlib.AbstractContextManager:
    return mock.patch.object(roseinfer.cache.quantized, "quantize", fn)


def _last_dim_always(x, bits, group_size, dim):
    return quantize(x, bits, group_size, x.dim() - 1)


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


def _truncates(x, bits, group_size, dim):
    return _recoded(x, bits, group_size, dim, 2**bits - 1, torch.floor)


def _one_level_too_many(x, bits, group_size, dim):
    return _recoded(x, bits, group_size, dim, 2**bits, torch.round)


EXERCISE = Exercise(
    name="quantize",
    reference=quantize,
    probe=_quantize_probe,
    swapped_in=_swap_quantize,
    runs=_quantized_runs(),
    known_wrong=[
        KnownWrong(
            "last_dim_always",
            _last_dim_always,
            "you group along the last axis whatever `dim` says: keys are grouped along "
            "time (per channel), so each channel's outlier gets a scale of its own",
        ),
        KnownWrong(
            "symmetric",
            _symmetric,
            "your groups are symmetric around 0 with unsigned codes: every negative number "
            "clamps to code 0; store the group's minimum as zero (asymmetric)",
        ),
        KnownWrong(
            "truncates",
            _truncates,
            "you truncate (floor) where rounding is right: every number reads back below "
            "itself, off by up to a whole scale, not half",
        ),
        KnownWrong(
            "one_level_too_many",
            _one_level_too_many,
            "your codes run 0 .. 2**bits, one level too many: the top code does not fit "
            "in `bits` bits (int4 packs two codes a byte)",
        ),
        KnownWrong(
            "scale_to_nearest",
            _scale_to_nearest,
            "you round scale to the nearest float16, not up: where it rounds down, zero + "
            "(2**bits - 1) * scale falls short of the group's largest number, which lies "
            "outside its group's range (round scale up: _to_float16(t, float('inf')))",
        ),
    ],
    fallback="some number is not read back within half its group's scale, or lies "
    "outside its group's range (zero .. zero + (2**bits - 1) * scale)",
)


def check_quantize(fn: Callable) -> CheckResult:
    """Chapter 17: `quantize(x, bits, group_size, dim) -> Quantized(codes, scale, zero)`."""
    return check(EXERCISE, fn)
