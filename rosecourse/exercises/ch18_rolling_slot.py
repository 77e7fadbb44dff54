"""Chapter 18's exercise: the rolling cache's slot for each position. The learner's function
replaces roseinfer.cache.rolling.rolling_slot far past the window.

The contract is the docstring of rosecourse/solutions/ch18_rolling_slot.py.
"""

from __future__ import annotations

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
from rosecourse.exercises.common import (
    CHUNK,
    CheckResult,
    Exercise,
    KnownWrong,
    check,
    outcome,
    patched,
)
from roseinfer.cache.rolling import RollingKVCache, rolling_slot
from roseinfer.loops.generate import generate
from roseinfer.request.sampling import SamplingParams
from rosetrainer.model import GPT


@functools.cache
def windowed_model() -> GPT:
    """Chapter 18's rotary model with a sliding window and sinks (rosecourse.demo)."""
    return wide_random_init(GPT(WINDOWED_MODEL_CONFIG), 0)


# A prompt of token ids (the windowed model's vocabulary is 512), and a run four contexts long.
WINDOWED_PROMPT = (5, 17, 3, 250, 99, 7)
WINDOWED_NEW_TOKENS = 4 * WINDOWED_MODEL_CONFIG.block_size


@functools.cache
def windowed_reference() -> tuple[int, ...]:
    """The uncached greedy run under the banded mask: the whole sequence at every step."""
    params = SamplingParams(max_tokens=WINDOWED_NEW_TOKENS, ignore_eos=True)
    run = generate(windowed_model(), list(WINDOWED_PROMPT), params, use_cache=False)
    return tuple(run.token_ids)


def _slot_probe(fn: Callable) -> list[object]:
    # (window, sinks): the chapter's (8, 2), no sinks, and one sink.
    pos = torch.arange(30)
    return [outcome(lambda w=w, s=s: fn(pos, w, s)) for w, s in ((8, 2), (8, 0), (5, 1))]


def _slot_runs() -> list[tuple[str, Callable, Callable]]:
    def go(chunk: int | None) -> Callable:
        def run(on_token: Callable[[int, int], None]) -> list[list[int]]:
            params = SamplingParams(max_tokens=WINDOWED_NEW_TOKENS, ignore_eos=True)
            model = windowed_model()
            result = generate(
                model, list(WINDOWED_PROMPT), params, cache=RollingKVCache(model),
                prefill_chunk=chunk, on_token=on_token,
            )  # fmt: skip
            return [result.token_ids]

        return run

    label = f"{WINDOWED_NEW_TOKENS} tokens on the rolling cache"
    expected = lambda: [windowed_reference()]  # noqa: E731
    return [
        (label, expected, go(None)),
        (f"{label}, prefill in chunks of {CHUNK}", expected, go(CHUNK)),
    ]


def _modulo_all_slots(pos, window, sinks):
    return pos % (window + sinks)


def _sinks_share_the_window(pos, window, sinks):
    return pos % window


def _last_slot_only(pos, window, sinks):
    return torch.where(pos < sinks, pos, torch.full_like(pos, sinks + window - 1))


EXERCISE = Exercise(
    name="rolling_slot",
    reference=rolling_slot,
    probe=_slot_probe,
    swapped_in=patched(roseinfer.cache.rolling, "rolling_slot"),
    runs=_slot_runs(),
    known_wrong=[
        KnownWrong(
            "modulo_all_slots",
            _modulo_all_slots,
            "every position goes round all sinks + window slots: once the sequence is "
            "longer than them, a later token overwrites a sink that every query still reads",
        ),
        KnownWrong(
            "sinks_share_the_window",
            _sinks_share_the_window,
            "the window's positions go round slots 0 .. W - 1, the sinks' own slots among "
            "them: the sinks are overwritten (and the last S slots are never used)",
        ),
        KnownWrong(
            "last_slot_only",
            _last_slot_only,
            "every position after the sinks lands in one slot: the cache remembers the "
            "latest token only, not the window",
        ),
    ],
    fallback="a key is overwritten while a query still needs it, or lands in no slot",
)


def check_rolling_slot(fn: Callable) -> CheckResult:
    """Chapter 18: `rolling_slot(pos, window, sinks) -> slots` (tensors of positions)."""
    return check(EXERCISE, fn)
