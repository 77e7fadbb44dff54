"""Chapter 21's exercise: one decode query per head, grouped-query attention over the cache.

The learner's function replaces rosetrainer.model.one_query_attention, which the model
calls at every decode step (one query per row), and chapter 21's grouped model (6 query
heads over 2 key/value heads), and one with a single key/value head, generate greedily on
a cache: every step's token must be the uncached oracle's and its logits within the one
tolerance (rosetrainer/numerics.py).

The contract is the docstring of rosecourse/exercises/ch21_grouped_attention/reference.py.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

import rosetrainer.model
from rosecourse.demo import wide_random_init
from rosecourse.exercises.answers import known_mistakes
from rosecourse.exercises.common import (
    CheckResult,
    Exercise,
    Probe,
    check,
    outcome,
    patched,
)
from roseinfer.cache.dense import ConcatKVCache, StaticKVCache
from roseinfer.loops.generate import generate_batch
from roseinfer.request.sampling import SamplingParams
from rosetrainer.config import GPTConfig
from rosetrainer.model import GPT, one_query_attention
from rosetrainer.numerics import logit_tolerance

# Chapter 21's model: Llama-shaped, 6 query heads over 2 key/value heads (groups of 3).
GROUPED_MODEL_CONFIG = GPTConfig.from_preset(
    "tiny-llama", vocab_size=512, block_size=64, n_layer=2, n_head=6, n_kv_head=2,
    n_embd=96, mlp_hidden=128, rotary_base=500.0,
)  # fmt: skip
# Prompts of token ids (the vocabulary is 512): the chapter's, and two more for a batch of
# rows with 0, some and many padding slots.
PROMPTS = ((5, 17, 3, 250, 99, 7), (42, 8, 311, 64, 7, 19, 480, 3, 77, 150, 2), (9, 400))
NEW_TOKENS = 24
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


@functools.cache
def grouped_model(n_kv_head: int) -> GPT:
    """Chapter 21's model with this many key/value heads, seeded."""
    return wide_random_init(GPT(dataclasses.replace(GROUPED_MODEL_CONFIG, n_kv_head=n_kv_head)), 0)


@functools.cache
def oracle(n_kv_head: int, prompt: tuple[int, ...]) -> tuple[tuple[int, ...], list[torch.Tensor]]:
    """The uncached greedy run of `prompt`: its tokens and each step's logits."""
    (run,) = generate_batch(
        grouped_model(n_kv_head), [list(prompt)], PARAMS, use_cache=False, keep_logits=True
    )
    return tuple(run.token_ids), run.step_logits


def _runs() -> list[tuple[str, Callable, Callable]]:
    """A row alone on each model (the concatenated cache, then the static one: its decode
    mask hides the slots not yet written), and the three prompts as one left-padded batch.

    A step counts as parted when its token differs from the oracle's or its logits lie
    outside the tolerance: that step's token is reported as -1.
    """

    def run(n_kv_head: int, prompts: tuple[tuple[int, ...], ...], cache: Callable) -> Callable:
        def go(on_token: Callable[[int, int], None]) -> list[list[int]]:
            results = generate_batch(
                grouped_model(n_kv_head), [list(p) for p in prompts], PARAMS,
                cache=cache(), keep_logits=True, on_token=on_token,
            )  # fmt: skip
            rows = []
            for prompt, result in zip(prompts, results, strict=True):
                _, want = oracle(n_kv_head, prompt)
                tolerance = logit_tolerance(want)
                rows.append(
                    [
                        token if float((got - ref).abs().max()) <= tolerance else -1
                        for token, got, ref in zip(
                            result.token_ids, result.step_logits, want, strict=False
                        )
                    ]
                    + result.token_ids[len(want) :]
                )
            return rows

        return go

    def expected(n_kv_head: int, prompts: tuple[tuple[int, ...], ...]) -> Callable:
        return lambda: [oracle(n_kv_head, p)[0] for p in prompts]

    one, longest = PROMPTS[:1], len(PROMPTS[0]) + NEW_TOKENS
    pads = [max(map(len, PROMPTS)) - len(p) for p in PROMPTS]
    runs = []
    for n_kv_head in (2, 1):
        heads = f"6 query heads over {n_kv_head} key/value head{'s' * (n_kv_head > 1)}"
        runs += [
            (f"{heads}, concatenated cache", expected(n_kv_head, one),
             run(n_kv_head, one, ConcatKVCache)),
            (f"{heads}, static cache", expected(n_kv_head, one),
             run(n_kv_head, one, lambda n=n_kv_head: StaticKVCache(grouped_model(n), 1, longest))),
        ]  # fmt: skip
    runs.append(
        (
            f"6 query heads over 2 key/value heads, a left-padded batch, padding {pads}",
            expected(2, PROMPTS),
            run(2, PROMPTS, ConcatKVCache),
        )
    )
    return runs


# ---------------------------------------------------------------------------
# Probes: random queries, keys and values
# ---------------------------------------------------------------------------

# (B, n_head, n_kv_head, kv_len, head_dim): groups of 3, one key/value head for all
# (multi-query), groups of 2 over 4 key/value heads, several rows.
SHAPES = [(2, 6, 2, 5, 8), (1, 4, 1, 7, 16), (3, 8, 4, 6, 4)]


def random_inputs(seed: int, shape: tuple[int, ...], scale: float = 1.0) -> list[torch.Tensor]:
    batch, n_head, n_kv_head, kv_len, head_dim = shape
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_head, 1, head_dim, generator=generator) * scale
    k, v = (torch.randn(batch, n_kv_head, kv_len, head_dim, generator=generator) for _ in "kv")
    return [q, k * scale, v]


def key_mask(batch: int, kv_len: int) -> torch.Tensor:
    """(batch, 1, 1, kv_len): row r may not look at its first r keys nor its last one."""
    allowed = torch.ones(batch, 1, 1, kv_len, dtype=torch.bool)
    for row in range(batch):
        allowed[row, ..., :row] = False
    allowed[..., -1] = False
    return allowed


def _within_bfloat16(fn: Callable) -> dict[str, object]:
    """bfloat16 inputs: the output's dtype, and whether its values are the float32 answer's
    up to bfloat16's rounding (any order of bfloat16 arithmetic gets as close)."""
    q, k, v = (t.to(torch.bfloat16) for t in random_inputs(7, SHAPES[0]))
    mask = key_mask(2, 5)

    def values() -> str:
        got = fn(q, k, v, mask)
        want = one_query_attention(q.float(), k.float(), v.float(), mask)
        if got.shape != want.shape:
            return f"shape {tuple(got.shape)}"
        close = torch.allclose(got.float(), want, rtol=0.05, atol=0.05)
        return "within bfloat16's rounding" if close else "far from the float32 answer"

    label = "grouped_attention(q, k, v, mask), bfloat16 of shapes (2, 6, 1, 8), (2, 2, 5, 8)"
    return {
        f"{label}: dtype": outcome(lambda: str(fn(q, k, v, mask).dtype)),
        f"{label}: values": outcome(values),
    }


def _attention_probe(fn: Callable) -> Probe:
    probe: dict[str, object] = {}
    for seed, shape in enumerate(SHAPES):
        batch, n_head, n_kv_head, kv_len, head_dim = shape
        shapes = f"q ({batch}, {n_head}, 1, {head_dim}), k and v ({batch}, {n_kv_head}, {kv_len}, {head_dim})"
        probe[f"grouped_attention(q, k, v, None), {shapes}"] = outcome(
            lambda seed=seed, shape=shape: fn(*random_inputs(seed, shape), None)
        )
        probe[f"grouped_attention(q, k, v, mask), {shapes}, mask hiding keys"] = outcome(
            lambda seed=seed, shape=shape: fn(
                *random_inputs(seed, shape), key_mask(shape[0], shape[3])
            )
        )
    # The decode mask of a cache without padding: one row of the causal mask, (1, kv_len).
    batch, n_head, n_kv_head, kv_len, head_dim = SHAPES[2]
    one_row = key_mask(1, kv_len).view(1, kv_len)
    probe[
        f"grouped_attention(q, k, v, mask), q ({batch}, {n_head}, 1, {head_dim}), mask of shape (1, {kv_len})"
    ] = outcome(lambda: fn(*random_inputs(5, SHAPES[2]), one_row))
    # Scores in the hundreds: exp() of them overflows float32 unless the largest is
    # subtracted first (softmax does).
    large = "grouped_attention(q, k, v, None), q and k 10x larger (scores in the hundreds)"
    probe[large] = outcome(lambda: fn(*random_inputs(3, SHAPES[0], scale=10.0), None))
    probe.update(_within_bfloat16(fn))
    return probe


# ---------------------------------------------------------------------------
# Known wrong answers
# ---------------------------------------------------------------------------


EXERCISE = Exercise(
    name="grouped_attention",
    reference=one_query_attention,
    probe=_attention_probe,
    swapped_in=patched(rosetrainer.model, "one_query_attention"),
    runs=_runs(),
    known_wrong=known_mistakes(__name__),
    fallback="some query head's output is not the softmax-weighted sum of its own key/value "
    "head's values over the keys it may see",
)


def check_grouped_attention(fn: Callable) -> CheckResult:
    """Chapter 21: `grouped_attention(q, k, v, attn_mask) -> (B, n_head, 1, head_dim)`."""
    return check(EXERCISE, fn)
