"""Chapter 10's exercise: the bytes one decode step reads.

The check compares the learner's formula with what real objects hold: a real GPT's
parameters and a real cache.

The contract is the docstring of rosecourse/exercises/ch10_decode_read_bytes/reference.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

import torch

from rosecourse.exercises.common import (
    CheckResult,
    Exercise,
    KnownWrong,
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


def decode_read_bytes(
    config: GPTConfig, batch: int, context_len: int, bytes_per_number: int
) -> int:
    """The reference, from the formula (the check measures it on real objects)."""
    c, b = config.n_embd, int(config.bias)  # no bias in any Linear or LayerNorm without it
    norm = c + b * c
    per_layer = (
        norm + (c * 3 * c + b * 3 * c) + (c * c + b * c)
        + norm + (c * 4 * c + b * 4 * c) + (4 * c * c + b * c)
    )  # fmt: skip
    weights = config.vocab_size * c + config.block_size * c + config.n_layer * per_layer + norm
    kv = 2 * config.n_layer * batch * context_len * c
    return (weights + kv) * bytes_per_number


def _biases_always(config, batch, context_len, bytes_per_number):
    return decode_read_bytes(replace(config, bias=True), batch, context_len, bytes_per_number)


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


def _weights_only(config, batch, context_len, bytes_per_number):
    return decode_read_bytes(config, 0, context_len, bytes_per_number)


def _keys_only(config, batch, context_len, bytes_per_number):
    kv = 2 * config.n_layer * batch * context_len * config.n_embd * bytes_per_number
    return decode_read_bytes(config, batch, context_len, bytes_per_number) - kv // 2


def _untied_head(config, batch, context_len, bytes_per_number):
    head = config.vocab_size * config.n_embd * bytes_per_number
    return decode_read_bytes(config, batch, context_len, bytes_per_number) + head


def _one_row(config, batch, context_len, bytes_per_number):
    return decode_read_bytes(config, 1, context_len, bytes_per_number)


def _weights_per_row(config, batch, context_len, bytes_per_number):
    weights = decode_read_bytes(config, 0, context_len, bytes_per_number)
    return decode_read_bytes(config, batch, context_len, bytes_per_number) + (batch - 1) * weights


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
    known_wrong=[
        KnownWrong(
            "weights_only",
            _weights_only,
            "you count the weights alone: every decode step also reads every cached key "
            "and value of every row, and at long contexts that is most of the bytes",
        ),
        KnownWrong(
            "keys_only",
            _keys_only,
            "you count the keys but not the values: the cache holds both, per layer",
        ),
        KnownWrong(
            "untied_head",
            _untied_head,
            "you count lm_head apart from wte: GPT-2 ties them, one matrix read once",
        ),
        KnownWrong(
            "one_row",
            _one_row,
            "your cache bytes are one row's: every row of the batch has its own keys/values",
        ),
        KnownWrong(
            "biases_always",
            _biases_always,
            "you count biases the model does not have: with config.bias False no Linear "
            "or LayerNorm holds one (count every parameter the config gives the model)",
        ),
        KnownWrong(
            "weights_per_row",
            _weights_per_row,
            "you read the weights once per row: a batched step reads them once for all "
            "rows, which is why batching raises the arithmetic intensity",
        ),
    ],
    fallback="the count is neither every weight once nor the whole cache of every row",
    step_label=_case_name,
)


def check_decode_read_bytes(fn: Callable) -> CheckResult:
    """Chapter 10: `decode_read_bytes(config, batch, context_len, bytes_per_number) -> int`."""
    return check(EXERCISE, fn)
