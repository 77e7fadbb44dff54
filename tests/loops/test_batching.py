"""Batches, forks, conversations and chunks: every cached run equals its own oracle.

A row of a left-padded batch, a continuation of a forked prefix, the second turn of
a conversation and a prompt prefilled in chunks are each compared with the uncached
run of the same token sequence alone: tokens identical, logits within the float32 logit tolerance at
every step. Shapes that disagree (mask, cache, positions, batch) are clear errors.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
from models import (
    assert_clear_margins,
    assert_logits_close,
    assert_matches_oracle,
    make_test_model,
)

import roseinfer.loops.generate
from roseinfer.cache.dense import ConcatKVCache, StaticKVCache
from roseinfer.loops.generate import (
    GenerationResult,
    cached_steps,
    generate,
    generate_batch,
    prefill,
)
from roseinfer.request.rows import checked_keep
from roseinfer.request.sampling import SamplingParams
from roseinfer.request.sequence import Sequence
from rosetrainer.errors import RoseError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK_SIZE = 32
# Ragged on purpose: one token, a few, past half the window, one short of the window.
RAGGED_LENGTHS = (1, 5, 17, BLOCK_SIZE - 1)
# Long enough for the 17- and 31-token rows to outgrow the window (re-prefills mid-batch).
NEW_TOKENS = 24
CACHE_KINDS = ("concat", "static")
POSITION_KINDS = ("learned", "rotary")


@functools.cache
def tiny_model(position_embedding: str = "learned"):
    return make_test_model(seed=0, block_size=BLOCK_SIZE, position_embedding=position_embedding)


def random_ids(n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=generator).tolist()


RAGGED_PROMPTS = [random_ids(n, seed=100 + n) for n in RAGGED_LENGTHS]


def greedy(max_tokens: int = NEW_TOKENS, **overrides) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **overrides)


def make_cache(
    kind: str, batch_size: int = 1, position_embedding: str = "learned"
) -> ConcatKVCache | StaticKVCache:
    if kind == "concat":
        return ConcatKVCache()
    return StaticKVCache(tiny_model(position_embedding), batch_size=batch_size)


@functools.cache
def oracle(
    prompt: tuple[int, ...], max_new_tokens: int = NEW_TOKENS, position_embedding: str = "learned"
) -> GenerationResult:
    """The uncached greedy run of one prompt alone, checked to be a strong oracle."""
    config = greedy(max_new_tokens)
    model = tiny_model(position_embedding)
    result = generate(model, list(prompt), config, use_cache=False, keep_logits=True)
    assert_clear_margins(result.step_logits)
    return result


# -- batched generation --


@pytest.mark.parametrize("position_embedding", POSITION_KINDS)
@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
def test_each_row_of_a_ragged_batch_equals_its_oracle(
    cache_kind: str, position_embedding: str
) -> None:
    assert max(map(len, RAGGED_PROMPTS)) + NEW_TOKENS > BLOCK_SIZE  # windows are crossed
    cache = make_cache(cache_kind, len(RAGGED_PROMPTS), position_embedding)
    streamed: list[list[int]] = [[] for _ in RAGGED_PROMPTS]
    real_prefill = roseinfer.loops.generate.prefill
    with mock.patch.object(roseinfer.loops.generate, "prefill", side_effect=real_prefill) as spy:
        results = generate_batch(
            tiny_model(position_embedding),
            RAGGED_PROMPTS,
            greedy(),
            cache=cache,
            keep_logits=True,
            on_token=lambda row, token: streamed[row].append(token),
        )
    assert spy.call_count > 1, "no row outgrew its window: the re-prefill went untested"
    for prompt, result, row_stream in zip(RAGGED_PROMPTS, results, streamed, strict=True):
        assert result.prompt_ids == prompt
        assert result.finish_reason == "length"
        assert_matches_oracle(result, oracle(tuple(prompt), NEW_TOKENS, position_embedding))
        assert row_stream == result.token_ids


def pick_early_eot(rows: list[list[int]], stopping_row: int, index: int) -> int:
    """A token the stopping row makes first at `index` and no other row makes at all."""
    eot_id = rows[stopping_row][index]
    assert eot_id not in rows[stopping_row][:index]
    others = [row for i, row in enumerate(rows) if i != stopping_row]
    assert all(eot_id not in row for row in others), "pick another stopping row or index"
    return eot_id


# The 3rd new token of the shortest (most padded) row, or of the longest row, is called
# "end of text"; the other rows never make that token.
@pytest.mark.parametrize("stopping_row", [0, len(RAGGED_PROMPTS) - 1])
@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
def test_a_row_stops_at_end_of_text_while_the_others_go_on(
    cache_kind: str, stopping_row: int
) -> None:
    expected = [oracle(tuple(p)).token_ids for p in RAGGED_PROMPTS]
    stop_index = 2
    eot_id = pick_early_eot(expected, stopping_row, stop_index)
    results = generate_batch(
        tiny_model(),
        RAGGED_PROMPTS,
        SamplingParams(max_tokens=NEW_TOKENS),
        cache=make_cache(cache_kind, batch_size=len(RAGGED_PROMPTS)),
        eot_id=eot_id,
        keep_logits=True,
    )
    for row, (prompt, result) in enumerate(zip(RAGGED_PROMPTS, results, strict=True)):
        want = oracle(tuple(prompt))
        if row == stopping_row:
            assert (result.finish_reason, result.stop_reason) == ("stop", eot_id)
            assert result.token_ids == want.token_ids[:stop_index]
            # The eot step's logits are kept too: one step more than kept tokens.
            assert len(result.step_logits) == stop_index + 1
            for got, ref in zip(result.step_logits, want.step_logits, strict=False):
                assert_logits_close(got, ref)
        else:
            assert result.finish_reason == "length"
            assert_matches_oracle(result, want)


@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
def test_sampled_rows_equal_their_single_seeded_runs(cache_kind: str) -> None:
    config = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
    model = tiny_model()
    batched = generate_batch(
        model,
        RAGGED_PROMPTS,
        config,
        cache=make_cache(cache_kind, batch_size=len(RAGGED_PROMPTS)),
    )
    for prompt, result in zip(RAGGED_PROMPTS, batched, strict=True):
        alone = generate(model, prompt, config, use_cache=False)
        assert result.token_ids == alone.token_ids
    # The draws really are random: they leave the greedy path somewhere.
    greedy_tokens = [oracle(tuple(prompt), 12).token_ids for prompt in RAGGED_PROMPTS]
    assert [result.token_ids for result in batched] != greedy_tokens


# -- prefix reuse --

PREFIX = random_ids(10, seed=7)
SUFFIXES = [random_ids(n, seed=20 + n) for n in (1, 4, 7)]


def snapshot(cache: ConcatKVCache | StaticKVCache) -> tuple[int, list[torch.Tensor]]:
    """How many positions the cache holds and a copy of every key/value tensor in it."""
    if isinstance(cache, ConcatKVCache):
        tensors = [t for layer in cache.past_kv for t in layer]
    else:
        tensors = [t for layer in cache.layers for t in (layer.k, layer.v)]
    return cache.seq_len, [t.clone() for t in tensors]


def assert_unchanged(cache, before: tuple[int, list[torch.Tensor]]) -> None:
    seq_len, tensors = snapshot(cache)
    assert seq_len == before[0]
    assert all(torch.equal(a, b) for a, b in zip(tensors, before[1], strict=True))


@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
def test_forks_of_a_prefix_equal_independent_runs(cache_kind: str) -> None:
    model = tiny_model()
    config = greedy(20)  # prefix + suffix + 20 > 32: the forks outgrow the window too
    cache = make_cache(cache_kind)
    with torch.inference_mode():
        prefill(model, cache, [PREFIX])
    before = snapshot(cache)
    forks = cache.fork(len(SUFFIXES))
    assert all(fork.seq_len == len(PREFIX) for fork in forks)
    if cache_kind == "static":  # copy-on-fork: no two caches share a buffer
        buffers = [lc.k.data_ptr() for c in [cache, *forks] for lc in c.layers]
        buffers += [lc.v.data_ptr() for c in [cache, *forks] for lc in c.layers]
        assert len(set(buffers)) == len(buffers)

    # Step the forks round-robin, so each one writes between the others' steps.
    keep = checked_keep(model)
    prompts = [PREFIX + suffix for suffix in SUFFIXES]
    runs = [
        cached_steps(model, [Sequence(p, config)], keep, f)
        for p, f in zip(prompts, forks, strict=True)
    ]
    tokens: list[list[int]] = [[] for _ in runs]
    logits: list[list[torch.Tensor]] = [[] for _ in runs]
    with torch.inference_mode():
        for _ in range(config.max_tokens):
            for i in reversed(range(len(runs))):
                [token], step_logits = next(runs[i])
                tokens[i].append(token)
                logits[i].append(step_logits[0])
    for prompt, got_tokens, got_logits in zip(prompts, tokens, logits, strict=True):
        want = oracle(tuple(prompt), config.max_tokens)
        assert got_tokens == want.token_ids
        for got, ref in zip(got_logits, want.step_logits, strict=True):
            assert_logits_close(got, ref)
    assert_unchanged(cache, before)

    # The prefix cache itself still continues any suffix, through the public API.
    [fork] = cache.fork(1)
    result = generate(model, prompts[0], config, cache=fork, keep_logits=True)
    assert_matches_oracle(result, oracle(tuple(prompts[0]), config.max_tokens))
    assert_unchanged(cache, before)


@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
def test_n_new_tokens_take_one_prefill_and_n_minus_1_steps(cache_kind: str) -> None:
    """The last token is never fed back: nothing would read its logits."""
    cache = make_cache(cache_kind)
    with model_calls(tiny_model()) as calls:
        generate(tiny_model(), [1, 2, 3], greedy(5), cache=cache)
    assert [ids.size(1) for ids in calls] == [3, 1, 1, 1, 1]
    assert cache.seq_len == 3 + 4
    with model_calls(tiny_model()) as calls:
        generate(tiny_model(), [1, 2, 3], greedy(1), cache=make_cache(cache_kind))
    assert [ids.size(1) for ids in calls] == [3]  # one token: the prefill's logits give it


# -- multi-turn --


@contextlib.contextmanager
def model_calls(model) -> Iterator[list[torch.Tensor]]:
    """Record the token ids of every call made to `model` (the real forward still runs)."""
    calls: list[torch.Tensor] = []
    hook = model.register_forward_pre_hook(lambda _module, args: calls.append(args[0].clone()))
    try:
        yield calls
    finally:
        hook.remove()


@pytest.mark.parametrize("stop", ["length", "eot"])
@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
def test_a_second_turn_prefills_only_itself_and_equals_one_run(cache_kind: str, stop: str) -> None:
    model = tiny_model()
    first_prompt = random_ids(6, seed=3)
    user_turn = random_ids(4, seed=4)
    first_oracle = oracle(tuple(first_prompt), 8).token_ids
    eot_id = None
    if stop == "eot":  # the first turn ends on "end of text" after 5 tokens
        eot_id = first_oracle[5]
        assert eot_id not in first_oracle[:5]
    config = SamplingParams(max_tokens=8, ignore_eos=stop != "eot")
    cache = make_cache(cache_kind)
    turn1 = generate(model, first_prompt, config, cache=cache, eot_id=eot_id)
    assert turn1.finish_reason == {"length": "length", "eot": "stop"}[stop]
    ended_with = [eot_id] if stop == "eot" else []  # the chat keeps its end-of-text token
    history = first_prompt + turn1.token_ids + ended_with
    second_prompt = history + user_turn

    held = cache.seq_len
    assert held == len(history) - 1  # all but the newest token, never fed back
    with model_calls(model) as calls:
        turn2 = generate(model, second_prompt, greedy(12), cache=cache, keep_logits=True)
    assert calls[0].tolist() == [second_prompt[held:]]  # only what the cache lacks
    assert_matches_oracle(turn2, oracle(tuple(second_prompt), 12))


# -- chunked prefill --

LONG_PROMPT = random_ids(29, seed=5)  # 29 is a multiple of none of the chunk sizes but 1


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
def test_chunked_prefill_equals_one_shot_prefill(cache_kind: str, chunk: int) -> None:
    model = tiny_model()
    one_shot = generate(
        model, LONG_PROMPT, greedy(6), cache=make_cache(cache_kind), keep_logits=True
    )
    cache = make_cache(cache_kind)
    with model_calls(model) as calls:
        chunked = generate(
            model, LONG_PROMPT, greedy(6), cache=cache, keep_logits=True, prefill_chunk=chunk
        )
    prefill_calls = -(-len(LONG_PROMPT) // chunk)
    widths = [ids.size(1) for ids in calls[:prefill_calls]]
    assert sum(widths) == len(LONG_PROMPT) and max(widths) <= chunk
    assert_matches_oracle(chunked, one_shot)
    assert_matches_oracle(chunked, oracle(tuple(LONG_PROMPT), 6))


@pytest.mark.parametrize("position_embedding", POSITION_KINDS)
@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
def test_chunked_prefill_of_a_ragged_batch(cache_kind: str, position_embedding: str) -> None:
    prompts = [random_ids(1, seed=8), random_ids(11, seed=9), LONG_PROMPT]
    results = generate_batch(
        tiny_model(position_embedding),
        prompts,
        greedy(6),
        cache=make_cache(cache_kind, len(prompts), position_embedding),
        keep_logits=True,
        prefill_chunk=3,
    )
    for prompt, result in zip(prompts, results, strict=True):
        assert_matches_oracle(result, oracle(tuple(prompt), 6, position_embedding))


# -- shapes that disagree --


def run_on(cache, batch: int, length: int) -> torch.Tensor:
    """Feed `length` zero tokens per row to the model on top of `cache`; the last logits."""
    with torch.no_grad():
        return tiny_model()(torch.zeros(batch, length, dtype=torch.long), cache=cache).logits


def static_cache_holding(batch: int, length: int) -> StaticKVCache:
    cache = make_cache("static", batch_size=batch)
    run_on(cache, batch, length)
    return cache


def concat_cache_holding(length: int, batch: int = 1) -> ConcatKVCache:
    cache = ConcatKVCache()
    run_on(cache, batch, length)
    return cache


def ragged_concat_cache() -> ConcatKVCache:
    cache = ConcatKVCache()
    cache.reset(torch.tensor([0, 2, 1]))
    return cache


MISMATCHES = {
    "past for another batch": (
        lambda: run_on(concat_cache_holding(4, batch=2), 1, 1),
        r"the cache holds 2 row\(s\), but 1 row\(s\) of ids were given",
    ),
    "static cache for another batch": (
        lambda: run_on(static_cache_holding(2, 3), 1, 1),
        r"static cache holds 2 row\(s\) x 32 positions: 1 row\(s\) with past \(3\)",
    ),
    "past + new over the context": (
        lambda: run_on(concat_cache_holding(30), 1, 3),
        r"a token would stand at position 32, but .* block_size - 1 = 31",
    ),
    "static cache past its slots": (
        lambda: run_on(static_cache_holding(1, 30), 1, 3),
        r"1 row\(s\) x 32 positions: 1 row\(s\) with past \(30\) \+ new \(3\) = 33 do not fit",
    ),
    "static pad_lengths for another batch": (
        lambda: make_cache("static", batch_size=2).reset(torch.tensor([0, 1, 2])),
        r"pad_lengths has shape \(3,\), but the cache holds 2 rows",
    ),
    "concat pad_lengths for another batch": (
        lambda: run_on(ragged_concat_cache(), 2, 3),
        r"pad_lengths has shape \(3,\), but 2 row\(s\) of ids were given",
    ),
    "batch on a static cache for another batch": (
        lambda: generate_batch(
            tiny_model(), RAGGED_PROMPTS[:2], greedy(2), cache=make_cache("static", 3)
        ),
        r"static cache holds 3 row\(s\) but 2 prompt\(s\) .* StaticKVCache\(model, batch_size=2\)",
    ),
    "reused cache longer than the prompt": (
        lambda: generate(tiny_model(), [1, 2, 3], greedy(2), cache=concat_cache_holding(5)),
        r"already holds 5 tokens .* got 1 prompt\(s\) of 3 tokens",
    ),
    "reused cache for several prompts": (
        lambda: generate_batch(
            tiny_model(), [list(range(8)), list(range(9))], greedy(2), cache=concat_cache_holding(5)
        ),
        r"already holds 5 tokens .* got 2 prompt\(s\)",
    ),
    "no prompts at all": (
        lambda: generate_batch(tiny_model(), [], greedy(2)),
        "no prompts given",
    ),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_shapes_that_disagree_are_clear_errors(case: str) -> None:
    run, message = MISMATCHES[case]
    with pytest.raises(RoseError, match=message):
        run()


def test_a_refused_reset_leaves_the_static_cache_as_it_was() -> None:
    cache = static_cache_holding(2, 3)
    with pytest.raises(RoseError, match="pad_lengths"):
        cache.reset(torch.tensor([1]))
    assert cache.seq_len == 3 and cache.pad_lengths is None
    assert run_on(cache, 2, 1).shape == (2, 1, 512) and cache.seq_len == 4
