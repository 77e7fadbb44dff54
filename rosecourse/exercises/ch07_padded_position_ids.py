"""Chapter 07's exercise: the per-row positions of a left-padded batch. The learner's
function replaces rosetrainer.model.padded_position_ids in a batched run.

The contract is the docstring of rosecourse/solutions/ch07_padded_position_ids.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import rosetrainer.model
from rosecourse.demo import (
    NEW_TOKENS,
)
from rosecourse.exercises.common import (
    BATCH_TEXTS,
    CheckResult,
    Exercise,
    KnownWrong,
    check,
    encoded,
    oracle_model,
    outcome,
    patched,
    reference_tokens,
)
from roseinfer.cache.dense import ConcatKVCache
from roseinfer.loops.generate import generate_batch
from roseinfer.request.sampling import SamplingParams
from rosetrainer.model import padded_position_ids

PADDING = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])


def _padded_probe(fn: Callable) -> list[object]:
    return [outcome(lambda: fn(PADDING.clone()))]


def _batch_runs() -> list[tuple[str, Callable, Callable]]:
    prompts = [encoded(text) for text in BATCH_TEXTS]

    def expected() -> list[tuple[int, ...]]:
        return [reference_tokens(p, NEW_TOKENS) for p in prompts]

    def go(on_token: Callable[[int, int], None]) -> list[list[int]]:
        params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
        runs = generate_batch(
            oracle_model(),
            [list(p) for p in prompts],
            params,
            cache=ConcatKVCache(),
            on_token=on_token,
        )
        return [run.token_ids for run in runs]

    pads = [max(map(len, prompts)) - len(p) for p in prompts]
    return [(f"a left-padded batch, padding {pads}", expected, go)]


def _counting_padding(attention_mask):
    return torch.arange(attention_mask.size(1)).expand(attention_mask.shape)


def _from_one(attention_mask):
    return attention_mask.long().cumsum(-1)


def _unclamped(attention_mask):
    return attention_mask.long().cumsum(-1) - 1


EXERCISE = Exercise(
    name="padded_position_ids",
    reference=padded_position_ids,
    probe=_padded_probe,
    swapped_in=patched(rosetrainer.model, "padded_position_ids"),
    runs=_batch_runs(),
    known_wrong=[
        KnownWrong(
            "counting_padding",
            _counting_padding,
            "your positions count the padding: "
            "every real token of a padded row stands as far right as its padding is "
            "long (the row without padding cannot tell)",
        ),
        KnownWrong(
            "from_one",
            _from_one,
            "your positions start at 1 (cumsum without the - 1): "
            "every row's tokens stand one too far right",
        ),
        KnownWrong(
            "unclamped",
            _unclamped,
            "padding slots get position -1, which has no "
            "embedding row: clamp them to 0 (what they compute is never read)",
        ),
    ],
    fallback="a row's tokens do not stand where they would stand alone",
)


def check_padded_position_ids(fn: Callable) -> CheckResult:
    """Chapter 07: `padded_position_ids(attention_mask) -> (batch, slots) long`."""
    return check(EXERCISE, fn)
