"""The Llama-shaped family: GPTConfig's choices, grouped-query attention, and every cache
kind of the teaching loop keeping the uncached oracle's promise on a grouped model.

Grouped-query attention is checked against its definition: a model whose key/value heads
are each repeated for their group of query heads (an ungrouped model holding the same
weights) computes the same logits. The caches then hold key/value heads only, and each
one's greedy tokens equal the uncached run's, logits within the one tolerance rule.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from models import LLAMA_CHOICES, assert_clear_margins, assert_logits_close, make_test_model

from roseinfer.cache.dense import ConcatKVCache, StaticKVCache
from roseinfer.cache.offloaded import OffloadedKVCache
from roseinfer.cache.quantized import QuantizedKVCache, kv_bytes_per_token
from roseinfer.cache.rolling import RollingKVCache
from roseinfer.loops.generate import generate, generate_batch
from roseinfer.request.sampling import SamplingParams
from rosetrainer import model as gpt
from rosetrainer.config import PRESETS, GPTConfig
from rosetrainer.errors import RoseError
from rosetrainer.model import GPT

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=24)
PROMPT = [5, 81, 17, 300, 2, 44, 9]
# (n_head, n_kv_head): grouped 2:1, 3:1 and 4:1, and one key/value head for all (multi-query)
GROUPS = [(4, 2), (6, 2), (4, 1), (3, 1)]


def grouped_model(n_head: int, n_kv_head: int, seed: int = 0, **more) -> GPT:
    choices = {**LLAMA_CHOICES, "n_kv_head": n_kv_head, **more}
    return make_test_model(seed, n_head=n_head, n_embd=8 * n_head, block_size=64, **choices)


def ungrouped_copy(model: GPT) -> GPT:
    """The same network with every key/value head repeated for each query head of its group
    (query head h reads key/value head h // group): a plain multi-head model."""
    cfg = model.config
    group, width = cfg.n_head // cfg.kv_heads, cfg.head_dim
    plain = GPT(dataclasses.replace(cfg, n_kv_head=None, tie_embeddings=False)).eval()
    state = dict(model.state_dict())
    for name, weight in model.state_dict().items():
        if name.endswith("attn.c_attn.weight"):
            q, k, v = weight.split(model.transformer.h[0].attn.qkv_widths)
            k, v = (t.view(cfg.kv_heads, width, -1).repeat_interleave(group, 0) for t in (k, v))
            state[name] = torch.cat([q, k.reshape(cfg.n_embd, -1), v.reshape(cfg.n_embd, -1)])
    plain.load_state_dict(state)
    return plain


def test_the_llama_choices_are_checked_one_clear_line_each() -> None:
    for values, said in [
        (dict(n_head=4, n_kv_head=3), r"n_head \(4\) must be divisible by n_kv_head \(3\)"),
        (dict(n_kv_head=0), "n_kv_head must be a positive integer, got 0"),
        (dict(norm="batchnorm"), "norm must be layernorm or rmsnorm, got 'batchnorm'"),
        (dict(mlp="relu"), "mlp must be gelu or swiglu, got 'relu'"),
        (dict(mlp_hidden=0), "mlp_hidden must be a positive integer"),
        (dict(norm_eps=0.0), "norm_eps must be a finite number"),
        (dict(rotary_base=1.0), "rotary_base must be a finite number"),
        (dict(tie_embeddings="no"), "tie_embeddings must be true or false"),
    ]:
        with pytest.raises(RoseError, match=f"model config: {said}"):
            GPTConfig(**values)


def test_an_old_config_without_the_new_keys_is_gpt2() -> None:
    old = {"vocab_size": 512, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32}
    config = GPTConfig.from_dict(old)
    assert (config.kv_heads, config.kv_width, config.mlp_width) == (4, 32, 128)
    assert (config.norm, config.mlp, config.tie_embeddings) == ("layernorm", "gelu", True)
    assert config.rotary_base == 10000.0
    model = GPT(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert isinstance(model.transformer.h[0].ln_1, torch.nn.LayerNorm)


@pytest.mark.slow
def test_presets_have_the_published_shapes() -> None:
    smol = GPT(GPTConfig.from_preset("smollm2-135m", n_layer=1))  # one layer: a fast check
    per_layer = sum(p.numel() for p in smol.transformer.h[0].parameters())
    # SmolLM2-135M: 134,515,008 parameters over 30 such layers, the tied embedding, a norm
    assert 30 * per_layer + 49152 * 576 + 576 == 134_515_008
    assert smol.config.kv_width == 3 * 64 and smol.config.rotary_base == 100000.0
    qwen = GPTConfig.from_preset("qwen2.5-0.5b")
    assert (qwen.n_head // qwen.kv_heads, qwen.qkv_bias, qwen.norm_eps) == (7, True, 1e-6)
    tiny = GPTConfig.from_preset("tiny-llama")
    assert (tiny.n_head, tiny.kv_heads, tiny.mlp, tiny.norm) == (4, 2, "swiglu", "rmsnorm")
    assert set(PRESETS) >= {"tiny", "tiny-llama", "smollm2-135m", "qwen2.5-0.5b"}


def test_an_untied_model_has_an_output_matrix_of_its_own() -> None:
    model = GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=16, tie_embeddings=False))
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert "lm_head.weight" in model.state_dict()


@pytest.mark.parametrize(("n_head", "n_kv_head"), GROUPS)
def test_grouped_attention_is_each_kv_head_shared_by_its_group(n_head, n_kv_head) -> None:
    """Logits of the grouped model (SDPA's grouped path over a prompt, one_query_attention's
    grouped view at a decode step) equal those of the model with its heads repeated."""
    model = grouped_model(n_head, n_kv_head)
    plain = ungrouped_copy(model)
    tokens = torch.tensor([PROMPT * 3])
    with torch.no_grad():
        assert_logits_close(model(tokens).logits, plain(tokens).logits)
        cache, plain_cache = ConcatKVCache(), ConcatKVCache()
        model(tokens[:, :-1], cache=cache), plain(tokens[:, :-1], cache=plain_cache)
        step = model(tokens[:, -1:], cache=cache).logits
        assert_logits_close(step, plain(tokens[:, -1:], cache=plain_cache).logits)
    assert cache.past_kv[0][0].shape[1] == n_kv_head  # the cache holds key/value heads only
    assert plain_cache.past_kv[0][0].shape[1] == n_head


def test_a_group_mapped_in_the_wrong_order_is_seen() -> None:
    """The check has teeth: query head h reading key/value head h % n_kv_head (interleaved,
    not consecutive) changes the logits far past the tolerance."""
    model = grouped_model(4, 2)
    tokens = torch.tensor([PROMPT * 3])

    def interleaved(q, k, v, attn_mask, dropout_p=0.0):
        group = q.size(1) // k.size(1)
        k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    with torch.no_grad():
        want = model(tokens).logits
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(gpt, "attention", interleaved)
            wrong = model(tokens).logits
    assert (wrong - want).abs().max() > 0.1


def cache_for(kind: str, model: GPT, rows: int, max_len: int):
    if kind == "concat":
        return ConcatKVCache()
    if kind == "static":
        return StaticKVCache(model, rows, max_len)
    if kind == "offloaded":
        return OffloadedKVCache(model, rows, max_len)
    # int8 with every token in its exact window: the quantized cache's bookkeeping, exact
    return QuantizedKVCache(
        model, rows, max_len, kv_cache_dtype="int8", window=max_len, group_size=8
    )


@pytest.mark.parametrize("kind", ["concat", "static", "offloaded", "quantized"])
@pytest.mark.parametrize(("n_head", "n_kv_head"), GROUPS[1:3])
def test_every_cache_kind_gives_the_oracles_tokens_on_a_grouped_model(
    kind, n_head, n_kv_head
) -> None:
    model = grouped_model(n_head, n_kv_head, seed=1)
    oracle = generate(model, PROMPT, GREEDY, use_cache=False, keep_logits=True)
    assert_clear_margins(oracle.step_logits)
    cache = cache_for(kind, model, 1, len(PROMPT) + GREEDY.max_tokens)
    cached = generate(model, PROMPT, GREEDY, cache=cache, keep_logits=True)
    assert cached.token_ids == oracle.token_ids
    for got, want in zip(cached.step_logits, oracle.step_logits, strict=True):
        assert_logits_close(got, want)


@pytest.mark.parametrize("kind", ["concat", "static"])
def test_a_padded_batch_of_a_grouped_model_gives_each_prompts_tokens(kind) -> None:
    model = grouped_model(6, 2, seed=2)
    prompts = [PROMPT, PROMPT[:3], [7] * 11]
    cache = cache_for(kind, model, len(prompts), 11 + GREEDY.max_tokens)
    batch = generate_batch(model, prompts, GREEDY, cache=cache)
    for prompt, result in zip(prompts, batch, strict=True):
        assert result.token_ids == generate(model, prompt, GREEDY, use_cache=False).token_ids


def test_a_rolling_cache_of_a_grouped_windowed_model_gives_the_oracles_tokens() -> None:
    model = grouped_model(4, 1, seed=3, sliding_window=6, attention_sinks=2)
    params = SamplingParams(max_tokens=40)
    oracle = generate(model, PROMPT, params, use_cache=False)
    cache = RollingKVCache(model, 1)
    assert cache.k[0].shape[1] == 1
    assert generate(model, PROMPT, params, cache=cache).token_ids == oracle.token_ids


def test_a_grouped_models_cache_holds_its_group_fewer_bytes() -> None:
    model = grouped_model(6, 2)
    plain = ungrouped_copy(model)
    grouped_cache, plain_cache = StaticKVCache(model, 1, 32), StaticKVCache(plain, 1, 32)
    grouped_bytes = sum(layer.k.nbytes + layer.v.nbytes for layer in grouped_cache.layers)
    plain_bytes = sum(layer.k.nbytes + layer.v.nbytes for layer in plain_cache.layers)
    assert plain_bytes == 3 * grouped_bytes
    assert kv_bytes_per_token(model.config, "auto") * 32 == grouped_bytes
