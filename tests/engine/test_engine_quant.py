"""The engine's quantized paged cache (EngineConfig.kv_cache_dtype int8 / int4).

Blocks are quantized once they leave every running sequence's window; the window and
each sequence's filling block stay exact. So a window longer than the run gives the
full-precision tokens, and with no window int8 still gives the oracle's greedy tokens
on the wide-margin test model.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from models import assert_clear_margins, assert_logits_close, make_test_model

from roseinfer.cache.paged import FlatPagedKVCache
from roseinfer.engine import EngineConfig, LLMEngine, model_runner
from roseinfer.engine.block_manager import check_pool
from roseinfer.loops.generate import generate
from roseinfer.request.sampling import SamplingParams
from rosetrainer.errors import RoseError
from rosetrainer.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KV_BLOCK = 8
GREEDY = SamplingParams(max_tokens=48, ignore_eos=True, logprobs=0)
PROMPTS = [[7, 300, 42, 9, 120, 5], [11, 12, 13], list(range(100, 120))]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer("gpt2")


@pytest.fixture(scope="module")
def model():
    return make_test_model(seed=0, n_embd=64, n_head=2, block_size=96)  # head size 32


@pytest.fixture(scope="module")
def oracle(model) -> list[list[int]]:
    tokens = []
    for prompt in PROMPTS:
        result = generate(model, prompt, GREEDY, use_cache=False, keep_logits=True)
        assert_clear_margins(result.step_logits)
        tokens.append(result.token_ids)
    return tokens


def run_engine(model, tokenizer, **config) -> tuple[LLMEngine, list]:
    """Every prompt at once; the pool's invariants checked after every step."""
    engine = LLMEngine(
        model,
        tokenizer,
        EngineConfig(kv_block_size=KV_BLOCK, shuffle_blocks_seed=0, record_writes=True, **config),
    )
    ids = [engine.add_request(prompt, GREEDY) for prompt in PROMPTS]
    finished = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        check_pool(
            engine.block_manager,
            list(engine.requests.values()),
            engine.runner.written_slots,
            engine.runner.writer_tables,
        )
    assert engine.block_manager.num_used == 0  # every block back at the end
    return engine, [finished[i] for i in ids]


def run_one(engine: LLMEngine, prompt: list[int]):
    request_id = engine.add_request(prompt, GREEDY)
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished and output.request_id == request_id:
                return output
    raise AssertionError("the request never finished")


def logprobs(output) -> torch.Tensor:
    return torch.tensor([entry.logprob for entry in output.logprobs])


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_a_window_longer_than_the_run_gives_the_full_precision_tokens(
    model, tokenizer, oracle, kv_cache_dtype: str
) -> None:
    _, exact = run_engine(model, tokenizer)
    engine, windowed = run_engine(
        model, tokenizer, kv_cache_dtype=kv_cache_dtype, kv_cache_window=96
    )
    assert [o.token_ids for o in windowed] == [o.token_ids for o in exact] == oracle
    for got, want in zip(windowed, exact, strict=True):
        assert_logits_close(logprobs(got), logprobs(want))
    # Were the window quantized, the log-probabilities would move by far more:
    _, no_window = run_engine(model, tokenizer, kv_cache_dtype=kv_cache_dtype, kv_cache_window=0)
    moved = max(
        float((logprobs(got) - logprobs(want)).abs().max())
        for got, want in zip(no_window, exact, strict=True)
    )
    assert moved > 1e-3


def test_int8_without_a_window_gives_the_oracle_tokens(model, tokenizer, oracle) -> None:
    engine, outputs = run_engine(model, tokenizer, kv_cache_dtype="int8", kv_cache_window=0)
    assert [o.token_ids for o in outputs] == oracle
    # Most blocks went to their codes: only the blocks still exact when the last
    # request finished hold full-precision numbers.
    assert len(engine.pool.exact_blocks()) <= len(PROMPTS)


def test_the_reference_attention_gives_the_same_tokens(model, tokenizer, oracle) -> None:
    """The engine's step against the readable reference (chapter 11's gather-then-attend
    cache swapped in), both reading the quantized blocks."""
    with mock.patch.object(model_runner, "PagedKVCache", FlatPagedKVCache):
        _, outputs = run_engine(model, tokenizer, kv_cache_dtype="int4", kv_cache_window=16)
    _, fast = run_engine(model, tokenizer, kv_cache_dtype="int4", kv_cache_window=16)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in fast]


def test_a_prefix_hit_equals_a_miss_with_int8(model, tokenizer, oracle) -> None:
    config = EngineConfig(kv_block_size=KV_BLOCK, kv_cache_dtype="int8", kv_cache_window=0)
    engine = LLMEngine(model, tokenizer, config)
    prompt = PROMPTS[2]  # 20 tokens: two full blocks to share
    miss = run_one(engine, prompt)
    hit = run_one(engine, prompt)
    assert hit.num_cached_tokens == 2 * KV_BLOCK
    assert hit.token_ids == miss.token_ids == oracle[2]


def test_a_quantized_pool_admits_more_blocks_in_the_same_memory(model, tokenizer) -> None:
    budget = 16 * 2**20
    blocks = {}
    for dtype in ("auto", "int8", "int4"):
        config = EngineConfig(kv_cache_memory=budget, kv_cache_dtype=dtype, max_num_seqs=4)
        engine = LLMEngine(model, tokenizer, config)
        blocks[dtype] = engine.block_manager.num_blocks
        # The pool's real bytes (codes, scales, zeros, exact blocks) fill the budget.
        per_block = config.bytes_per_block(model.config, 4)
        assert budget - per_block < engine.pool.nbytes <= budget
    # 16 tokens of 2 layers * 64 channels * (key + value) take 16 KiB in float32.
    assert blocks["auto"] == budget // (16 * 2 * 2 * 64 * 4)
    assert blocks["auto"] < blocks["int8"] < blocks["int4"]


def test_bad_settings_are_one_clear_error(model, tokenizer) -> None:
    with pytest.raises(RoseError, match="unknown KV cache dtype 'fp8'"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(RoseError, match="group size 5 does not divide the head size 32"):
        LLMEngine(model, tokenizer, EngineConfig(kv_cache_dtype="int8", kv_cache_group_size=5))
