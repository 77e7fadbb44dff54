"""Chapter 05's exercise: nucleus (top-p) filtering.

The learner's function replaces the sampler's, and a seeded cached run must draw the
reference sampler's tokens.

The contract is the docstring of rosecourse/exercises/ch05_top_p_filter/reference.py.
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
    patched,
)
from roseinfer.loops.generate import generate
from roseinfer.request.sampling import SamplingParams, top_p_filter

# The sampling exercise: sharp enough that top-p's kept set is a few tokens, so a wrong
# one changes what is drawn.
SAMPLING = SamplingParams(
    max_tokens=NEW_TOKENS, temperature=1.0, top_p=0.7, seed=1, ignore_eos=True
)


@functools.cache
def reference_samples() -> tuple[int, ...]:
    """The sampling exercise's reference: the real sampler, uncached, under SAMPLING's seed."""
    run = generate(oracle_model(), list(encoded(PROMPT)), SAMPLING, use_cache=False)
    return tuple(run.token_ids)


TOP_P_LOGITS = torch.tensor(
    [
        [2.0, 1.5, 1.0, 0.5, 0.0, -1.0],  # chapter 05's six tokens
        [0.0, 4.0, 0.0, 1.0, 0.0, 0.0],  # one token holds most of the mass, not first in order
        [1.0, 1.0, 1.0, 1.0, 0.0, 0.0],  # ties
    ]
)


# Two tokens of probability exactly 1/2 (the rest -inf, as after top-k): at p = 0.5 the
# first alone reaches p.
HALVES = torch.tensor([[0.0, 0.0, -torch.inf, -torch.inf, -torch.inf, -torch.inf]])
# 128 tied tokens: the first ones by token order are kept. torch's default sort is not
# stable past a few dozen elements (on the CPU too), so a sort that is not asked to be
# stable keeps other tokens here, where six tokens cannot tell.
TIED = torch.zeros(1, 128)
# GPT-2's whole vocabulary: a sum over 50,257 probabilities in float16, or one that must
# reach p = 1 in float32, goes wrong here and nowhere on six or 128 tokens.
VOCABULARY = 3 * torch.randn(1, 50257, generator=torch.Generator().manual_seed(5))
TOP_P_INPUTS = {
    "TOP_P_LOGITS (3, 6)": TOP_P_LOGITS,
    f"{HALVES.tolist()}": HALVES,
    "zeros(1, 128) (128 ties: the first by token order are kept)": TIED,
    "TOP_P_LOGITS as (3, 1, 6)": TOP_P_LOGITS[:, None, :],
    "TOP_P_LOGITS in float16": TOP_P_LOGITS.half(),
    "3 * randn(1, 50257) (GPT-2's vocabulary)": VOCABULARY,
}


def _top_p_probe(fn: Callable) -> Probe:
    return {
        f"top_p_filter({name}, {p})": outcome(lambda x=x, p=p: fn(x.clone(), p))
        for name, x in TOP_P_INPUTS.items()
        for p in (0.05, 0.5, 0.8, 0.95, 1.0)
    }


def _sampling_runs() -> list[tuple[str, Callable, Callable]]:
    def go(on_token: Callable[[int, int], None]) -> list[list[int]]:
        run = generate(oracle_model(), list(encoded(PROMPT)), SAMPLING, on_token=on_token)
        return [run.token_ids]

    label = f"cached, T={SAMPLING.temperature}, top_p={SAMPLING.top_p}, seed {SAMPLING.seed}"
    return [(label, lambda: [reference_samples()], go)]


EXERCISE = Exercise(
    name="top_p_filter",
    reference=top_p_filter,
    probe=_top_p_probe,
    swapped_in=patched(roseinfer.request.sampling, "top_p_filter"),
    runs=_sampling_runs(),
    known_wrong=known_mistakes(__name__),
    fallback="it keeps a different set of tokens than the smallest set reaching p",
)


def check_top_p_filter(fn: Callable) -> CheckResult:
    """Chapter 05: `top_p_filter(logits, p) -> logits` with the dropped ones at -inf."""
    return check(EXERCISE, fn)
