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
from rosecourse.exercises.answers import known_mistakes
from rosecourse.exercises.common import (
    CheckResult,
    Exercise,
    Probe,
    check,
    encoded,
    oracle_model,
    outcome,
)
from roseinfer.cache.quantized import (
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


EXERCISE = Exercise(
    name="quantize",
    reference=quantize,
    probe=_quantize_probe,
    swapped_in=_swap_quantize,
    runs=_quantized_runs(),
    known_wrong=known_mistakes(__name__),
    fallback="some number is not read back within half its group's scale, or lies "
    "outside its group's range (zero .. zero + (2**bits - 1) * scale)",
)


def check_quantize(fn: Callable) -> CheckResult:
    """Chapter 17: `quantize(x, bits, group_size, dim) -> Quantized(codes, scale, zero)`."""
    return check(EXERCISE, fn)
