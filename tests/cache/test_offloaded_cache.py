"""The offloaded KV cache equals the uncached oracle, and says what it holds and moves.

On a CPU the host and the compute device are one, so every prefetch and write-back is a
plain copy, but the same copies run: a slot is filled from the host buffers before its
layer, the new positions are copied back after it. The models here have three layers
on purpose: with one or two, each layer keeps a slot of its own from step to step, and a
missing prefetch or write-back would go unseen (with three, layers 0 and 2 share a slot).
"""

from __future__ import annotations

import functools

import pytest
import torch
from models import (
    assert_clear_margins,
    assert_logits_close,
    assert_matches_oracle,
    make_test_model,
)

from roseinfer.cache.offloaded import OffloadedKVCache
from roseinfer.loops.generate import GenerationResult, generate, generate_batch, prefill
from roseinfer.request.sampling import SamplingParams
from rosetrainer.errors import RoseError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK_SIZE = 32
SHAPES = {
    "1L-2H-32d": dict(n_layer=1, n_head=2, n_embd=32),
    "3L-4H-32d": dict(n_layer=3, n_head=4, n_embd=32),
    "3L-3H-48d-rotary": dict(n_layer=3, n_head=3, n_embd=48, position_embedding="rotary"),
}
# Ragged: one token, a few, past half the window, one short of it.
RAGGED_LENGTHS = (1, 5, 17, BLOCK_SIZE - 1)
NEW_TOKENS = 2 * BLOCK_SIZE  # past the window: the loop resets the cache and re-prefills


@functools.cache
def model_for(shape: str):
    return make_test_model(seed=0, block_size=BLOCK_SIZE, **SHAPES[shape])


def random_ids(n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=generator).tolist()


def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


@functools.cache
def oracle(shape: str, prompt: tuple[int, ...], max_tokens: int = NEW_TOKENS) -> GenerationResult:
    result = generate(
        model_for(shape), list(prompt), greedy(max_tokens), use_cache=False, keep_logits=True
    )
    assert_clear_margins(result.step_logits)
    return result


def flat(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    return [t for pair in pairs for t in pair]


def position_bytes(shape: str, rows: int = 1) -> int:
    """Bytes of one position's keys and values in one layer, float32."""
    return 2 * rows * SHAPES[shape]["n_embd"] * 4


@pytest.mark.parametrize("prompt_len", [1, BLOCK_SIZE // 2, BLOCK_SIZE])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_equals_the_oracle_past_the_window(shape: str, prompt_len: int) -> None:
    prompt = tuple(random_ids(prompt_len, seed=prompt_len))
    expected = oracle(shape, prompt)
    result = generate(
        model_for(shape), list(prompt), greedy(), cache=OffloadedKVCache(model_for(shape)),
        keep_logits=True,
    )  # fmt: skip
    assert_matches_oracle(result, expected)


@pytest.mark.parametrize("prefill_chunk", [None, 5])
def test_each_row_of_a_ragged_batch_equals_its_oracle(prefill_chunk: int | None) -> None:
    """Left padding: padded slots masked, positions per row; in one prefill or in chunks."""
    shape = "3L-4H-32d"
    prompts = [random_ids(n, seed=100 + n) for n in RAGGED_LENGTHS]
    cache = OffloadedKVCache(model_for(shape), batch_size=len(prompts))
    results = generate_batch(
        model_for(shape), prompts, greedy(), cache=cache, keep_logits=True,
        prefill_chunk=prefill_chunk,
    )  # fmt: skip
    for prompt, result in zip(prompts, results, strict=True):
        assert_matches_oracle(result, oracle(shape, tuple(prompt)))


def test_forks_continue_a_prefix_on_their_own_buffers() -> None:
    shape = "3L-4H-32d"
    model, prefix = model_for(shape), random_ids(10, seed=7)
    suffixes = [random_ids(3, seed=8), random_ids(6, seed=9)]
    cache = OffloadedKVCache(model, max_len=BLOCK_SIZE)
    with torch.inference_mode():
        prefill(model, cache, [prefix])
    held = [t.clone() for t in flat(cache.filled_kv())]
    forks = cache.fork(len(suffixes))
    buffers = [t.data_ptr() for c in [cache, *forks] for t in c.host_k + c.host_v]
    buffers += [t.data_ptr() for c in [cache, *forks] for slot in c.slots for t in slot]
    assert len(set(buffers)) == len(buffers)  # nothing shared: each writes in place
    for fork, suffix in zip(forks, suffixes, strict=True):
        assert fork.seq_len == len(prefix)
        prompt = prefix + suffix
        result = generate(model, prompt, greedy(12), cache=fork, keep_logits=True)
        assert_matches_oracle(result, oracle(shape, tuple(prompt), 12))
    assert cache.seq_len == len(prefix)
    assert all(torch.equal(a, b) for a, b in zip(flat(cache.filled_kv()), held, strict=True))


def test_bytes_length_and_traffic_are_what_it_holds_and_moves() -> None:
    shape, rows, max_len = "3L-4H-32d", 2, 20
    model, per_position = model_for(shape), position_bytes(shape, rows)
    cache = OffloadedKVCache(model, batch_size=rows, max_len=max_len)
    # Every layer's buffers on the host; two layers' worth of slots on the device.
    assert cache.nbytes == 3 * max_len * per_position
    assert cache.device_nbytes == 2 * max_len * per_position
    assert cache.seq_len == 0
    prompt_len, steps = 6, 4
    with torch.inference_mode():
        model(torch.zeros(rows, prompt_len, dtype=torch.long), cache=cache)
        for _ in range(steps):
            model(torch.zeros(rows, 1, dtype=torch.long), cache=cache)
    assert cache.seq_len == prompt_len + steps
    # Each step brings every layer's held past in and sends its new positions back.
    pasts = [0] + [prompt_len + step for step in range(steps)]
    assert cache.copied_to_device == 3 * sum(pasts) * per_position
    assert cache.copied_to_host == 3 * (prompt_len + steps) * per_position
    [(k, v), *_] = cache.filled_kv()
    assert k.shape == v.shape == (rows, 4, prompt_len + steps, 8)
    cache.truncate(3)
    assert cache.seq_len == 3
    cache.reset()
    assert cache.seq_len == 0 and cache.nbytes == 3 * max_len * per_position


def test_mistakes_are_clear_errors() -> None:
    model = model_for("1L-2H-32d")
    with pytest.raises(RoseError, match=r"holds 1\.\.block_size \(32\) positions, got max_len=33"):
        OffloadedKVCache(model, max_len=BLOCK_SIZE + 1)
    cache = OffloadedKVCache(model, batch_size=2, max_len=8)
    with pytest.raises(RoseError, match=r"2 row\(s\) but 3 prompt\(s\).*batch_size=3"):
        cache.check_rows(3)
    with pytest.raises(RoseError, match=r"one left-padding length per row"):
        cache.reset(torch.tensor([0, 1, 2]))
    with pytest.raises(RoseError, match=r"past \(0\) \+ new \(9\) = 9 do not fit"):
        model(torch.zeros(2, 9, dtype=torch.long), cache=cache)
    with pytest.raises(RoseError, match="holding 0 positions cannot be truncated to 1"):
        cache.truncate(1)
    with pytest.raises(RoseError, match="compile needs an unquantized StaticKVCache"):
        generate(model, [1, 2], greedy(2), cache=OffloadedKVCache(model), compile="default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copies between devices need CUDA")
def test_on_cuda_the_past_lives_in_pinned_host_memory_and_equals_the_oracle() -> None:
    shape = "3L-4H-32d"
    model = make_test_model(seed=0, block_size=BLOCK_SIZE, **SHAPES[shape]).cuda()
    prompt = random_ids(BLOCK_SIZE // 2, seed=1)
    expected = generate(model, prompt, greedy(), use_cache=False, keep_logits=True)
    before = torch.cuda.memory_allocated()
    cache = OffloadedKVCache(model)
    assert torch.cuda.memory_allocated() - before == cache.device_nbytes
    assert all(t.is_pinned() and t.device.type == "cpu" for t in cache.host_k + cache.host_v)
    result = generate(model, prompt, greedy(), cache=cache, keep_logits=True)
    assert result.token_ids == expected.token_ids
    for got, want in zip(result.step_logits, expected.step_logits, strict=True):
        assert_logits_close(got, want)
