"""Chapter 00's exercise: the causal self-attention of a training step.

The learner's function replaces the model's uncached attention (PyTorch's SDPA with
is_causal=True), and the model decodes greedily without a cache.

The contract is the docstring of rosecourse/exercises/ch00_causal_attention/reference.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import SimpleNamespace
from unittest import mock

import torch

import rosetrainer.model
from rosecourse.demo import (
    NEW_TOKENS,
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
    reference_tokens,
)
from roseinfer.loops.generate import generate
from roseinfer.request.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


def random_qkv(seed: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for _ in range(3)]


def uncached_greedy_run() -> list[tuple[str, Callable, Callable]]:
    """The chapter prompt, greedy and uncached: every step a full causal pass."""
    prompt = encoded(PROMPT)

    def go(on_token: Callable[[int, int], None]) -> list[list[int]]:
        run = generate(oracle_model(), list(prompt), GREEDY, use_cache=False, on_token=on_token)
        return [run.token_ids]

    return [("uncached greedy", lambda: [reference_tokens(prompt, NEW_TOKENS)], go)]


_real_sdpa = torch.nn.functional.scaled_dot_product_attention


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The reference: what the model's SDPA call computes without a cache."""
    return _real_sdpa(q, k, v, is_causal=True)


def _swap_causal_attention(fn: Callable) -> contextlib.AbstractContextManager:
    """The model's attention calls without a mask (causal, no past) go to `fn`; the rest
    (cached calls, with an explicit mask) stay with PyTorch's."""

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        if is_causal and attn_mask is None and dropout_p == 0.0 and not kwargs:
            return fn(q, k, v)
        return _real_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)

    functional = SimpleNamespace(**vars(torch.nn.functional))
    functional.scaled_dot_product_attention = sdpa
    return mock.patch.object(rosetrainer.model, "F", functional)


# (batch, n_head, T, head_dim): rows and heads that differ, one position alone, and a
# head_dim other than the model's.
ATTENTION_SHAPES = [(2, 3, 5, 8), (1, 2, 1, 4), (3, 1, 7, 16)]


# Scores in the hundreds: exp() overflows past about 88 unless the row's max is taken off
# first (what torch.softmax does); small probes never tell.
LARGE = 40.0


def _attention_probe(fn: Callable) -> Probe:
    probe = {
        f"causal_attention(q, k, v), each of shape {shape}": outcome(
            lambda seed=seed, shape=shape: fn(*random_qkv(seed, shape))
        )
        for seed, shape in enumerate(ATTENTION_SHAPES)
    }
    q, k, v = random_qkv(7, (1, 2, 6, 8))
    probe[f"causal_attention(q * {LARGE:g}, k * {LARGE:g}, v): scores in the hundreds"] = outcome(
        lambda: fn(q * LARGE, k * LARGE, v)
    )
    return probe


EXERCISE = Exercise(
    name="causal_attention",
    reference=causal_attention,
    probe=_attention_probe,
    swapped_in=_swap_causal_attention,
    runs=uncached_greedy_run(),
    known_wrong=known_mistakes(__name__),
    fallback="some position's output is not the softmax-weighted sum of the values it may see",
)


def check_causal_attention(fn: Callable) -> CheckResult:
    """Chapter 00: `causal_attention(q, k, v) -> y`, (B, heads, T, head_dim) each."""
    return check(EXERCISE, fn)
