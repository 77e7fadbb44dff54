"""Chapter 18's exercise: the rolling cache's slot for each position.

The learner's function replaces roseinfer.cache.rolling.rolling_slot far past the
window.

The contract is the docstring of rosecourse/exercises/ch18_rolling_slot/reference.py.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

import roseinfer.cache.quantized
import roseinfer.cache.rolling
import roseinfer.loops.generate
import roseinfer.request.rows
import roseinfer.request.sampling
from rosecourse.demo import (
    WINDOWED_MODEL_CONFIG,
    wide_random_init,
)
from rosecourse.exercises.answers import known_mistakes
from rosecourse.exercises.common import (
    CHUNK,
    CheckResult,
    Exercise,
    Probe,
    check,
    outcome,
    patched,
)
from roseinfer.cache.rolling import RollingKVCache, rolling_slot
from roseinfer.loops.generate import generate
from roseinfer.request.sampling import SamplingParams
from rosetrainer.model import GPT

# (window, sinks): chapter 18's model (rosecourse.demo), and one with another window and
# more sinks, so that neither number can be a constant.
WINDOWS = [
    (WINDOWED_MODEL_CONFIG.sliding_window, WINDOWED_MODEL_CONFIG.attention_sinks),
    (5, 3),
]


@functools.cache
def windowed_model(window: int, sinks: int) -> GPT:
    """Chapter 18's rotary model with this window and these sinks, seeded."""
    config = dataclasses.replace(
        WINDOWED_MODEL_CONFIG, sliding_window=window, attention_sinks=sinks
    )
    return wide_random_init(GPT(config), 0)


# A prompt of token ids (the windowed model's vocabulary is 512), and a run four contexts long.
WINDOWED_PROMPT = (5, 17, 3, 250, 99, 7)
WINDOWED_NEW_TOKENS = 4 * WINDOWED_MODEL_CONFIG.block_size


@functools.cache
def windowed_reference(window: int, sinks: int) -> tuple[int, ...]:
    """The uncached greedy run under the banded mask: the whole sequence at every step."""
    params = SamplingParams(max_tokens=WINDOWED_NEW_TOKENS, ignore_eos=True)
    model = windowed_model(window, sinks)
    run = generate(model, list(WINDOWED_PROMPT), params, use_cache=False)
    return tuple(run.token_ids)


def renumbered(slots: torch.Tensor, pos: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """`slots` renumbered in the order positions first use them: the sinks' among 0 .. S - 1
    and the window's among S .. S + W - 1 (a slot outside its range keeps its number).

    The contract says which positions share a slot and which slots each part may use, not
    which slot comes first, so every answer that meets it reads here as the reference.
    """
    flat, positions, out = slots.flatten().tolist(), pos.flatten().tolist(), []
    numbers: dict[tuple[bool, int], int] = {}
    for p, slot in zip(positions, flat, strict=True):
        is_sink = p < sinks
        low, high = (0, sinks) if is_sink else (sinks, sinks + window)
        if low <= slot < high:
            first = sum(key[0] == is_sink for key in numbers)
            slot = numbers.setdefault((is_sink, slot), low + first)
        out.append(slot)
    return torch.tensor(out, dtype=slots.dtype).view(slots.shape)


def _slot_probe(fn: Callable) -> Probe:
    """Slots renumbered as the reference numbers them (see `renumbered`), for several
    windows and sink counts, and positions in a (2, 10) tensor."""

    def slots(pos: torch.Tensor, window: int, sinks: int) -> object:
        got = fn(pos.clone(), window, sinks)
        if not isinstance(got, torch.Tensor) or got.shape != pos.shape or got.is_floating_point():
            return got
        if got.dtype == torch.int32:  # indexes as int64 does: the contract asks for either
            got = got.long()
        return renumbered(got, pos, window, sinks)

    cases = [(30, 8, 2), (30, 8, 0), (30, 5, 1), (30, 3, 3), (40, 16, 4)]
    probe = {
        f"rolling_slot(arange({n}), {w}, {s})": outcome(
            lambda n=n, w=w, s=s: slots(torch.arange(n), w, s)
        )
        for n, w, s in cases
    }
    grid = torch.arange(20).view(2, 10)
    probe["rolling_slot(arange(20).view(2, 10), 4, 2)"] = outcome(lambda: slots(grid, 4, 2))
    return probe


def _slot_runs() -> list[tuple[str, Callable, Callable]]:
    def go(window: int, sinks: int, chunk: int | None) -> Callable:
        def run(on_token: Callable[[int, int], None]) -> list[list[int]]:
            params = SamplingParams(max_tokens=WINDOWED_NEW_TOKENS, ignore_eos=True)
            model = windowed_model(window, sinks)
            result = generate(
                model, list(WINDOWED_PROMPT), params, cache=RollingKVCache(model),
                prefill_chunk=chunk, on_token=on_token,
            )  # fmt: skip
            return [result.token_ids]

        return run

    runs = []
    for (window, sinks), chunks in zip(WINDOWS, ((None, CHUNK), (None,)), strict=True):
        label = (
            f"{WINDOWED_NEW_TOKENS} tokens on the rolling cache (window {window}, {sinks} sinks)"
        )
        for chunk in chunks:
            runs.append(
                (
                    label + (f", prefill in chunks of {chunk}" if chunk else ""),
                    lambda window=window, sinks=sinks: [windowed_reference(window, sinks)],
                    go(window, sinks, chunk),
                )
            )
    return runs


EXERCISE = Exercise(
    name="rolling_slot",
    reference=rolling_slot,
    probe=_slot_probe,
    swapped_in=patched(roseinfer.cache.rolling, "rolling_slot"),
    dtypes=frozenset({"torch.int32"}),  # (the contract: int64 or int32)
    runs=_slot_runs(),
    known_wrong=known_mistakes(__name__),
    fallback="a key is overwritten while a query still needs it, or lands in no slot",
)


def check_rolling_slot(fn: Callable) -> CheckResult:
    """Chapter 18: `rolling_slot(pos, window, sinks) -> slots` (tensors of positions)."""
    return check(EXERCISE, fn)
