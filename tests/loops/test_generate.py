"""Cached generation equals the uncached oracle, token for token, logits close at every step."""

from __future__ import annotations

import functools
import string
from unittest import mock

import pytest
import torch
from models import (
    assert_clear_margins,
    assert_matches_oracle,
    assert_varied,
    make_test_model,
    position_sensitivity,
)

import roseinfer.loops.generate
from roseinfer.cache.dense import ConcatKVCache, StaticKVCache
from roseinfer.loops.generate import COMPILE_MODES, GenerationResult, generate
from roseinfer.request.rows import window_start
from roseinfer.request.sampling import SamplingParams
from rosetrainer.errors import RoseError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPES = {
    "1L-2H-32d-ctx16": dict(n_layer=1, n_head=2, n_embd=32, block_size=16),
    "2L-3H-48d-ctx32": dict(n_layer=2, n_head=3, n_embd=48, block_size=32),
    "3L-4H-32d-ctx64": dict(n_layer=3, n_head=4, n_embd=32, block_size=64),
    # The same sweep on rotary positions: past the window both crop and re-prefill alike.
    # (Seed 2: seed 0's rotary model settles into a 4-token loop.)
    "2L-3H-48d-ctx32-rotary": dict(
        n_layer=2, n_head=3, n_embd=48, block_size=32, position_embedding="rotary", seed=2
    ),
}
# Prompt lengths as fractions of the context: 1 token, 2, half, one short of full, full.
PROMPT_LENGTHS = ("1", "2", "half", "full-1", "full")
# Picked so that every oracle's top-1 wins by many logit tolerances at every step (the
# smallest margin is 24 tolerances; seed 0 had a step at 1.2, a near-tie on some CPUs).
PROMPT_SEED = 3000


@functools.cache
def model_for(shape: str):
    return make_test_model(**{"seed": 0, **SHAPES[shape]})


def prompt_for(shape: str, length: str) -> list[int]:
    block_size = SHAPES[shape]["block_size"]
    n = {"1": 1, "2": 2, "half": block_size // 2, "full-1": block_size - 1, "full": block_size}
    generator = torch.Generator().manual_seed(PROMPT_SEED + block_size + n[length])
    return torch.randint(0, 512, (n[length],), generator=generator).tolist()


def greedy(max_tokens: int, **overrides) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **overrides)


def make_cache(kind: str, model):
    return ConcatKVCache() if kind == "concat" else StaticKVCache(model)


@functools.cache
def oracle(shape: str, length: str, window_keep: int | None = None) -> GenerationResult:
    """The uncached greedy run, two context windows long, checked to be a strong oracle."""
    model = model_for(shape)
    n = 2 * SHAPES[shape]["block_size"]
    result = generate(
        model,
        prompt_for(shape, length),
        greedy(n),
        use_cache=False,
        keep_logits=True,
        window_keep=window_keep,
    )
    assert_clear_margins(result.step_logits)
    return result


@pytest.mark.parametrize("cache_kind", ["concat", "static"])
@pytest.mark.parametrize("length", PROMPT_LENGTHS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cached_greedy_equals_oracle(shape: str, length: str, cache_kind: str) -> None:
    model = model_for(shape)
    expected = oracle(shape, length)
    config = greedy(len(expected.token_ids))
    result = generate(
        model,
        prompt_for(shape, length),
        config,
        cache=make_cache(cache_kind, model),
        keep_logits=True,
    )
    max_diff = assert_matches_oracle(result, expected)
    print(f"{shape} prompt {length} {cache_kind}: max |logit diff| {max_diff:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("mode", COMPILE_MODES)
def test_compiled_static_decode_equals_oracle(mode: str) -> None:
    """torch.compile of the one-token step: same tokens, logits close, past the window too
    (max-autotune: the frozen weights and inductor's own matmul kernels too)."""
    shape, length = "2L-3H-48d-ctx32", "half"
    model = model_for(shape)
    expected = oracle(shape, length)
    cache = StaticKVCache(model)
    config = greedy(len(expected.token_ids))
    result = generate(
        model, prompt_for(shape, length), config, cache=cache, keep_logits=True, compile=mode
    )
    assert_matches_oracle(result, expected)


@pytest.mark.slow
def test_frozen_decode_step_is_not_reused_for_other_weights() -> None:
    """max-autotune bakes one model's weights into its graph: a second model of the same
    shape must get a graph of its own, not decode with the first model's weights."""
    shape, length = "2L-3H-48d-ctx32", "half"
    first, second = model_for(shape), make_test_model(seed=1, **SHAPES[shape])
    prompt = prompt_for(shape, length)
    for model in (first, second):
        config = greedy(SHAPES[shape]["block_size"])
        expected = generate(model, prompt, config, use_cache=False, keep_logits=True)
        cache = StaticKVCache(model)
        result = generate(
            model, prompt, config, cache=cache, keep_logits=True, compile="max-autotune"
        )
        assert_matches_oracle(result, expected)
    assert first_tokens_differ(first, second, prompt)


def first_tokens_differ(first, second, prompt: list[int]) -> bool:
    """The two models' greedy outputs differ (else the test above could not tell them apart)."""
    config = greedy(8)
    return (
        generate(first, prompt, config, use_cache=False).token_ids
        != generate(second, prompt, config, use_cache=False).token_ids
    )


@pytest.mark.parametrize("shape", list(SHAPES))
def test_test_models_are_a_strong_oracle(shape: str) -> None:
    """Varied greedy tokens within a window, and a shifted position changes most choices.

    Rotary positions are the exception, by design: scores depend on distances only, so
    moving every position by one changes nothing (a cache that gets the *relative*
    position wrong still diverges: chapter 18's bug).
    """
    block_size = SHAPES[shape]["block_size"]
    result = oracle(shape, "2")
    assert_varied(result.token_ids[:block_size])
    tokens = (result.prompt_ids + result.token_ids)[: block_size - 1]
    sensitivity = position_sensitivity(model_for(shape), tokens)
    if SHAPES[shape].get("position_embedding") == "rotary":
        assert sensitivity == 0.0
    else:
        assert sensitivity >= 0.5


@pytest.mark.parametrize("cache_kind", ["concat", "static"])
@pytest.mark.parametrize("window_keep", [1, 15, 16])
def test_window_keep_extremes_equal_oracle(window_keep: int, cache_kind: str) -> None:
    """keep=1 restarts from the newest token alone; keep=15 re-prefills every other step
    (the window alternates between 15 and 16 tokens); keep=16 = block_size slides by one
    and re-prefills on every step."""
    shape = "1L-2H-32d-ctx16"
    model = model_for(shape)
    expected = oracle(shape, "half", window_keep)
    config = greedy(len(expected.token_ids))
    result = generate(
        model,
        prompt_for(shape, "half"),
        config,
        cache=make_cache(cache_kind, model),
        keep_logits=True,
        window_keep=window_keep,
    )
    assert_matches_oracle(result, expected)


def test_window_start() -> None:
    # Within the window the view does not move.
    assert window_start(0, 16, block_size=16, keep=8) == 0
    assert window_start(5, 21, block_size=16, keep=8) == 5
    # One token over: cut back to the last `keep` tokens.
    assert window_start(0, 17, block_size=16, keep=8) == 9
    assert window_start(9, 26, block_size=16, keep=8) == 18
    assert window_start(0, 17, block_size=16, keep=1) == 16


def test_cached_path_reprefills_each_time_the_window_fills() -> None:
    shape = "1L-2H-32d-ctx16"
    model = model_for(shape)
    # Prompt of 1, 48 new tokens, block 16, keep 8: the sequence is cut when it reaches
    # 17 tokens, then every 9 more (26, 35, 44); the 48th token is never fed back.
    # One prefill of the prompt, then one re-prefill per cut.
    real_prefill = roseinfer.loops.generate.prefill
    with mock.patch.object(
        roseinfer.loops.generate, "prefill", side_effect=real_prefill
    ) as prefill:
        generate(model, [7], greedy(48))
    assert prefill.call_count == 1 + 4


def test_empty_prompt_and_prompt_over_context_are_errors() -> None:
    model = model_for("1L-2H-32d-ctx16")
    with pytest.raises(RoseError, match="empty"):
        generate(model, [], greedy(4))
    with pytest.raises(RoseError, match="17 tokens.*16"):
        generate(model, list(range(17)), greedy(4))
    with pytest.raises(RoseError, match="max_tokens"):
        greedy(-1)
    with pytest.raises(RoseError, match="max_tokens must be an integer >= 1"):
        greedy(0)  # a request asks for at least one token (as the serving engine requires)


def first_new_token_index(tokens: list[int], start: int) -> int:
    """The first index >= start whose token does not occur earlier in the list."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.mark.parametrize("use_cache", [False, True])
def test_stops_at_end_of_text(use_cache: bool) -> None:
    shape = "2L-3H-48d-ctx32"
    expected = oracle(shape, "half").token_ids
    # Call the oracle's k-th token "end of text": generation must stop right there.
    k = first_new_token_index(expected, 5)
    eot_id = expected[k]
    streamed: list[int] = []
    result = generate(
        model_for(shape),
        prompt_for(shape, "half"),
        SamplingParams(max_tokens=len(expected)),
        use_cache=use_cache,
        eot_id=eot_id,
        on_token=lambda _row, token: streamed.append(token),
    )
    assert (result.finish_reason, result.stop_reason) == ("stop", eot_id)
    assert result.token_ids == expected[:k]  # the end-of-text token itself is not kept
    assert streamed == result.token_ids

    ignoring = generate(
        model_for(shape),
        prompt_for(shape, "half"),
        greedy(len(expected)),
        use_cache=use_cache,
        eot_id=eot_id,
    )
    assert ignoring.token_ids == expected
    assert ignoring.finish_reason == "length"


def two_letters(ids: list[int]) -> str:
    """A tiny made-up detokenizer: every id is two letters, so a stop string can span tokens."""
    letters = string.ascii_lowercase
    return "".join(letters[i % 26] + letters[i // 26 % 26] for i in ids)


@pytest.mark.parametrize("use_cache", [False, True])
def test_stop_strings(use_cache: bool) -> None:
    shape = "2L-3H-48d-ctx32"
    expected = oracle(shape, "half").token_ids
    text = two_letters(expected)
    # The last letter of token k and the first of token k + 1: found only once k + 1 is out.
    k = 6
    stop = text[2 * k + 1 : 2 * k + 3]
    end = text.index(stop) + len(stop)  # where the stop string first completes
    stop_after = -(-end // 2)  # tokens needed to write `end` characters
    result = generate(
        model_for(shape),
        prompt_for(shape, "half"),
        greedy(len(expected), stop=("never-made", stop)),
        use_cache=use_cache,
        decode=two_letters,
    )
    assert (result.finish_reason, result.stop_reason) == ("stop", stop)
    assert result.token_ids == expected[:stop_after]
    assert stop in two_letters(result.token_ids)
    assert stop not in two_letters(result.token_ids[:-1])


def test_stop_strings_need_a_decode_function() -> None:
    with pytest.raises(RoseError, match="decode"):
        generate(model_for("1L-2H-32d-ctx16"), [1], greedy(3, stop=("x",)))
    with pytest.raises(RoseError, match="non-empty"):
        greedy(3, stop=("",))
