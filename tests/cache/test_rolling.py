"""The rolling cache of a sliding-window model against its oracle, and the re-rotating
sink cache against the re-rotation identity it rests on.

The oracle of a windowed model is the uncached forward over the whole sequence under
`banded_mask`; the rolling cache holds only sinks + window slots and must give the same
tokens (logits within the float32 logit tolerance) far past block_size, its bytes never growing.
"""

from __future__ import annotations

import pytest
import torch

from roseinfer.cache.dense import ConcatKVCache
from roseinfer.cache.rolling import ReRotatingSinkCache, RollingKVCache, rerotate
from roseinfer.loops.export_onnx import export
from roseinfer.loops.generate import generate, generate_batch
from roseinfer.pipeline.stage import load_stage
from roseinfer.request.sampling_params import SamplingParams
from rosetrainer import model as gpt
from rosetrainer.checkpoint import save_checkpoint
from rosetrainer.errors import RoseError
from tests.models import assert_clear_margins, assert_matches_oracle, make_test_model

BLOCK, WINDOW = 32, 8
# Four times the context: every key position past the trained ones, the window slots
# overwritten a dozen times.
NEW_TOKENS = 4 * BLOCK
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def windowed_model(sinks: int, position_embedding: str = "rotary"):
    return make_test_model(
        block_size=BLOCK,
        position_embedding=position_embedding,
        sliding_window=WINDOW,
        attention_sinks=sinks,
    )


@pytest.mark.parametrize("sinks", [0, 2])
def test_rolling_cache_equals_banded_oracle_far_past_block_size(sinks: int) -> None:
    model = windowed_model(sinks)
    prompt = [5, 17, 3, 250, 99, 7]
    oracle = generate(model, prompt, GREEDY, use_cache=False, keep_logits=True)
    assert_clear_margins(oracle.step_logits)
    cache = RollingKVCache(model)
    start_bytes = cache.nbytes
    cached = generate(model, prompt, GREEDY, cache=cache, keep_logits=True)
    assert_matches_oracle(cached, oracle)
    assert cache.seq_len == len(prompt) + NEW_TOKENS - 1 > 3 * BLOCK
    # Memory: sinks + window slots, allocated once, whatever the length.
    assert cache.nbytes == start_bytes == 2 * 2 * (sinks + WINDOW) * 32 * 4


def test_rolling_cache_batch_and_chunked_prefill_equal_their_solo_oracles() -> None:
    """Left-padded rows keep their own positions and slots; a prefill longer than the
    window, in chunks, still sees every key its banded mask allows."""
    model = windowed_model(sinks=2)
    prompts = [list(range(40, 60)), [9, 8, 7]]
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for chunk in (None, 5):
        batch = generate_batch(model, prompts, params, keep_logits=True, prefill_chunk=chunk)
        for prompt, result in zip(prompts, batch, strict=True):
            oracle = generate(model, prompt, params, use_cache=False, keep_logits=True)
            assert_matches_oracle(result, oracle)


def test_learned_positions_with_a_window_keep_the_cropping_policy() -> None:
    """A learned-position model cannot pass block_size: both paths crop as before."""
    model = windowed_model(sinks=1, position_embedding="learned")
    oracle = generate(model, [1, 2, 3], GREEDY, use_cache=False, keep_logits=True)
    cached = generate(model, [1, 2, 3], GREEDY, keep_logits=True)
    assert_matches_oracle(cached, oracle)


def test_a_window_needs_a_cache_that_keeps_it() -> None:
    model = windowed_model(sinks=0)
    with pytest.raises(RoseError, match="RollingKVCache"):
        generate(model, [1, 2], GREEDY, cache=ConcatKVCache())
    with pytest.raises(RoseError, match="batch_size=2"):
        generate_batch(model, [[1], [2]], GREEDY, cache=RollingKVCache(model))


def test_rerotating_a_key_equals_computing_it_at_the_new_position() -> None:
    torch.manual_seed(0)
    head_dim = 32
    k = torch.randn(1, 4, 10, head_dim)
    pos = torch.arange(1000, 1010)[None, :]
    rotated = gpt.apply_rotary(k, *gpt.rotary_cos_sin(pos, head_dim))
    for delta in (-997, -1, 5):
        direct = gpt.apply_rotary(k, *gpt.rotary_cos_sin(pos + delta, head_dim))
        # float32: two rotations round twice, and angles near 1,000 rad carry ~1e-4 of
        # absolute error each, so the keys agree to a few 1e-4 rather than to 1e-6.
        torch.testing.assert_close(rerotate(rotated, delta), direct, atol=5e-4, rtol=0)


def test_rerotating_sink_cache_keeps_positions_in_range() -> None:
    """Form b: positions stay below sinks + window however long the sequence; without
    sinks it equals form a (a rotary window cares only for distances), with sinks it
    may not, and is not asserted to (chapter 18 measures the drift)."""
    no_sinks = windowed_model(sinks=0)
    seen = []
    original = gpt.position_ids

    def spy(past_len: int, q_len: int, device=None):
        seen.append(past_len + q_len - 1)
        return original(past_len, q_len, device)

    cache = ReRotatingSinkCache(no_sinks)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gpt, "position_ids", spy)
        rerotated = generate(no_sinks, [1, 2, 3], GREEDY, cache=cache, keep_logits=True)
    assert max(seen) == WINDOW - 1 and cache.held == WINDOW
    oracle = generate(no_sinks, [1, 2, 3], GREEDY, use_cache=False, keep_logits=True)
    assert rerotated.token_ids == oracle.token_ids
    with pytest.raises(RoseError, match="rotary"):
        ReRotatingSinkCache(windowed_model(sinks=0, position_embedding="learned"))


def test_paths_that_keep_every_key_refuse_a_window(tmp_path) -> None:
    """The ONNX graph's past grows and its mask is causal; a split model's stage caches
    are static or concat: each refuses a windowed model with one line, before any work."""
    model = windowed_model(sinks=1)
    with pytest.raises(RoseError, match="rolling cache"):
        export(model, tmp_path / "model.onnx")
    assert not (tmp_path / "model.onnx").exists()
    path = tmp_path / "model.pt"
    save_checkpoint(path, {"model": model.state_dict(), "model_config": model.config.to_dict()})
    with pytest.raises(RoseError, match="rolling cache"):
        load_stage(path, 0, 2)


def test_a_rolling_cache_for_a_known_length_holds_no_more_slots_than_it() -> None:
    """max_len below S + W: that many slots, the oracle's tokens, and one line (not an
    index error) if it is fed more than it was built for."""
    model = windowed_model(sinks=2)
    prompt = [5, 17, 3]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    cache = RollingKVCache(model, max_len=len(prompt) + 6)
    assert cache.nbytes == 2 * 2 * (len(prompt) + 6) * 32 * 4  # < (2 + WINDOW) slots
    cached = generate(model, prompt, params, cache=cache, keep_logits=True)
    assert_matches_oracle(
        cached, generate(model, prompt, params, use_cache=False, keep_logits=True)
    )
    longer = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with pytest.raises(RoseError, match="built for 9 tokens per row"):
        generate(model, prompt, longer, cache=RollingKVCache(model, max_len=len(prompt) + 6))
