"""Seeded random GPTs that make a strong oracle, and the checks that say they do.

GPT's own init (std 0.02) gives near-uniform logits: greedy decoding then walks
through near-ties and repeats one token, and a cached path could be wrong at a
position without the output showing it. These models are re-initialised wider:

* token and position embeddings std 1.0, so a token's position moves its logits
  as much as its identity does (a cache with wrong positions cannot hide);
* every matrix std 1/sqrt(fan_in), so attention and the MLPs, not the embedding
  of the last token, decide what comes next;
* an untied output matrix: with the tied one the residual stream still holds the
  input token's own embedding, and a random model keeps predicting that token.

Each oracle test asserts, on the oracle's logits, that the top-1 / top-2 margin
is clear at every step (`assert_clear_margins`). The cached logits are held within
1e-5 of the oracle's, so an argmax can flip only on a margin under 2e-5; TEST_MIN_MARGIN
is five times that. A seed or shape that breaks it fails loudly there instead of
flaking somewhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from unittest import mock

import torch

import rosetrainer.model
from rosecourse.demo import top2_margins, wide_random_init
from roseinfer.loops.generate import GenerationResult
from rosetrainer.config import GPTConfig
from rosetrainer.model import GPT

TEST_MIN_MARGIN = 1e-4
# fp32 on CPU: the cached paths do the same sums in another order (a masked softmax over
# the whole static buffer, a decode query alone, a padded batch), so logits agree to
# rounding only.
TEST_LOGIT_ATOL = 1e-5


def make_test_model(
    seed: int = 0,
    *,
    n_layer: int = 2,
    n_head: int = 2,
    n_embd: int = 32,
    block_size: int = 32,
    vocab_size: int = 512,
    position_embedding: str = "learned",
    sliding_window: int | None = None,
    attention_sinks: int = 0,
) -> GPT:
    """A small GPT in eval mode whose greedy output is varied and position-sensitive
    (the chapters' wide init, rosecourse.demo.wide_random_init)."""
    config = GPTConfig(
        vocab_size=vocab_size,
        block_size=block_size,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        position_embedding=position_embedding,
        sliding_window=sliding_window,
        attention_sinks=attention_sinks,
    )
    return wide_random_init(GPT(config), seed)


def assert_clear_margins(
    step_logits: Sequence[torch.Tensor], min_margin: float = TEST_MIN_MARGIN
) -> float:
    """Fail unless every step's argmax wins by at least `min_margin`; return the smallest margin."""
    margins = top2_margins(step_logits)
    assert margins, "no steps to check"
    smallest = min(margins)
    step = margins.index(smallest)
    assert smallest >= min_margin, (
        f"step {step}: top-1 beats top-2 by only {smallest:.2e} (< {min_margin:.0e}); "
        f"a near-tie makes the oracle weak: pick another seed"
    )
    return smallest


def assert_varied(tokens: Sequence[int], min_distinct_fraction: float = 0.5) -> None:
    """Fail when the tokens are mostly repeats (a repeating oracle checks little)."""
    distinct = len(set(tokens)) / len(tokens)
    assert distinct >= min_distinct_fraction, (
        f"only {distinct:.0%} of {len(tokens)} greedy tokens are distinct: {list(tokens)}"
    )


def position_sensitivity(model: GPT, tokens: Sequence[int], shift: int = 1) -> float:
    """Fraction of positions whose argmax changes when every position moves by `shift`.

    The sequence is read once with its true positions and once with positions
    `shift` later (through the model's named `position_ids`); tokens must leave room
    for the shift within block_size.
    """
    assert len(tokens) + shift <= model.config.block_size
    idx = torch.tensor([list(tokens)])

    def shifted(past_len: int, q_len: int, device: torch.device | None = None) -> torch.Tensor:
        return torch.arange(past_len + shift, past_len + shift + q_len, device=device)

    with torch.no_grad():
        true_choice = model(idx).logits.argmax(-1)
        with mock.patch.object(rosetrainer.model, "position_ids", shifted):
            shifted_choice = model(idx).logits.argmax(-1)
    return float((true_choice != shifted_choice).float().mean())


def assert_matches_oracle(result: GenerationResult, expected: GenerationResult) -> float:
    """Tokens identical, logits within TEST_LOGIT_ATOL at every step; return the max difference."""
    assert result.token_ids == expected.token_ids
    assert len(result.step_logits) == len(expected.step_logits)
    max_diff = 0.0
    for step, (got, want) in enumerate(zip(result.step_logits, expected.step_logits, strict=True)):
        diff = float((got - want).abs().max())
        assert diff <= TEST_LOGIT_ATOL, f"step {step}: logits differ by {diff:.2e}"
        max_diff = max(max_diff, diff)
    return max_diff
