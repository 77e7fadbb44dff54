"""The quantized KV cache: round trips within their bound, exact int4 packing, an exact
window that flushes a group at a time, and greedy tokens checked against the oracle."""

from __future__ import annotations

import functools

import pytest
import torch
from models import assert_clear_margins, assert_logits_close, make_test_model

from roseinfer.cache.quantized import (
    CHANNEL_DIM,
    TIME_DIM,
    QuantizedKVCache,
    QuantizedLayerCache,
    dequantize,
    kv_bytes_per_token,
    make_kv_cache,
    pack_int4,
    quantize,
    unpack_int4,
)
from roseinfer.loops.generate import generate, generate_batch
from roseinfer.request.sampling import SamplingParams
from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError
from rosetrainer.numerics import logit_tolerance

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY_64 = SamplingParams(max_tokens=64, ignore_eos=True)
PROMPT = [7, 300, 42, 9, 120, 5]


def keys_with_an_outlier_channel(seed: int = 0) -> torch.Tensor:
    """(B, H, T, D) keys like a trained model's: channel 3 of every head runs ~20x larger."""
    generator = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 3, 64, 16, generator=generator)
    k[..., 3] = k[..., 3] * 20 + 40
    return k


def group_scales(scale: torch.Tensor, group_size: int, dim: int) -> torch.Tensor:
    """Each number's group scale, broadcast to the numbers' shape."""
    return scale.float().repeat_interleave(group_size, dim=dim)


# -- one group at a time ---------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dim", [TIME_DIM, CHANNEL_DIM], ids=["per-channel", "per-token"])
def test_round_trip_is_within_half_a_step_of_its_group(bits: int, dim: int) -> None:
    x = keys_with_an_outlier_channel()
    group_size = 8
    q = quantize(x, bits, group_size, dim)
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 2**bits - 1
    back = dequantize(q, group_size, dim, torch.float32)
    step = group_scales(q.scale, group_size, dim)
    # The stated bound: half a step of the number's own group (float32 rounding aside).
    assert torch.all((x - back).abs() <= step / 2 + 1e-5 * x.abs() + 1e-6)
    # ... and a step is the group's range over 2**bits - 1 (up to float16 rounding).
    groups = x.movedim(dim, -1).unflatten(-1, (-1, group_size))
    spread = (groups.amax(-1) - groups.amin(-1)).movedim(-1, dim)
    assert torch.allclose(q.scale.float(), spread / (2**bits - 1), rtol=2e-3, atol=1e-6)


def test_a_constant_group_comes_back_exactly() -> None:
    x = torch.full((1, 1, 8, 4), 0.375)
    q = quantize(x, 4, 4, CHANNEL_DIM)
    assert torch.equal(dequantize(q, 4, CHANNEL_DIM, torch.float32), x)


def test_keys_per_channel_fix_what_an_outlier_channel_does_per_token() -> None:
    """Per token, the outlier sets every group's scale and the ordinary channels lose their
    precision; per channel, the outlier only widens its own groups."""
    k = keys_with_an_outlier_channel()
    ordinary = [c for c in range(k.size(-1)) if c != 3]
    errors = {}
    for name, dim in (("channel", TIME_DIM), ("token", CHANNEL_DIM)):
        back = dequantize(quantize(k, 4, 16, dim), 16, dim, torch.float32)
        errors[name] = float((k - back)[..., ordinary].abs().mean())
    assert errors["channel"] * 10 < errors["token"], errors


def test_int4_packing_is_exact_and_halves_the_bytes() -> None:
    every_pair = torch.cartesian_prod(torch.arange(16), torch.arange(16)).to(torch.uint8)
    packed = pack_int4(every_pair)  # (256, 2) -> (256, 1): each byte value once
    assert packed.shape == (256, 1)
    assert sorted(packed.flatten().tolist()) == list(range(256))
    assert torch.equal(unpack_int4(packed), every_pair)
    codes = torch.randint(0, 16, (2, 3, 5, 16), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(codes)), codes)
    assert pack_int4(codes).nbytes * 2 == codes.nbytes


# -- the window ------------------------------------------------------------------------


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_window_is_exact_and_flushes_a_group_at_a_time(kv_cache_dtype: str) -> None:
    window, group = 4, 8
    bits = 8 if kv_cache_dtype == "int8" else 4
    shape = (1, 2, 40, 16)
    layer = QuantizedLayerCache(shape, bits, group, window, "channel", torch.float32, "cpu")
    keys, values = torch.randn(2, 1, 2, 40, 16)
    for n in range(1, 41):
        k_all, v_all = layer.update(keys[:, :, n - 1 : n], values[:, :, n - 1 : n])
        # The exact part fills up to window + group - 1, then its oldest group goes.
        expected_stored = max(0, n - window) // group * group
        assert layer.n_stored == expected_stored, n
        assert layer.n_exact == n - expected_stored
        assert n - layer.n_exact <= max(0, n - window)  # the latest `window` are never stored
        assert k_all.shape == (1, 2, n, 16)
        exact = slice(expected_stored, n)
        assert torch.equal(k_all[:, :, exact], keys[:, :, exact])
        assert torch.equal(v_all[:, :, exact], values[:, :, exact])
        if expected_stored:  # what was flushed is quantized: close, not equal
            stored = slice(0, expected_stored)
            assert not torch.equal(k_all[:, :, stored], keys[:, :, stored])
            assert torch.allclose(k_all[:, :, stored], keys[:, :, stored], atol=1.0)
    assert [n for n in range(1, 41) if max(0, n - window) % group == 0 and n > window] == [
        12,
        20,
        28,
        36,
    ]


def test_a_prefill_stores_the_same_groups_as_one_token_at_a_time() -> None:
    shape = (1, 2, 40, 16)
    keys, values = torch.randn(2, 1, 2, 37, 16)
    at_once = QuantizedLayerCache(shape, 4, 8, 4, "channel", torch.float32, "cpu")
    one_by_one = QuantizedLayerCache(shape, 4, 8, 4, "channel", torch.float32, "cpu")
    at_once.update(keys[:, :, :30], values[:, :, :30])
    for n in range(30):
        one_by_one.update(keys[:, :, n : n + 1], values[:, :, n : n + 1])
    for n in range(30, 37):
        got = at_once.update(keys[:, :, n : n + 1], values[:, :, n : n + 1])
        want = one_by_one.update(keys[:, :, n : n + 1], values[:, :, n : n + 1])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# -- against the oracle ----------------------------------------------------------------


@functools.cache
def model_with(position_embedding: str):
    # head size 32: the default group size (32) divides it
    return make_test_model(
        seed=0, n_embd=64, n_head=2, block_size=96, position_embedding=position_embedding
    )


@functools.cache
def oracle_of(position_embedding: str):
    model = model_with(position_embedding)
    result = generate(model, PROMPT, GREEDY_64, use_cache=False, keep_logits=True)
    assert_clear_margins(result.step_logits)
    return result


@pytest.fixture(scope="module")
def model():
    return model_with("learned")


# The oracle checks run on both position kinds: a rotary model's cache holds its keys
# after their turn, and those are what get quantized.
POSITION_KINDS = ["learned", "rotary"]


def max_logit_gap(result, oracle) -> float:
    return max(
        float((got - want).abs().max())
        for got, want in zip(result.step_logits, oracle.step_logits, strict=True)
    )


def assert_logits_match(result, oracle) -> None:
    for got, want in zip(result.step_logits, oracle.step_logits, strict=True):
        assert_logits_close(got, want)


@pytest.mark.parametrize("position_embedding", POSITION_KINDS)
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_a_window_longer_than_the_run_gives_the_full_precision_tokens(
    kv_cache_dtype: str, position_embedding: str
) -> None:
    model, oracle = model_with(position_embedding), oracle_of(position_embedding)
    total = len(PROMPT) + 64
    exact = QuantizedKVCache(model, max_len=total, kv_cache_dtype=kv_cache_dtype, window=total)
    result = generate(model, PROMPT, GREEDY_64, cache=exact, keep_logits=True)
    assert exact.layers[0].n_stored == 0
    assert result.token_ids == oracle.token_ids
    assert_logits_match(result, oracle)
    # Were the window quantized, the logits would move by far more than the tolerance here:
    quantized = QuantizedKVCache(model, max_len=total, kv_cache_dtype=kv_cache_dtype, window=0)
    moved = generate(model, PROMPT, GREEDY_64, cache=quantized, keep_logits=True)
    assert quantized.layers[0].n_stored == 64
    gap, tolerance = max_logit_gap(moved, oracle), logit_tolerance(oracle.step_logits)
    print(
        f"{kv_cache_dtype} without a window: logits move {gap:.1e}, {gap / tolerance:.0f}x the tolerance"
    )
    assert gap > 10 * tolerance


@pytest.mark.parametrize("position_embedding", POSITION_KINDS)
@pytest.mark.parametrize("group_size", [32, 16])
def test_int8_without_a_window_gives_the_oracle_tokens_over_64_steps(
    group_size: int, position_embedding: str
) -> None:
    model, oracle = model_with(position_embedding), oracle_of(position_embedding)
    cache = QuantizedKVCache(
        model, max_len=len(PROMPT) + 64, kv_cache_dtype="int8", window=0, group_size=group_size
    )
    result = generate(model, PROMPT, GREEDY_64, cache=cache, keep_logits=True)
    assert cache.layers[0].n_stored == (len(PROMPT) + 63) // group_size * group_size
    assert result.token_ids == oracle.token_ids


@pytest.mark.parametrize("keys_per", ["channel", "token"])
def test_rows_of_a_batch_never_share_a_group(model, keys_per: str) -> None:
    prompts = [PROMPT, [11, 12, 13, 14, 15, 16]]  # one length: no padding
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    options = dict(kv_cache_dtype="int4", window=0, group_size=8, keys_per=keys_per)
    batched = generate_batch(
        model, prompts, params, cache=QuantizedKVCache(model, 2, 30, **options)
    )
    for prompt, result in zip(prompts, batched, strict=True):
        alone = generate(model, prompt, params, cache=QuantizedKVCache(model, 1, 30, **options))
        assert result.token_ids == alone.token_ids


def test_forks_continue_on_their_own_copies(model) -> None:
    """One prefill of a shared prefix, forked: each continuation equals a fresh run on its
    whole prompt (the groups hold the same tokens however the prompt arrived)."""
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    options = dict(kv_cache_dtype="int4", window=2, group_size=8)
    cache = QuantizedKVCache(model, max_len=60, **options)
    generate(model, PROMPT * 2, SamplingParams(max_tokens=1), cache=cache)  # holds the prefix
    forks = cache.fork(2)
    for fork, tail in zip(forks, ([1, 2, 3], [400, 401, 402, 403, 404]), strict=True):
        prompt = PROMPT * 2 + tail
        continued = generate(model, prompt, params, cache=fork, keep_logits=True)
        fresh = generate(
            model,
            prompt,
            params,
            cache=QuantizedKVCache(model, max_len=60, **options),
            keep_logits=True,
        )
        assert continued.token_ids == fresh.token_ids
        assert_logits_match(continued, fresh)
    assert cache.seq_len == len(PROMPT) * 2  # the forks' runs left the original alone


def test_bytes_per_token_counts_codes_and_scales(model) -> None:
    config = GPTConfig.from_preset("gpt2")
    fp32 = kv_bytes_per_token(config, "auto")
    assert fp32 == 2 * 12 * 768 * 4
    assert kv_bytes_per_token(config, "int8") / fp32 <= 0.3
    assert kv_bytes_per_token(config, "int4") / fp32 <= 0.17
    for kv_cache_dtype in ("int8", "int4"):
        cache = QuantizedKVCache(model, max_len=96, kv_cache_dtype=kv_cache_dtype, window=8)
        window_bytes = sum(layer.exact_k.nbytes + layer.exact_v.nbytes for layer in cache.layers)
        per_token = kv_bytes_per_token(model.config, kv_cache_dtype)
        assert cache.nbytes - window_bytes == per_token * 96


# -- mistakes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "complaint"),
    [
        (dict(kv_cache_dtype="int3"), "unknown KV cache dtype 'int3': choose one of auto, int8"),
        (dict(kv_cache_dtype="int8", group_size=12), "group size 12 does not divide the head"),
        (dict(kv_cache_dtype="int4", window=-1), "window is a number of tokens >= 0"),
        (dict(kv_cache_dtype="int8", keys_per="head"), "keys are quantized per channel"),
    ],
)
def test_bad_settings_are_one_clear_line(model, options: dict, complaint: str) -> None:
    with pytest.raises(RoseError, match=complaint) as err:
        make_kv_cache(model, **options)
    assert "\n" not in str(err.value)


def test_a_quantized_cache_does_not_compile(model) -> None:
    cache = QuantizedKVCache(model, max_len=20)
    with pytest.raises(RoseError, match="compile needs an unquantized StaticKVCache"):
        generate(model, PROMPT, SamplingParams(max_tokens=2), cache=cache, compile="default")
