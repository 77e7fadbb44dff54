"""Speculative decoding in the teaching loop: greedy output equal to the uncached oracle
for every draft kind and k in 1..8, each cache rolled back (and a wrong rollback
caught), and the sampled accept rule's output distributed as the target's (a
chi-square test that the right rule passes and two wrong rules fail)."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import LLAMA_CHOICES, assert_logits_close, make_test_model, perturbed_copy

from roseinfer.cache.dense import ConcatKVCache, StaticKVCache
from roseinfer.cache.quantized import QuantizedKVCache
from roseinfer.cache.rolling import RollingKVCache
from roseinfer.loops.generate import generate
from roseinfer.loops.speculative import speculative_generate
from roseinfer.request.sampling import SamplingParams, sampling_probs
from roseinfer.request.sequence import Sequence
from roseinfer.speculative import verify
from roseinfer.speculative.drafters import (
    ModelDrafter,
    NgramDrafter,
    SpeculativeConfig,
    first_layers,
    load_drafter,
    prompt_lookup,
)
from roseinfer.speculative.verify import SpeculativeStats, accept_or_resample
from rosetrainer.errors import RoseError
from rosetrainer.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONTEXT = 32
# Repeats inside the prompt give prompt lookup something to find.
PROMPT = [5, 17, 99, 5, 17, 300, 8, 5, 17]
GREEDY = SamplingParams(max_tokens=50)  # past the 32-token context: the window slides


@pytest.fixture(scope="module")
def target():
    return make_test_model(0, n_layer=3, block_size=CONTEXT)


@pytest.fixture(scope="module")
def drafters(target):
    return {
        "draft": lambda: ModelDrafter(perturbed_copy(target, 0.1)),
        "ngram": lambda: NgramDrafter(1, 3),
        "self": lambda: ModelDrafter(first_layers(target, 1)),
    }


@pytest.fixture(scope="module")
def oracle(target):
    return generate(target, PROMPT, GREEDY, use_cache=False).token_ids


@pytest.mark.parametrize("kind", ["draft", "ngram", "self"])
@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_speculative_equals_the_uncached_oracle(target, drafters, oracle, kind, k) -> None:
    stats = SpeculativeStats()
    cache = StaticKVCache(target) if k % 2 else ConcatKVCache()
    result = speculative_generate(
        target, drafters[kind](), PROMPT, GREEDY, num_speculative_tokens=k, cache=cache, stats=stats
    )
    assert result.token_ids == oracle
    assert result.finish_reason == "length"
    # Both roads were taken: some drafts kept, some rejected (so the cache rolled back).
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


@settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    prompt=st.lists(st.integers(0, 40), min_size=1, max_size=CONTEXT),  # a small alphabet: repeats
    max_tokens=st.integers(1, 45),
    k=st.integers(1, 8),
    kind=st.sampled_from(["draft", "ngram", "self"]),
    static=st.booleans(),
    stop_at=st.integers(0, 60),
)
@pytest.mark.slow
def test_any_prompt_and_stop_equals_the_oracle(
    target, drafters, prompt, max_tokens, k, kind, static, stop_at
) -> None:
    """Drawn prompts (up to a full context), lengths, k, drafters and caches; a stop token
    taken from the oracle's own output (so it stops inside a run)."""
    params = SamplingParams(max_tokens=max_tokens)
    want = generate(target, prompt, params, use_cache=False).token_ids
    if stop_at < len(want):
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=(want[stop_at],))
        want = want[: want.index(want[stop_at]) + 1]
    cache = StaticKVCache(target) if static else ConcatKVCache()
    got = speculative_generate(
        target, drafters[kind](), prompt, params, num_speculative_tokens=k, cache=cache
    )
    assert got.token_ids == want


def test_all_drafts_accepted_gives_the_bonus_token(target, oracle) -> None:
    """The target drafting for itself: every draft agrees, each round makes k + 1 tokens."""
    stats = SpeculativeStats()
    params = SamplingParams(max_tokens=CONTEXT - len(PROMPT))  # inside the window: no restart
    result = speculative_generate(
        target, ModelDrafter(target), PROMPT, params, num_speculative_tokens=4, stats=stats
    )
    assert result.token_ids == oracle[: params.max_tokens]
    assert stats.acceptance_rate == 1.0
    # 23 tokens in 5 rounds: four of 4 drafts + the bonus, a last one of 2 drafts + the bonus.
    assert (stats.num_drafts, stats.num_draft_tokens) == (5, 18)
    assert stats.mean_accepted_length == len(result.token_ids) / stats.num_drafts


def test_stops_inside_an_accepted_run(target, oracle) -> None:
    """A stop token among accepted drafts ends the request there: nothing past it."""
    stop = oracle[6]
    params = SamplingParams(max_tokens=20, stop_token_ids=(stop,))
    result = speculative_generate(
        target, ModelDrafter(target), PROMPT, params, num_speculative_tokens=8
    )
    assert result.token_ids == oracle[: oracle.index(stop) + 1]
    assert result.stop_reason == stop


def test_end_of_text_inside_an_accepted_run_ends_it(target, oracle) -> None:
    """End-of-text (here: the id the oracle makes at step 6) among accepted drafts: the
    request stops there, end-of-text not kept, as the oracle does."""
    eot = oracle[6]
    params = SamplingParams(max_tokens=20)
    want = generate(target, PROMPT, params, use_cache=False, eot_id=eot)
    got = speculative_generate(
        target, ModelDrafter(target), PROMPT, params, num_speculative_tokens=8, eot_id=eot
    )
    assert got.token_ids == want.token_ids == oracle[: oracle.index(eot)]
    assert got.finish_reason == "stop" and got.stop_reason == eot


def test_a_rotary_model_rolls_back_too() -> None:
    model = make_test_model(3, n_layer=3, block_size=CONTEXT, position_embedding="rotary")
    want = generate(model, PROMPT, GREEDY, use_cache=False).token_ids
    stats = SpeculativeStats()
    got = speculative_generate(
        model, ModelDrafter(first_layers(model, 2)), PROMPT, GREEDY, num_speculative_tokens=3,
        cache=StaticKVCache(model), stats=stats,
    )  # fmt: skip
    assert got.token_ids == want
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("cache_kind", ["concat", "static"])
def test_a_grouped_model_rolls_back_too(cache_kind) -> None:
    """Four query heads over one key/value head: the cache holds (and truncates) that one."""
    model = make_test_model(3, n_layer=3, n_head=4, block_size=CONTEXT, **LLAMA_CHOICES)
    want = generate(model, PROMPT, GREEDY, use_cache=False).token_ids
    cache = ConcatKVCache() if cache_kind == "concat" else StaticKVCache(model)
    stats = SpeculativeStats()
    got = speculative_generate(
        model, ModelDrafter(first_layers(model, 2)), PROMPT, GREEDY, num_speculative_tokens=3,
        cache=cache, stats=stats,
    )  # fmt: skip
    assert got.token_ids == want
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


class KeepsRejectedKeys(ConcatKVCache):
    """The wrong rollback: the rejected drafts' keys and values stay in the cache."""

    def truncate(self, n: int) -> None:
        pass


def test_a_wrong_rollback_diverges() -> None:
    model = make_test_model(0, n_layer=3, block_size=256)  # room for the keys left behind
    params = SamplingParams(max_tokens=20)
    want = generate(model, PROMPT, params, use_cache=False).token_ids
    result = speculative_generate(
        model, ModelDrafter(first_layers(model, 1)), PROMPT, params, num_speculative_tokens=4,
        cache=KeepsRejectedKeys(),
    )  # fmt: skip
    assert result.token_ids != want


def test_a_quantized_cache_rolls_back_inside_its_exact_window(target) -> None:
    """Equal to the same quantized cache without speculation (quantizing changes logits,
    so the oracle here is that cache's own run); a window smaller than k is refused."""
    params = SamplingParams(max_tokens=CONTEXT - len(PROMPT))

    def quantized(window: int) -> QuantizedKVCache:
        return QuantizedKVCache(target, window=window, group_size=4)

    want = generate(target, PROMPT, params, cache=quantized(8)).token_ids
    got = speculative_generate(
        target, ModelDrafter(first_layers(target, 1)), PROMPT, params,
        num_speculative_tokens=4, cache=quantized(8),
    )  # fmt: skip
    assert got.token_ids == want
    with pytest.raises(RoseError, match="quantized already"):
        speculative_generate(
            target, ModelDrafter(first_layers(target, 1)), PROMPT, params,
            num_speculative_tokens=4, cache=quantized(0),
        )  # fmt: skip


def test_bad_settings_are_one_clear_error(target) -> None:
    ngram = NgramDrafter()
    for k in (0, -1, CONTEXT):
        with pytest.raises(RoseError, match="speculative tokens"):
            speculative_generate(target, ngram, PROMPT, GREEDY, num_speculative_tokens=k)
    windowed = make_test_model(0, position_embedding="rotary", sliding_window=8)
    with pytest.raises(RoseError, match="sliding window"):
        speculative_generate(windowed, ngram, PROMPT, GREEDY, num_speculative_tokens=2)
    with pytest.raises(RoseError, match="cannot be rolled back"):
        RollingKVCache(windowed).truncate(0)
    with pytest.raises(RoseError, match="first 1 .. 2 layers"):
        first_layers(target, 3)
    with pytest.raises(RoseError, match="1 <= min <= max"):
        NgramDrafter(3, 2)


def test_a_draft_with_another_vocabulary_is_refused(target) -> None:
    tokenizer = Tokenizer("gpt2")
    other = make_test_model(1, vocab_size=256)
    config = SpeculativeConfig(4, "draft", model="in memory")
    with pytest.raises(RoseError, match="vocabulary has 256 tokens"):
        load_drafter(config, target, tokenizer, other, tokenizer)
    with pytest.raises(RoseError, match="tokenizer 'r50k_base'"):
        load_drafter(config, target, tokenizer, perturbed_copy(target, 0.1), Tokenizer("r50k_base"))
    with pytest.raises(RoseError, match="draft model not found"):
        load_drafter(SpeculativeConfig(4, "draft", model="/no/such/dir"), target, tokenizer)


def test_a_draft_model_drafts_for_many_requests_as_for_each_alone(target) -> None:
    """The engine asks for every request's drafts at once: each request's cache catches
    up alone, then the drafts are one batched call per token over the caches stacked
    left-padded. Each request gets the drafts it would get alone, with any k, step after
    step (its cache rolled back to what it kept in between)."""
    draft = perturbed_copy(target, 0.1)
    prompts = [[5, 6, 7], list(range(100, 120)), [9] * 11]
    seqs = [Sequence(list(p), GREEDY) for p in prompts]
    alone = [Sequence(list(p), GREEDY) for p in prompts]
    together, separately = ModelDrafter(draft), ModelDrafter(draft)
    for ks in ([4, 2, 3], [1, 4, 4], [3, 3, 1]):
        drafts = together.propose(seqs, ks)
        for seq, single, k, got in zip(seqs, alone, ks, drafts, strict=True):
            (want,) = separately.propose([single], [k])
            assert got.tokens == want.tokens and len(got.tokens) == k
            # The request keeps the first draft and one token of its own, as after a rejection.
            for each in (seq, single):
                each.append_token(got.tokens[0])
                each.append_token(7)


def test_stacked_caches_give_each_row_its_own_logits(target) -> None:
    caches, logits = [], []
    with torch.no_grad():
        for ids in ([5, 6, 7], list(range(100, 120)), [9] * 11):
            cache = ConcatKVCache()
            target(torch.tensor([ids[:-1]]), cache=cache)
            caches.append(cache)
            alone = copy.deepcopy(cache)
            logits.append(target(torch.tensor([ids[-1:]]), cache=alone).logits[0, -1])
        batch = ConcatKVCache.stacked(caches)
        last = torch.tensor([[7], [119], [9]])
        together = target(last, cache=batch).logits[:, -1]
    for row, want in enumerate(logits):
        assert_logits_close(together[row], want, f"row {row}: ")
    lengths = [cache.seq_len for cache in batch.unstacked()]
    assert lengths == [3, 20, 11]  # each row: its past and the token just fed, no padding


def test_prompt_lookup_takes_the_longest_latest_match_with_k_tokens_after() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 4, 7, 1, 2]
    assert prompt_lookup(tokens, 3, 1, 3) == [4, 7, 1]  # "1 2" latest earlier at index 4
    assert prompt_lookup(tokens + [3], 2, 1, 3) == [9, 1]  # "1 2 3" beats the shorter ones
    assert prompt_lookup([1, 2, 3], 4, 1, 2) == []
    assert prompt_lookup([5, 5, 5], 4, 1, 1) == [5, 5]  # none has 4 after it: the most
    # Text that repeats: the latest match overlaps the tail and leaves one token; the latest
    # one with k tokens after it drafts all k
    assert prompt_lookup([5] * 10, 4, 1, 2) == [5, 5, 5, 5]
    assert prompt_lookup([1, 2, 3, 1, 2, 3, 1, 2], 3, 1, 2) == [3, 1, 2]


# ---------------------------------------------------------------------------
# The sampled rule: its output is distributed as the target's
# ---------------------------------------------------------------------------

SIGNIFICANCE = 1e-4  # a right rule fails this seeded test with probability 1e-4


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of observed counts against probabilities (bins expected
    to hold fewer than 5 are merged into one); the p-value."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)])
        expected = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    statistic = ((counts.double() - expected) ** 2 / expected).sum()
    dof = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), statistic / 2))


def no_residual(p, q, drafted, generator):
    """Wrong: on rejection, draw from p itself (the rejected mass is counted twice)."""
    u = torch.rand((), generator=generator)
    if u * q[drafted] < p[drafted]:
        return drafted, True
    return int(torch.multinomial(p, 1, generator=generator)), False


def accept_when_draft_likelier(p, q, drafted, generator):
    """Wrong: keep a draft the draft model likes more than the target does."""
    if q[drafted] > p[drafted]:
        return drafted, True
    residual = (p - q).clamp(min=0)
    return int(torch.multinomial(residual / residual.sum(), 1, generator=generator)), False


P = torch.tensor([0.5, 0.3, 0.15, 0.05])
Q = torch.tensor([0.1, 0.2, 0.3, 0.4])


@pytest.mark.parametrize(
    "rule, right",
    [(accept_or_resample, True), (no_residual, False), (accept_when_draft_likelier, False)],
)
@pytest.mark.slow
def test_one_position_of_the_sampled_rule_draws_from_p(rule, right) -> None:
    """A draft x ~ q, then the rule: the token must be distributed as p, for 20,000 draws."""
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(len(P))
    for _ in range(20_000):
        drafted = int(torch.multinomial(Q, 1, generator=generator))
        token, _ = rule(P, Q, drafted, generator)
        counts[token] += 1
    assert (chi_square_p_value(counts, P) >= SIGNIFICANCE) == right


@pytest.mark.parametrize(
    "rule, right",
    [(accept_or_resample, True), (no_residual, False), (accept_when_draft_likelier, False)],
)
@pytest.mark.slow
def test_sampled_speculative_generation_draws_the_targets_sequences(rule, right) -> None:
    """The whole loop on a 4-token vocabulary: two sampled tokens, the first drafted by
    another model and verified (accepted or resampled), the second the verify step's own
    draw; 3,000 seeds; the 16 sequences' frequencies against the target's exact
    probabilities. (Temperature 5 keeps p spread, so each wrong rule's bias shows: its
    p-value is below 1e-10 here, the right rule's 0.16.)"""
    target = make_test_model(0, vocab_size=4, block_size=16)
    draft = make_test_model(1, vocab_size=4, block_size=16)
    params = SamplingParams(max_tokens=2, temperature=5.0)
    prompt = [1, 2]
    with torch.no_grad():
        first = sampling_probs(target(torch.tensor([prompt])).logits[0, -1], params)
        exact = torch.stack(
            [first[a] * sampling_probs(target(torch.tensor([prompt + [a]])).logits[0, -1], params)
             for a in range(4)]
        ).flatten()  # fmt: skip
    counts = torch.zeros(16)
    stats = SpeculativeStats()
    with mock.patch.object(verify, "accept_or_resample", rule):
        for seed in range(3000):
            result = speculative_generate(
                target, ModelDrafter(draft), prompt, SamplingParams(**{**vars(params), "seed": seed}),
                num_speculative_tokens=1, stats=stats,
            )  # fmt: skip
            a, b = result.token_ids
            counts[4 * a + b] += 1
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert (chi_square_p_value(counts, exact) >= SIGNIFICANCE) == right
