"""Chapter 10's exercise: the bytes one decode step reads.

The check compares the learner's formula with what real objects hold: a real GPT's
parameters and a real cache.

The contract is the docstring of rosecourse/exercises/ch10_decode_read_bytes/reference.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from rosecourse.exercises.answers import known_mistakes
from rosecourse.exercises.ch10_decode_read_bytes.reference import decode_read_bytes
from rosecourse.exercises.common import (
    CheckResult,
    Exercise,
    Probe,
    check,
    held_function,
    hold,
    outcome,
)
from roseinfer.cache.dense import ConcatKVCache
from rosetrainer.config import GPTConfig
from rosetrainer.model import GPT

# (config, batch, context_len, dtype): small configs with a tied and an odd shape each.
BYTES_CASES = [
    (
        GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=32),
        1,
        16,
        torch.float32,
    ),
    (
        GPTConfig(vocab_size=300, block_size=32, n_layer=3, n_head=4, n_embd=48),
        4,
        30,
        torch.bfloat16,
    ),
    (
        GPTConfig(vocab_size=1000, block_size=128, n_layer=1, n_head=1, n_embd=16),
        2,
        100,
        torch.float32,
    ),
    (  # no biases: the Linears and LayerNorms hold weights only
        GPTConfig(vocab_size=200, block_size=32, n_layer=2, n_head=2, n_embd=24, bias=False),
        3,
        20,
        torch.float32,
    ),
]


@functools.cache
def measured_read_bytes(case: int) -> int:
    """What a decode step at `context_len` reads, measured on real objects: every weight of
    a real GPT once, and the keys/values a real ConcatKVCache holds after a prefill."""
    config, batch, context_len, dtype = BYTES_CASES[case]
    model = GPT(config).to(dtype).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once
    cache = ConcatKVCache()
    with torch.inference_mode():
        model(torch.zeros(batch, context_len, dtype=torch.long), cache=cache, last_only=True)
    kv = sum(t.numel() * t.element_size() for layer in cache.past_kv for t in layer)
    return weights + kv


def _bytes_probe(fn: Callable) -> Probe:
    return {
        _case_name(i): outcome(lambda c=c: fn(c[0], c[1], c[2], c[3].itemsize))
        for i, c in enumerate(BYTES_CASES)
    }


def _bytes_runs() -> list[tuple[str, Callable, Callable]]:
    def go(on_token: Callable[[int, int], None]) -> list[list[int]]:
        got = []
        for config, batch, length, dtype in BYTES_CASES:
            got.append(int(held_function()(config, batch, length, dtype.itemsize)))
            on_token(0, got[-1])
        return [got]

    def expected() -> list[tuple[int, ...]]:
        return [tuple(measured_read_bytes(c) for c in range(len(BYTES_CASES)))]

    return [("weights and KV cache measured on real objects", expected, go)]


def _case_name(case: int) -> str:
    config, batch, length, dtype = BYTES_CASES[case]
    return (
        f"case {case}: {config.n_layer} layers, n_embd {config.n_embd}, vocab "
        f"{config.vocab_size}, batch {batch}, context {length}, {dtype}"
        + ("" if config.bias else ", bias=False")
    )


EXERCISE = Exercise(
    name="decode_read_bytes",
    reference=decode_read_bytes,
    probe=_bytes_probe,
    swapped_in=hold,
    runs=_bytes_runs(),
    known_wrong=known_mistakes(__name__),
    fallback="the count is neither every weight once nor the whole cache of every row",
    step_label=_case_name,
)


def check_decode_read_bytes(fn: Callable) -> CheckResult:
    """Chapter 10: `decode_read_bytes(config, batch, context_len, bytes_per_number) -> int`."""
    return check(EXERCISE, fn)
