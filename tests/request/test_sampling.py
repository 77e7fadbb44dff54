"""Sampling: one seed, one output; the cached paths draw what the oracle draws; the filters."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from models import make_test_model

from roseinfer.cache.dense import ConcatKVCache, StaticKVCache
from roseinfer.loops.generate import generate
from roseinfer.request.sampling import SamplingParams, sample_next_token, top_k_filter, top_p_filter
from roseinfer.request.sampling_params import FLOAT32_TINY
from rosetrainer.errors import RoseError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [5, 77, 300, 12]
NEW_TOKENS = 40  # past block_size (32): the re-prefill is crossed under sampling too


@pytest.fixture(scope="module")
def model():
    return make_test_model(seed=0)


def run(model, sampling: SamplingParams, seed: int | None, cache: str | None) -> list[int]:
    config = dataclasses.replace(sampling, max_tokens=NEW_TOKENS, seed=seed, ignore_eos=True)
    caches = {"concat": ConcatKVCache, "static": lambda: StaticKVCache(model)}
    if cache is None:
        return generate(model, PROMPT, config, use_cache=False).token_ids
    return generate(model, PROMPT, config, cache=caches[cache]()).token_ids


def test_one_seed_one_output(model) -> None:
    sampling = SamplingParams(temperature=0.9, top_k=50, top_p=0.95)
    first = run(model, sampling, seed=123, cache="static")
    assert run(model, sampling, seed=123, cache="static") == first
    assert run(model, sampling, seed=124, cache="static") != first
    # Sampling really samples: these are not the greedy tokens.
    assert run(model, SamplingParams(), seed=None, cache="static") != first


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_k=20),
        SamplingParams(temperature=0.9, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.8),
    ],
    ids=["t1.0", "t0.8-k20", "t0.9-p0.9", "t1.0-k50-p0.8"],
)
def test_cached_sampling_draws_what_the_oracle_draws(model, sampling: SamplingParams) -> None:
    expected = run(model, sampling, seed=7, cache=None)
    assert run(model, sampling, seed=7, cache="concat") == expected
    assert run(model, sampling, seed=7, cache="static") == expected


def test_top_k_1_is_greedy(model) -> None:
    greedy = run(model, SamplingParams(), seed=None, cache=None)
    for cache in (None, "static"):
        assert run(model, SamplingParams(temperature=1.0, top_k=1), seed=3, cache=cache) == greedy


def kept(logits: torch.Tensor) -> list[int]:
    return torch.nonzero(logits.flatten() > float("-inf")).flatten().tolist()


# probs 0.5, 0.3, 0.15, 0.05 -> masses before each token: 0, 0.5, 0.8, 0.95. A token is kept
# while the mass before it is below p: p=0.5 keeps 1; 0.6 keeps 2; 0.8 keeps 2 (0.5 + 0.3
# reaches 0.8); 0.81 keeps 3; 1.0 keeps all four.
@pytest.mark.parametrize(("p", "n_kept"), [(0.5, 1), (0.6, 2), (0.8, 2), (0.81, 3), (1.0, 4)])
def test_top_p_keeps_the_smallest_set_reaching_p(p: float, n_kept: int) -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert kept(top_p_filter(logits, p)) == list(range(n_kept))
    # The same distribution in another vocabulary order keeps the same tokens.
    order = torch.tensor([2, 0, 3, 1])  # vocab id -> index into the probabilities above
    shuffled = logits[order]
    expected = sorted(int(torch.nonzero(order == i)) for i in range(n_kept))
    assert kept(top_p_filter(shuffled, p)) == expected


def test_ties_go_to_the_lower_token_id() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0]])
    assert kept(top_k_filter(logits, 1)) == [1]
    assert kept(top_k_filter(logits, 2)) == [1, 3]
    # Three equal probabilities of 0.3 (and 0.1 left): p=0.5 needs two of them.
    uniform = torch.tensor([0.1, 0.3, 0.3, 0.3]).log()
    assert kept(top_p_filter(uniform, 0.5)) == [1, 2]
    # top_k=1 agrees with argmax even on a tie, whatever the draw.
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, top_k=1)
    draws = {int(sample_next_token(logits, params, generator)) for _ in range(20)}
    assert draws == {int(torch.argmax(logits))} == {1}


def test_sampling_follows_the_distribution() -> None:
    """At temperature 1 the draws follow softmax(logits); a tiny temperature is greedy."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    generator = torch.Generator().manual_seed(0)
    draws = sample_next_token(logits, SamplingParams(temperature=1.0), generator)
    frequencies = torch.bincount(draws, minlength=4) / len(draws)
    # Each frequency's standard error is at most sqrt(0.25 / 4000) = 0.008; allow 5 of them.
    assert torch.allclose(frequencies, probs, atol=0.04)
    # logits of ~10 over the smallest temperature allowed (float32's smallest normal number)
    # overflow float32: the shift keeps them finite.
    cold = SamplingParams(temperature=FLOAT32_TINY)
    cold = sample_next_token(logits[:10] + 10, cold, generator)
    assert cold.tolist() == [0] * 10


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.1, "temperature must be a finite number >= 0"),
        ("temperature", math.nan, "temperature"),
        ("temperature", math.inf, "temperature must be a finite number"),
        ("max_tokens", 0, "max_tokens must be an integer >= 1"),
        ("max_tokens", 2.0, "max_tokens"),
        ("seed", -1, r"seed must be an integer in \[0, 2\*\*64 - 1\]"),
        ("seed", 2**64, "seed"),
        ("stop", ["ok", ""], "stop strings must be non-empty"),
        ("stop_token_ids", [-3], "stop_token_ids"),
        ("logprobs", -1, r"logprobs must be an integer in \[0, 20\]"),
        ("top_k", -2, "top_k must be an integer >= 0"),
        ("top_k", 2.5, "top_k"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
        ("top_p", 1.5, "top_p"),
        ("top_p", math.nan, "top_p"),
    ],
)
def test_bad_parameters_are_errors(field: str, value: object, message: str) -> None:
    with pytest.raises(RoseError, match=message):
        SamplingParams(**{field: value})


def test_one_stop_string_or_a_list() -> None:
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
