"""Each KV-cache invariant, broken on purpose, makes the cached output leave the oracle.

The three named functions of `rosetrainer/model.py` are swapped one at a time for the
bug of `rosecourse/naive.py` that breaks them; the oracle (no cache: no past, a plain
causal mask, positions from 0) is untouched by all three, the cached path is not.
"""

from __future__ import annotations

import inspect
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from models import assert_clear_margins, make_test_model

import rosetrainer.model
from rosecourse.naive import lose_past_kv, positions_from_zero, top_left_causal_mask
from roseinfer.cache.dense import ConcatKVCache, StaticKVCache
from roseinfer.cache.paged import FlatPagedKVCache, KVPool, PagedKVCache
from roseinfer.loops.generate import generate
from roseinfer.request.sampling import SamplingParams
from rosetrainer.errors import RoseError
from rosetrainer.model import (
    AttendingKVCache,
    KVCache,
    causal_mask,
    one_query_attention,
    position_ids,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [11, 250, 37, 402, 8, 199, 61, 340]
NEW_TOKENS = 12
CONFIG = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return make_test_model(seed=0)


@pytest.fixture(scope="module")
def oracle_tokens(model) -> list[int]:
    result = generate(model, PROMPT, CONFIG, use_cache=False, keep_logits=True)
    assert_clear_margins(result.step_logits)
    return result.token_ids


def first_difference(tokens: list[int], expected: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b), None)


def test_unpatched_cache_matches_the_oracle(model, oracle_tokens) -> None:
    assert generate(model, PROMPT, CONFIG, cache=ConcatKVCache()).token_ids == oracle_tokens


def test_top_left_mask_diverges_at_the_first_decode_step(model, oracle_tokens) -> None:
    with mock.patch.object(rosetrainer.model, "causal_mask", top_left_causal_mask):
        tokens = generate(model, PROMPT, CONFIG, cache=ConcatKVCache()).token_ids
    # Step 0 comes from the prefill (q_len == kv_len: both masks agree); step 1 is the
    # first query with a past, and the top-left row lets it see key 0 only.
    assert first_difference(tokens, oracle_tokens) == 1


def test_positions_from_zero_diverge_at_the_first_decode_step(model, oracle_tokens) -> None:
    with mock.patch.object(rosetrainer.model, "position_ids", positions_from_zero):
        tokens = generate(model, PROMPT, CONFIG, cache=ConcatKVCache()).token_ids
    assert first_difference(tokens, oracle_tokens) == 1


def test_lost_past_diverges_at_the_first_decode_step(model, oracle_tokens) -> None:
    with mock.patch.object(rosetrainer.model, "concat_kv", lose_past_kv):
        tokens = generate(model, PROMPT, CONFIG, cache=ConcatKVCache()).token_ids
    # The prefill has no past to lose, so its token still equals the oracle's.
    assert first_difference(tokens, oracle_tokens) == 1


def test_the_naive_functions_are_the_bugs_they_name() -> None:
    # Bottom-right vs top-left: for 2 queries over 4 keys the last two rows vs the first two.
    full = torch.ones(4, 4, dtype=torch.bool).tril()
    assert torch.equal(causal_mask(2, 4), full[2:])
    assert torch.equal(top_left_causal_mask(2, 4), full[:2])
    assert torch.equal(top_left_causal_mask(4, 4), causal_mask(4, 4))
    assert position_ids(5, 2).tolist() == [5, 6]
    assert positions_from_zero(5, 2).tolist() == [0, 1]
    past = (torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    new = (torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))
    assert rosetrainer.model.concat_kv(past, *new)[0].shape == (1, 2, 4, 4)
    lost_k, lost_v = lose_past_kv((torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4)), *new)
    assert lost_k.shape == (1, 2, 4, 4) and lost_k[:, :, :3].abs().sum() == 0
    assert torch.equal(lost_v[:, :, 3:], new[1])


# -- the model's own errors: what a caller got wrong, with the shapes named --


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_query_attention_is_sdpa(dtype: torch.dtype) -> None:
    """The decode step's written-out attention equals SDPA's for one query: over every key,
    and under a padding mask that hides a different number of keys per row; with the
    values laid out as usual and stored transposed (a view whose last dimension is not the
    contiguous one)."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 4, n, 16, generator=generator) for n in (1, 37, 37))
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    real_keys = torch.arange(37)[None, :] >= torch.tensor([0, 5, 36])[:, None]
    mask = real_keys[:, None, None, :]  # (B, 1, 1, kv_len): row 2 sees only its last key
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    v_stored_transposed = v.transpose(-2, -1).contiguous().transpose(-2, -1)
    assert v_stored_transposed.stride(-1) != 1 and torch.equal(v_stored_transposed, v)
    for attn_mask in (None, mask):
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        for values in (v, v_stored_transposed):
            got = one_query_attention(q, k, values, attn_mask)
            torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    # Row 2 attends to its one real key only: its output is exactly that key's value.
    torch.testing.assert_close(one_query_attention(q, k, v, mask)[2], v[2, :, -1:])


def test_past_plus_new_over_block_size(model) -> None:
    cache = ConcatKVCache()
    model(torch.zeros(1, 30, dtype=torch.long), cache=cache)
    with pytest.raises(RoseError, match=r"position 32, but .* stop at block_size - 1 = 31"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)


@pytest.mark.parametrize("bad_id", [-1, 512])
def test_ids_outside_the_vocabulary(model, bad_id: int) -> None:
    with pytest.raises(RoseError, match=rf"token id {bad_id} is outside the vocabulary \[0, 512\)"):
        model(torch.tensor([[1, bad_id, 2]]))


def test_caches_satisfy_the_protocol(model) -> None:
    """The model asks every cache the same two questions (prepare, update): both caches
    answer them, and `GPT.forward` never asks which kind of cache it was given."""
    for cache in (ConcatKVCache(), StaticKVCache(model)):
        assert isinstance(cache, KVCache)
    gpt = rosetrainer.model
    forwards = (gpt.GPT.forward, gpt.Block.forward, gpt.CausalSelfAttention.forward)
    assert not any("isinstance" in inspect.getsource(f) for f in forwards)
    assert len(inspect.getsource(gpt.GPT.forward).splitlines()) <= 40


def test_the_engines_paged_cache_attends_itself(model) -> None:
    """The engine's paged cache answers the attending form of the protocol (the model hands
    it queries, keys and values and gets the outputs back); the readable flat one, like
    the dense caches, the keys-returning form."""
    pool = KVPool(model.config, 4, 4, torch.float32, torch.device("cpu"))
    paged = PagedKVCache(pool, [[0]], [0], [2])
    flat = FlatPagedKVCache(pool, [[0]], [0], [2])
    assert isinstance(paged, AttendingKVCache) and not isinstance(paged, KVCache)
    assert isinstance(flat, KVCache) and not isinstance(flat, AttendingKVCache)


def test_mismatched_cache_shapes(model) -> None:
    cache = ConcatKVCache()
    model(torch.zeros(2, 4, dtype=torch.long), cache=cache)
    with pytest.raises(RoseError, match=r"the cache holds 2 row\(s\), but 1 row\(s\)"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    assert cache.seq_len == 4  # a refused call leaves the cache as it was


def test_static_cache_errors(model) -> None:
    cache = StaticKVCache(model, max_len=8)
    model(torch.zeros(1, 6, dtype=torch.long), cache=cache)
    with pytest.raises(RoseError, match=r"8 positions: .*past \(6\) \+ new \(3\) = 9 do not fit"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    assert cache.seq_len == 6
    with pytest.raises(RoseError, match="1..block_size"):
        StaticKVCache(model, max_len=33)
