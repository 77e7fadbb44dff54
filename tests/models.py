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
`logit_tolerance` of the oracle's (rosetrainer/numerics.py: float32 rounding at the
step's scale), so an argmax can flip only on a margin under twice that; a clear margin
is MARGIN_TOLERANCES tolerances. A seed or shape that breaks it fails loudly there
instead of flaking somewhere else.

`assert_logits_close` is every test's one logit check; it keeps the worst gap each test
file saw against its tolerance, and the session ends with that table (tests/conftest.py),
so a run on another CPU shows how much room the tolerance has there.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import torch

import rosetrainer.model
from rosecourse.demo import top2_margins, wide_random_init
from roseinfer.loops.generate import GenerationResult
from rosetrainer.checkpoint import save_checkpoint
from rosetrainer.config import GPTConfig
from rosetrainer.model import GPT
from rosetrainer.numerics import logit_tolerance

# A greedy step is a strong oracle when its top-1 wins by this many logit tolerances
# (two would be the least that rounding within the tolerance could never flip).
MARGIN_TOLERANCES = 2

# test file -> (worst gap / tolerance, that gap, that tolerance): printed at the session's end.
WORST_LOGIT_GAPS: dict[str, tuple[float, float, float]] = {}


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
    **choices: Any,
) -> GPT:
    """A small GPT in eval mode whose greedy output is varied and position-sensitive
    (the chapters' wide init, rosecourse.demo.wide_random_init). choices: further
    GPTConfig fields (the Llama-shaped ones: LLAMA_CHOICES)."""
    config = GPTConfig(
        vocab_size=vocab_size,
        block_size=block_size,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        position_embedding=position_embedding,
        sliding_window=sliding_window,
        attention_sinks=attention_sinks,
        **choices,
    )
    return wide_random_init(GPT(config), seed)


# A test model made Llama-shaped: two query heads per key/value head, RMSNorm, SwiGLU, no
# biases, rotary positions on a base other than 10,000 (make_test_model(**LLAMA_CHOICES)).
LLAMA_CHOICES = dict(
    position_embedding="rotary",
    n_kv_head=1,
    norm="rmsnorm",
    mlp="swiglu",
    mlp_hidden=48,
    bias=False,
    rotary_base=500.0,
)


def write_random_checkpoint(path: Path, config: GPTConfig) -> Path:
    """A random model of `config` saved as the trainer saves one (its output matrix tied to
    the token embedding, so GPT-2's format can hold it: rose-export-hf writes it out).

    Every matrix is drawn with std 0.2 (GPT's own 0.02 gives near-ties, and a greedy
    comparison through near-ties checks little)."""
    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.2)
    state = {
        "model": model.state_dict(),
        "model_config": config.to_dict(),
        "tokenizer_name": "gpt2",
    }
    save_checkpoint(path, state)
    return path


def perturbed_copy(model: GPT, scale: float, seed: int = 1) -> GPT:
    """A copy of `model` with noise of `scale` times each weight tensor's spread: a draft
    model for speculative decoding that agrees with `model` often, not always."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * param.std() * scale)
    return draft


def assert_clear_margins(step_logits: Sequence[torch.Tensor]) -> float:
    """Fail unless every step's argmax wins by MARGIN_TOLERANCES logit tolerances; return the
    smallest margin."""
    margins = top2_margins(step_logits)
    assert margins, "no steps to check"
    for step, (margin, logits) in enumerate(zip(margins, step_logits, strict=True)):
        least = MARGIN_TOLERANCES * logit_tolerance(logits)
        assert margin >= least, (
            f"step {step}: top-1 beats top-2 by only {margin:.2e} (< {least:.1e}); "
            f"a near-tie makes the oracle weak: pick another seed"
        )
    return min(margins)


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, where: str = "") -> float:
    """`got` within the float32 logit tolerance of the oracle's `want`; return the gap."""
    gap = float((got.float() - want.float()).abs().max())
    tolerance = logit_tolerance(want)
    assert gap <= tolerance, f"{where}logits differ by {gap:.2e} (tolerance {tolerance:.1e})"
    family = os.environ.get("PYTEST_CURRENT_TEST", "outside a test").split("::")[0]
    if gap / tolerance >= WORST_LOGIT_GAPS.get(family, (-1.0,))[0]:
        WORST_LOGIT_GAPS[family] = (gap / tolerance, gap, tolerance)
    return gap


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
    """Tokens identical, logits within the tolerance at every step; return the largest gap."""
    assert result.token_ids == expected.token_ids
    assert len(result.step_logits) == len(expected.step_logits)
    pairs = enumerate(zip(result.step_logits, expected.step_logits, strict=True))
    return max(assert_logits_close(got, want, f"step {step}: ") for step, (got, want) in pairs)
