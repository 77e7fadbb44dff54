"""The serving engine keeps the oracle's promise on every schedule.

The core test drives the engine with seeded random workloads (arrivals between steps,
chunked prefill under tiny token budgets, a pool small enough to preempt, shared
prefixes and fully cached prompts, aborts, greedy and seeded sampled requests) and
checks, after every step, the pool's invariants, and at the end that each finished
request's tokens equal its solo uncached run. The pool hands out blocks in a shuffled
order, so a logical block number used as a physical one cannot pass by luck.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from engine_runs import assert_one_call_a_step, model_calls
from models import LLAMA_CHOICES, assert_clear_margins, make_test_model
from torch import nn

import roseinfer
from roseinfer.cache import flex, kernels
from roseinfer.cache import paged as paged_cache
from roseinfer.engine import EngineConfig, LLMEngine, llm_engine, model_runner
from roseinfer.engine import config as engine_config
from roseinfer.engine import packed as packed_module
from roseinfer.engine.block_manager import check_pool
from roseinfer.engine.config import ATTENTIONS, parse_bytes
from roseinfer.engine.cuda_graphs import DecodeGraphs, batch_buckets, bucket_for
from roseinfer.engine.outputs import RequestOutput, RequestOutputKind
from roseinfer.engine.packed import PackedLinear
from roseinfer.engine.sequence import EngineSequence
from roseinfer.loops.generate import generate
from roseinfer.request.sampling import SamplingParams
from roseinfer.speculative.drafters import ModelDrafter
from rosetrainer import model as gpt
from rosetrainer.errors import RoseError
from rosetrainer.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONTEXT = 64  # the model's block_size
KV_BLOCK = 4  # tokens per KV block: small, so a small pool has many blocks


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer("gpt2")


@pytest.fixture(scope="module")
def model():
    # A 512-token vocabulary keeps the oracle fast; GPT-2's tokenizer decodes those ids,
    # and its end-of-text (50256) is never sampled, so requests stop on length or stop ids.
    return make_test_model(0, block_size=CONTEXT)


@pytest.fixture(scope="module")
def grouped():
    """Llama-shaped, four query heads over one key/value head (multi-query)."""
    return make_test_model(0, block_size=CONTEXT, n_head=4, **LLAMA_CHOICES)


def engine_for(model, tokenizer, **config) -> LLMEngine:
    config = {"kv_block_size": KV_BLOCK, "shuffle_blocks_seed": 0, "record_writes": True, **config}
    return LLMEngine(model, tokenizer, EngineConfig(**config))


def solo(model, tokenizer, prompt: list[int], params: SamplingParams) -> list[int]:
    """The oracle: the request alone, uncached, cut where the engine stops at the window."""
    room = CONTEXT - len(prompt) + 1  # the last token is sampled from position CONTEXT - 1
    params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
    result = generate(model, prompt, params, use_cache=False, eot_id=tokenizer.eot_id)
    return result.token_ids


def run_to_end(
    engine: LLMEngine, check: bool = True, after_step: Callable[[], None] | None = None
) -> dict[str, object]:
    assert not check or engine.config.record_writes, "the pool's writes are checked"
    finished = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        if after_step is not None:
            after_step()
        if check:
            live = list(engine.requests.values())
            check_pool(
                engine.block_manager, live, engine.runner.written_slots, engine.runner.writer_tables
            )
    return finished


def note_the_road(engine: LLMEngine, seen: set[str]) -> None:
    """After a step: which road the step's decode rows took (in place by the kernel or
    FlexAttention, or gathered)."""
    runner = engine.runner
    if runner.num_decode:
        seen.add("flex" if runner.flex else "kernel" if runner.in_place else "gather")


# ---------------------------------------------------------------------------
# Random schedules
# ---------------------------------------------------------------------------


def random_workload(
    rng: random.Random, num_requests: int
) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of 1..CONTEXT-1 tokens, some sharing 1-3 full blocks with a common prefix,
    some repeating an earlier prompt exactly (fully cached); greedy and seeded sampled."""
    shared = [rng.randrange(512) for _ in range(3 * KV_BLOCK)]
    workload = []
    for _ in range(num_requests):
        if workload and rng.random() < 0.15:
            prompt = list(rng.choice(workload)[0])  # the same prompt again
        else:
            prefix = shared[: KV_BLOCK * rng.randrange(4)]
            length = rng.randrange(max(1, len(prefix)), CONTEXT)
            prompt = prefix + [rng.randrange(512) for _ in range(length - len(prefix))]
        if rng.random() < 0.3:
            params = SamplingParams(
                max_tokens=rng.randrange(1, 25),
                temperature=rng.choice([0.7, 1.0]),
                top_k=rng.choice([0, 20]),
                top_p=rng.choice([1.0, 0.9]),
                seed=rng.randrange(2**32),
            )
        else:
            params = SamplingParams(max_tokens=rng.randrange(1, 25))
        workload.append((prompt, params))
    return workload


CASES = range(12)


def run_case(model, tokenizer, case: int, **config) -> dict[str, object]:
    """One random schedule, the pool checked after every step; what happened, for the
    tests. config: further EngineConfig settings."""
    rng = random.Random(case)
    engine = engine_for(
        model,
        tokenizer,
        num_kv_blocks=rng.randrange(CONTEXT // KV_BLOCK, 40),  # room for one full context
        max_num_batched_tokens=[1, 3, 16][case % 3],
        max_num_seqs=rng.randrange(1, 8),
        attention=ATTENTIONS[(case // 3) % len(ATTENTIONS)],  # each with each token budget
        shuffle_blocks_seed=case,
        **config,
    )
    pending = random_workload(rng, 12)
    requests, aborted, finished = {}, set(), {}
    chunked_steps = 0
    while pending or engine.has_unfinished():
        while pending and rng.random() < 0.5:  # arrivals between steps
            prompt, params = pending.pop(0)
            requests[engine.add_request(prompt, params)] = (prompt, params)
        if engine.requests and rng.random() < 0.03:
            victim = rng.choice(sorted(engine.requests))
            engine.abort(victim)
            aborted.add(victim)
        outputs = engine.step()
        for output in outputs:
            if output.finished:
                finished[output.request_id] = output
        live = list(engine.requests.values())
        runner = engine.runner
        check_pool(engine.block_manager, live, runner.written_slots, runner.writer_tables)
        batch = engine.last_batch
        assert batch.num_tokens <= engine.config.max_num_batched_tokens
        assert len(engine.scheduler.running) <= engine.config.max_num_seqs
        # A scheduled sequence that made no token read only part of its prompt.
        sampled = {output.request_id for output in outputs}
        chunked_steps += any(seq.request_id not in sampled for seq in engine.last_batch.seqs)
        assert len(finished) + len(engine.requests) + len(pending) == 12
    return dict(
        engine=engine,
        requests=requests,
        aborted=aborted,
        finished=finished,
        chunked_steps=chunked_steps,
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_random_schedules_equal_solo_runs(model, tokenizer, case: int) -> None:
    run = run_case(model, tokenizer, case)
    engine, finished = run["engine"], run["finished"]
    assert set(finished) == set(run["requests"])
    # Every block is free or cached-unreferenced once all requests are done.
    assert engine.stats().num_kv_blocks_used == 0
    assert engine.block_manager.num_available == engine.block_manager.num_blocks
    for request_id, (prompt, params) in run["requests"].items():
        output = finished[request_id]
        if request_id in run["aborted"]:
            assert output.finish_reason == "abort"
            continue
        assert output.token_ids == solo(model, tokenizer, prompt, params), request_id
        window_full = len(prompt) + len(output.token_ids) > CONTEXT
        assert output.finish_reason == "length"
        assert window_full or len(output.token_ids) == params.max_tokens


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES[:6])
def test_random_schedules_on_a_quantized_pool(model, tokenizer, case: int) -> None:
    """int8, a window of one block: its exact blocks never outgrow their pool whatever the
    schedule (preemption, chunks, aborts, prefix hits), and every block comes back. With
    the window over the whole context and no prefix cache (a hit would read quantized
    blocks), the tokens are the solo runs'."""
    quant = dict(kv_cache_group_size=8)  # head size 16
    small_window = dict(kv_cache_window=KV_BLOCK, **quant)
    run = run_case(model, tokenizer, case, kv_cache_dtype="int8", **small_window)
    assert set(run["finished"]) == set(run["requests"])
    assert run["engine"].stats().num_kv_blocks_used == 0
    exact = dict(kv_cache_window=CONTEXT, enable_prefix_caching=False, **quant)
    run = run_case(model, tokenizer, case, kv_cache_dtype="int4", **exact)
    for request_id, (prompt, params) in run["requests"].items():
        if request_id not in run["aborted"]:
            assert run["finished"][request_id].token_ids == solo(model, tokenizer, prompt, params)


@pytest.mark.parametrize("case", CASES[:3])
def test_random_schedules_on_a_rotary_model(tokenizer, case: int) -> None:
    """The paged pool holds rotary keys turned before they are written: same promise."""
    rotary = make_test_model(0, block_size=CONTEXT, position_embedding="rotary")
    run = run_case(rotary, tokenizer, case)
    for request_id, (prompt, params) in run["requests"].items():
        if request_id not in run["aborted"]:
            want = solo(rotary, tokenizer, prompt, params)
            assert run["finished"][request_id].token_ids == want, request_id


@pytest.mark.parametrize("case", CASES[:6])
def test_random_schedules_on_a_grouped_model(grouped, tokenizer, case: int) -> None:
    """The pool holds the one key/value head, the kernel or the gather reads it for the four
    query heads: preemption, chunks, prefix hits, aborts, the solo runs' tokens."""
    run = run_case(grouped, tokenizer, case)
    assert run["engine"].runner.pool.k[0].shape[1] == 1
    for request_id, (prompt, params) in run["requests"].items():
        if request_id not in run["aborted"]:
            want = solo(grouped, tokenizer, prompt, params)
            assert run["finished"][request_id].token_ids == want, request_id


@pytest.mark.slow
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_a_windowed_request_runs_far_past_the_context_on_a_few_blocks(
    tokenizer, attention: str
) -> None:
    """A rotary model with a sliding window: requests run 3x past the context, each equal
    to its uncached run under the banded mask, while the engine gives back every block
    behind a window, so a decoding request never holds more than ceil(W / kv_block) + 1
    blocks (and the block of its sinks; while it reads its prompt, the chunk's own blocks
    come on top)."""
    window, sinks = 10, 2
    model = make_test_model(
        0, block_size=CONTEXT, position_embedding="rotary", sliding_window=window,
        attention_sinks=sinks,
    )  # fmt: skip
    engine = engine_for(model, tokenizer, attention=attention, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=3 * CONTEXT)
    prompts = [[7, 300, 42], list(range(100, 140)), [5] * 20]
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    held = [0]

    def count_blocks() -> None:
        for seq in engine.requests.values():
            if seq.num_computed_tokens > len(seq.prompt_ids):  # decoding
                held.append(sum(b >= 0 for b in seq.block_table))

    finished = run_to_end(engine, after_step=count_blocks)
    most_held = max(held)
    bound = -(-window // KV_BLOCK) + 1 + -(-sinks // KV_BLOCK)
    assert most_held == bound  # reached, never passed
    assert engine.block_manager.num_available == engine.block_manager.num_blocks
    for request_id, prompt in zip(ids, prompts, strict=True):
        oracle = generate(model, prompt, params, use_cache=False)
        assert len(oracle.token_ids) == 3 * CONTEXT
        assert finished[request_id].token_ids == oracle.token_ids


@pytest.mark.slow
def test_the_random_schedules_exercise_every_path(model, tokenizer) -> None:
    """Across the cases above: preemption, prefix-cache hits, chunked prefill and aborts."""
    runs = [run_case(model, tokenizer, case) for case in CASES]
    stats = [run["engine"].stats() for run in runs]
    assert sum(s.num_preemptions for s in stats) > 0
    assert sum(s.prefix_cache_hits for s in stats) > 0
    assert sum(run["chunked_steps"] for run in runs) > 0
    assert sum(len(run["aborted"]) for run in runs) > 0


@pytest.mark.parametrize("which", ["model", "grouped"])
def test_a_small_pool_preempts_and_still_equals_the_oracle(request, which, tokenizer) -> None:
    model = request.getfixturevalue(which)
    engine = engine_for(model, tokenizer, num_kv_blocks=17, max_num_batched_tokens=64)
    rng = random.Random(5)
    prompts = [[rng.randrange(512) for _ in range(30)] for _ in range(4)]
    params = SamplingParams(max_tokens=30)
    ids = [engine.add_request(p, params) for p in prompts]
    finished = run_to_end(engine)
    assert engine.stats().num_preemptions > 0
    for request_id, prompt in zip(ids, prompts, strict=True):
        assert finished[request_id].token_ids == solo(model, tokenizer, prompt, params)


def test_a_logical_block_number_where_a_physical_one_belongs_diverges(model, tokenizer) -> None:
    """The check has teeth: write each token at its logical slot (position alone, no
    block table) and, with a shuffled pool and two sequences, outputs go wrong."""

    def logical_slots(block_tables, seq_of_token, positions, kv_block_size):
        return positions + seq_of_token * 0

    rng = random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(20)] for _ in range(2)]
    params = SamplingParams(max_tokens=10)
    engine = engine_for(model, tokenizer, num_kv_blocks=40)
    ids = [engine.add_request(p, params) for p in prompts]
    with mock.patch.object(paged_cache, "slot_mapping", logical_slots):
        finished = run_to_end(engine, check=False)
    got = [finished[i].token_ids for i in ids]
    assert got != [solo(model, tokenizer, p, params) for p in prompts]


@pytest.mark.slow
def test_every_attention_gives_the_same_logits(model, tokenizer) -> None:
    """Every read ("kernel": the decode rows' blocks read in place by the C kernel, "flex":
    the whole step's by FlexAttention, "gather": the blocks gathered every step; "auto":
    the kernel on a CPU) against the readable reference, chapter 11's gather-then-attend cache
    (`FlatPagedKVCache`: every key of the step's sequences side by side under one mask)
    swapped in for the engine's."""
    rng = random.Random(2)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(1, 40))] for _ in range(5)]
    params = SamplingParams(max_tokens=12, logprobs=1)
    runs = {}
    for attention in (*ATTENTIONS, "reference"):
        with contextlib.ExitStack() as stack:
            if attention == "reference":
                stack.enter_context(
                    mock.patch.object(model_runner, "PagedKVCache", paged_cache.FlatPagedKVCache)
                )
            config = dict(attention="gather" if attention == "reference" else attention)
            engine = engine_for(model, tokenizer, num_kv_blocks=80, **config)
            ids = [engine.add_request(p, params) for p in prompts]
            roads: set[str] = set()
            watch = functools.partial(note_the_road, engine, roads)
            finished = run_to_end(engine, after_step=watch)
        runs[attention] = [finished[i] for i in ids]
        # (the kernel builds on this machine: a test below takes the road without it)
        in_place = {"auto": {"kernel"}, "kernel": {"kernel"}, "flex": {"flex"}}
        assert roads == in_place.get(attention, {"gather"})
    for attention in ATTENTIONS:
        for fast, reference in zip(runs[attention], runs["reference"], strict=True):
            assert fast.token_ids == reference.token_ids
            for a, b in zip(fast.logprobs, reference.logprobs, strict=True):
                assert abs(a.logprob - b.logprob) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_one_model_call_a_step_over_every_scheduled_token(model, tokenizer, attention) -> None:
    """A step is one forward: the decoding sequences' tokens and the prompt chunks go
    through the model together in one flat row, so every product with the weights runs
    once a step, over all of the step's tokens; a step with no work calls it not at all.
    Requests arrive while others decode, under a budget that cuts prompts into chunks,
    so that most steps mix the two."""
    engine = engine_for(
        model, tokenizer, num_kv_blocks=80, max_num_batched_tokens=12, attention=attention
    )
    rng = random.Random(4)
    arrivals = [[rng.randrange(512) for _ in range(rng.randrange(2, 30))] for _ in range(6)]
    mixed = steps = 0
    while arrivals or engine.has_unfinished():
        if arrivals and steps % 3 == 0:
            engine.add_request(arrivals.pop(), SamplingParams(max_tokens=8))
        with model_calls(engine) as calls:
            engine.step()
        assert_one_call_a_step(engine, calls)
        steps += 1
        kinds = {n == 1 for n in engine.last_batch.num_new_tokens}
        mixed += kinds == {True, False}
    assert mixed >= 3  # steps with decodes and prompt chunks both


@pytest.mark.slow
@pytest.mark.parametrize(("window", "sinks"), [(None, 0), (6, 1)])
def test_flex_reads_fewer_key_heads_than_query_heads_in_place(window, sinks) -> None:
    """FlexAttention over the pool (a decode row and a chunk in one step) with two key and
    value heads for four query heads (grouped-query attention) equals attention over each
    sequence's keys gathered, every key head shared by its group of query heads."""
    generator = torch.Generator().manual_seed(0)
    kv_heads, n_head, head_dim, kv_block, num_blocks = 2, 4, 8, 4, 12
    k_pool, v_pool = (
        torch.randn(kv_heads, num_blocks, kv_block, head_dim, generator=generator).transpose(0, 1)
        for _ in range(2)
    )  # (stored heads first, as the engine's flex pool)
    tables = [[7, 2, 9], [4, 11, 0]]
    computed, new = [10, 5], [1, 4]  # a decode row, then a chunk of 4
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(computed, new, strict=True)])
    q = torch.randn(1, n_head, sum(new), head_dim, generator=generator)
    table = flex.table_tensor(tables, torch.device("cpu"))
    step = flex.FlexStep(
        table, flex.block_places(table, num_blocks), positions, new, 1, kv_block, window, sinks
    )
    got = step.attend(q, k_pool, v_pool)
    start = 0
    for t, c, n in zip(tables, computed, new, strict=True):
        slots = torch.tensor([t[p // kv_block] * kv_block + p % kv_block for p in range(c + n)])
        keys, values = (pool.transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, slots]
                        for pool in (k_pool, v_pool))  # fmt: skip
        keys, values = (x.repeat_interleave(n_head // kv_heads, 0) for x in (keys, values))
        mask = gpt.window_mask(torch.arange(c, c + n)[:, None], torch.arange(c + n), window, sinks)
        want = gpt.attention(q[:, :, start : start + n], keys[None], values[None], mask)
        torch.testing.assert_close(got[:, :, start : start + n], want)
        start += n


def test_decode_batches_pad_to_buckets() -> None:
    """A decode step of n rows replays the graph of the smallest bucket that holds them:
    powers of two up to max_num_seqs, and max_num_seqs itself."""
    assert batch_buckets(1) == [1]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert [bucket_for(n, batch_buckets(48)) for n in (1, 3, 4, 5, 33, 48)] == [1, 4, 4, 8, 48, 48]


def watch_padding(graphs: DecodeGraphs, replays: list[int]) -> Callable[..., torch.Tensor]:
    """graphs.run, noting each step's bucket and checking that its padding rows hold the
    spare block alone and write their keys only there."""
    run = graphs.run

    def watched(tables: list[list[int]], positions: list[int], ids: list[int]) -> torch.Tensor:
        logits = run(tables, positions, ids)
        n, rows = len(ids), bucket_for(len(ids), graphs.buckets)
        replays.append(rows)
        padding = graphs.tables[n:rows]
        assert (padding[:, 0] == graphs.pad_block).all() and (padding[:, 1:] == -1).all()
        assert (graphs.slots[n:rows] // KV_BLOCK == graphs.pad_block).all()
        assert not (graphs.tables[:n] == graphs.pad_block).any()  # no sequence holds it
        assert logits.shape[0] == n
        return logits

    return watched


@pytest.mark.slow
def test_the_static_decode_step_gives_the_eager_steps_tokens(model, tokenizer) -> None:
    """The step a CUDA graph captures (static buffers, rows padded to a bucket), run
    directly here, against the same engine with every step eager (enforce_eager): the
    same tokens and logprobs, equal to the oracle's. Padding rows feed the pool's spare
    block, which the block manager never hands out, and read nothing else."""
    rng = random.Random(6)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    params = SamplingParams(max_tokens=10, logprobs=1)
    runs, replays = {}, []
    for eager in (True, False):
        engine = engine_for(
            model, tokenizer, attention="flex", enforce_eager=eager, num_kv_blocks=60,
            max_num_seqs=6, max_num_batched_tokens=16,
        )  # fmt: skip
        graphs = engine.runner.graphs
        assert (graphs is None) == eager
        if not eager:
            assert engine.pool.num_blocks == engine.block_manager.num_blocks + 1
            graphs.run = watch_padding(graphs, replays)
        ids = [engine.add_request(p, params) for p in prompts]
        finished = run_to_end(engine)
        runs[eager] = [finished[i] for i in ids]
    assert set(replays) == {1, 2, 4, 6}  # every bucket replayed, padded where needed
    for graph_run, eager_run, prompt in zip(runs[False], runs[True], prompts, strict=True):
        assert graph_run.token_ids == eager_run.token_ids == solo(model, tokenizer, prompt, params)
        for a, b in zip(graph_run.logprobs, eager_run.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-5


def kernel_case(
    seed: int,
    dtype: torch.dtype,
    head_dim: int,
    kv_block_size: int,
    lens: list[int],
    group: int = 1,
) -> tuple[torch.Tensor, ...]:
    """A shuffled pool of one layer, tables for sequences of `lens` tokens, their queries
    (`group` query heads for each of the pool's three key/value heads)."""
    generator = torch.Generator().manual_seed(seed)
    n_head, blocks = 3, [-(-n // kv_block_size) for n in lens]
    order = torch.randperm(sum(blocks) + 3, generator=generator)
    tables, start = [], 0
    for count in blocks:
        tables.append(order[start : start + count].tolist())
        start += count
    shape = (len(order), n_head, kv_block_size, head_dim)
    k_pool, v_pool = (torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
    q = torch.randn(len(lens), n_head * group, head_dim, generator=generator).to(dtype)
    return q, k_pool, v_pool, paged_cache.padded_tables(tables, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "kv_block_size"), [(64, 16), (16, 4), (24, 3)])
@pytest.mark.parametrize(("window", "sinks"), [(None, 0), (7, 0), (9, 2)])
def test_the_kernel_reads_the_blocks_in_place_as_attention_over_them_gathered(
    dtype, head_dim, kv_block_size, window, sinks
) -> None:
    """The compiled kernel's decode attention equals the model's one-query attention over
    each sequence's blocks gathered in table order (the gather road), masked to its own
    positions (and its window and sinks): contexts inside one block, ending on a block's
    edge and across many, in a shuffled pool; GPT-2's head size and others."""
    lens = [1, kv_block_size, kv_block_size + 1, 5 * kv_block_size - 1, 2, 40]
    q, k_pool, v_pool, tables = kernel_case(0, dtype, head_dim, kv_block_size, lens)
    assert kernels.runs_on(SimpleNamespace(k=[k_pool]))
    lens = torch.tensor(lens)
    got = kernels.paged_decode_attention(q, k_pool, v_pool, tables, lens, window, sinks)
    keys, values = (
        paged_cache.gather_tables(k_pool, tables),
        paged_cache.gather_tables(v_pool, tables),
    )
    positions = torch.arange(keys.size(2))[None, :]
    mask = gpt.window_mask(lens[:, None] - 1, positions, window, sinks)[:, None, None, :]
    want = gpt.one_query_attention(q[:, :, None], keys, values, mask)[:, :, 0]
    tolerance = 2e-6 if dtype == torch.float32 else 1e-2  # (the kernel sums in float32)
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("group", [2, 3])
@pytest.mark.parametrize(("head_dim", "kv_block_size"), [(64, 16), (24, 3)])
def test_the_kernel_reads_one_kv_head_for_its_group_of_query_heads(
    group, head_dim, kv_block_size
) -> None:
    """Grouped queries: the kernel over a pool of three key/value heads equals attention over
    the blocks gathered with each key/value head repeated for its group (query head h reads
    key/value head h // group), though it never makes that copy."""
    lens = [1, kv_block_size + 1, 5 * kv_block_size - 1, 40]
    q, k_pool, v_pool, tables = kernel_case(1, torch.float32, head_dim, kv_block_size, lens, group)
    got = kernels.paged_decode_attention(q, k_pool, v_pool, tables, torch.tensor(lens), 9, 2)
    keys, values = (
        paged_cache.gather_tables(pool, tables).repeat_interleave(group, dim=1)
        for pool in (k_pool, v_pool)
    )
    positions = torch.arange(keys.size(2))[None, :]
    mask = gpt.window_mask(torch.tensor(lens)[:, None] - 1, positions, 9, 2)[:, None, None, :]
    want = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], keys, values, mask)
    torch.testing.assert_close(got, want[:, :, 0], atol=2e-6, rtol=2e-6)


def test_without_the_kernel_the_engine_gathers_with_the_same_tokens(
    model, tokenizer, monkeypatch, caplog, tmp_path
) -> None:
    """Where the kernel cannot be built (here: no C compiler) the engine says so once and
    its decode rows gather their blocks: the same tokens; where it runs, decode rows read
    in place, and no copy of any key or value is kept beside the pool."""
    rng = random.Random(9)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(1, 30))] for _ in range(4)]
    params = SamplingParams(max_tokens=10)
    runs = {}
    for buildable in (True, False):
        kernels.library.cache_clear()
        if not buildable:
            monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
            monkeypatch.setenv("ROSE_KERNEL_CACHE", str(tmp_path / "kernels"))
        with caplog.at_level("WARNING", logger=kernels.__name__):
            engine = engine_for(model, tokenizer, num_kv_blocks=80)
            engine_for(model, tokenizer, num_kv_blocks=80)  # said once only
        notes = [r.getMessage() for r in caplog.records if r.name == kernels.__name__]
        assert engine.runner.in_place == buildable
        assert len(notes) == (0 if buildable else 1)
        assert buildable or "decode steps gather" in notes[0]
        ids = [engine.add_request(p, params) for p in prompts]
        roads: set[str] = set()
        finished = run_to_end(engine, after_step=functools.partial(note_the_road, engine, roads))
        assert roads == {"kernel" if buildable else "gather"}
        runs[buildable] = [finished[i].token_ids for i in ids]
        monkeypatch.undo()
        caplog.clear()
    kernels.library.cache_clear()
    assert runs[True] == runs[False] == [solo(model, tokenizer, p, params) for p in prompts]


@pytest.mark.slow
def test_the_kernel_built_for_avx2_gives_the_oracle_tokens(tmp_path) -> None:
    """ATEN_CPU_CAPABILITY=avx2 (what PyTorch runs on an AVX2-only CPU) builds the kernel for
    x86-64-v3: an engine in float32 and in bfloat16 decodes in place with it, float32's
    tokens the uncached oracle's."""
    script = (
        "import torch\n"
        "from models import make_test_model\n"
        "from roseinfer.cache import kernels\n"
        "from roseinfer.engine import LLM\n"
        "from roseinfer.loops.generate import generate\n"
        "from roseinfer.request.sampling import SamplingParams\n"
        "from rosetrainer.tokenizer import Tokenizer\n"
        "assert '-march=x86-64-v3' in kernels.build_flags(), kernels.build_flags()\n"
        "model = make_test_model(0, block_size=64)\n"
        "params = SamplingParams(max_tokens=12)\n"
        "prompts = [[1, 2, 3], list(range(40, 70))]\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    llm = LLM.from_model(model.to(dtype), Tokenizer('gpt2'), kv_block_size=4)\n"
        "    assert llm.engine.runner.in_place\n"
        "    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]\n"
        "    if dtype == torch.float32:\n"
        "        want = [generate(model, p, params, use_cache=False).token_ids for p in prompts]\n"
        "        assert got == want, (got, want)\n"
        "print('ok')\n"
    )
    env = {
        **os.environ,
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "ROSE_KERNEL_CACHE": str(tmp_path),
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[1]), str(Path(roseinfer.__file__).parents[1])]
        ),
    }
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
    assert len(list(tmp_path.glob("paged_attention-*.so"))) == 1


def test_packed_weights_are_a_view_of_the_model_with_the_oracle_tokens(model, tokenizer) -> None:
    """On a CPU the runner packs the linear layers for oneDNN; the caller's model stays
    as it was (every parameter shared, none copied but the packed weights), and the
    engine's tokens and log-probabilities are the oracle's with or without packing."""
    rng = random.Random(5)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(1, 30))] for _ in range(4)]
    params = SamplingParams(max_tokens=10, logprobs=1)
    runs = {}
    for pack in (True, False):
        engine = engine_for(model, tokenizer, num_kv_blocks=80, pack_weights=pack)
        runner_model = engine.runner.model
        assert (runner_model is not model) == pack
        ids = [engine.add_request(p, params) for p in prompts]
        finished = run_to_end(engine)
        runs[pack] = [finished[i] for i in ids]
    packed = engine_for(model, tokenizer, pack_weights=True).runner.model
    assert isinstance(packed.lm_head, PackedLinear) and isinstance(model.lm_head, nn.Linear)
    assert packed.transformer.wte.weight is model.transformer.wte.weight
    assert packed.transformer.h[0].attn.c_attn.bias is model.transformer.h[0].attn.c_attn.bias
    # the MLP's GELU is done by the product before it (oneDNN's post-op), the model's kept
    mlp = packed.transformer.h[0].mlp
    assert mlp.c_fc.post_op == ("gelu", "tanh") and isinstance(mlp.gelu, nn.Identity)
    assert isinstance(model.transformer.h[0].mlp.gelu, nn.GELU)
    for prompt, with_packing, without in zip(prompts, runs[True], runs[False], strict=True):
        assert with_packing.token_ids == without.token_ids == solo(model, tokenizer, prompt, params)
        for a, b in zip(with_packing.logprobs, without.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-4


@pytest.mark.parametrize("has_bf16_kernels", [True, False])
def test_bfloat16_packs_only_where_the_processor_can(
    model, tokenizer, has_bf16_kernels, monkeypatch, caplog
) -> None:
    """oneDNN's bfloat16 reorder raises on a CPU without AVX-512 BW/VL/DQ or AVX-NE-CONVERT
    (an AVX2-only EPYC): packing is chosen by what the processor can do, and without it a
    bfloat16 engine runs on the weights as stored, saying so in one line. The processor's
    answer is faked both ways here; the real AVX2 path runs in the next test."""
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    monkeypatch.setattr(packed_module, "bfloat16_packing_supported", lambda: has_bf16_kernels)
    monkeypatch.setattr(packed_module, "_said", set())
    # On a CPU whose oneDNN truly lacks the kernels, a reorder must never be tried: it raises.
    if not has_bf16_kernels:
        monkeypatch.setattr(
            packed_module.torch.ops.mkldnn,
            "_reorder_linear_weight",
            mock.Mock(side_effect=RuntimeError("bf16 path needs the cpu support")),
        )
    elif not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU cannot run oneDNN's bfloat16 kernels; the decision is tested below")
    with caplog.at_level("WARNING", logger=packed_module.__name__):
        engine = engine_for(bf16, tokenizer, num_kv_blocks=40, pack_weights=True)
        engine_for(bf16, tokenizer, num_kv_blocks=40, pack_weights=True)  # said once only
    assert isinstance(engine.runner.model.lm_head, PackedLinear) == has_bf16_kernels
    notes = [r.getMessage() for r in caplog.records if r.name == packed_module.__name__]
    assert notes == ([] if has_bf16_kernels else [notes[0]])
    assert has_bf16_kernels or "bfloat16 weights not packed" in notes[0]
    # float32 packs either way: only bfloat16 needs the instructions
    assert packed_module.can_pack(model)
    ids = [engine.add_request(p, SamplingParams(max_tokens=4)) for p in ([1, 2, 3], [4, 5])]
    finished = run_to_end(engine)
    assert all(len(finished[i].token_ids) == 4 for i in ids)


@pytest.mark.slow
def test_bfloat16_runs_where_onednn_is_capped_at_avx2(tmp_path) -> None:
    """ONEDNN_MAX_CPU_ISA=AVX2 makes oneDNN see what an AVX2-only CPU gives it (its
    bfloat16 reorder then raises, as on a Zen 3): a bfloat16 LLM still starts and generates,
    and says once that its weights are not packed."""
    script = (
        "import torch\n"
        "from models import make_test_model\n"
        "from roseinfer.engine import LLM\n"
        "from roseinfer.request.sampling import SamplingParams\n"
        "from rosetrainer.tokenizer import Tokenizer\n"
        "assert not torch.ops.mkldnn._is_mkldnn_bf16_supported()\n"
        "model = make_test_model(0, block_size=64).to(torch.bfloat16)\n"
        "llm = LLM.from_model(model, Tokenizer('gpt2'), pack_weights=True)\n"
        "out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5), use_tqdm=False)\n"
        "print(len(out[0].token_ids))\n"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "5"
    assert done.stderr.count("bfloat16 weights not packed") == 1, done.stderr


# ---------------------------------------------------------------------------
# Prefix caching
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["model", "grouped"])
def test_a_prefix_hit_equals_a_miss_and_a_fully_cached_prompt_recomputes_its_last_token(
    request, which, tokenizer
) -> None:
    model = request.getfixturevalue(which)
    prompt = list(range(100, 100 + 3 * KV_BLOCK))  # exactly three full blocks
    params = SamplingParams(max_tokens=8)
    engine = engine_for(model, tokenizer, num_kv_blocks=40)
    first = engine.add_request(prompt, params)
    miss = run_to_end(engine)[first]
    assert miss.num_cached_tokens == 0
    second = engine.add_request(prompt, params)
    hit = run_to_end(engine)[second]
    # Two blocks come from the cache; the third holds the last token, which is recomputed
    # for its logits.
    assert hit.num_cached_tokens == 2 * KV_BLOCK
    assert hit.token_ids == miss.token_ids == solo(model, tokenizer, prompt, params)
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (4, 2)


def test_a_block_is_found_only_after_the_same_tokens_before_it(model, tokenizer) -> None:
    """Same tokens in a block, different tokens before it: no hit (the keys differ)."""
    engine = engine_for(model, tokenizer, num_kv_blocks=40)
    block = [7, 8, 9, 10]
    a = [1, 2, 3, 4] + block + [11]
    b = [5, 6, 3, 4] + block + [11]
    for prompt in (a, b):
        engine.add_request(prompt, SamplingParams(max_tokens=1))
        run_to_end(engine)
    assert engine.stats().prefix_cache_hits == 0


def test_unused_cached_blocks_are_evicted_least_recently_used_first(model, tokenizer) -> None:
    engine = engine_for(model, tokenizer, num_kv_blocks=16)
    old, new = [1] * 9, [2] * 9
    for prompt in (old, new):
        engine.add_request(prompt, SamplingParams(max_tokens=1))
        run_to_end(engine)
    manager = engine.block_manager
    assert manager.num_cached_unused == 4 and manager.num_free == 12
    engine.add_request([3] * 53, SamplingParams(max_tokens=1))  # 14 blocks: evicts two
    run_to_end(engine)
    assert len(manager.cached_prefix(new)) == 2 and not manager.cached_prefix(old)


def test_a_blocked_waiting_head_is_looked_up_again_only_when_the_cache_changes(
    model, tokenizer
) -> None:
    """The head of the queue waits while the pool is full: the prefix cache is asked for its
    blocks (its tokens joined, every block hashed) only when a key entered or left the
    cache since its last lookup, and it still gets the blocks keyed while it waited."""
    engine = engine_for(model, tokenizer, num_kv_blocks=10, max_num_batched_tokens=64)
    manager = engine.block_manager
    versions = []
    real = manager.cached_prefix

    def counted(token_ids: list[int]) -> list[int]:
        versions.append(manager.cache_version)
        return real(token_ids)

    manager.cached_prefix = counted
    shared = list(range(100, 100 + 2 * KV_BLOCK))
    # The first holds 4 blocks, 8 by its end; the second needs 9, 2 of them cached.
    first = engine.add_request(shared + [7] * (KV_BLOCK + 1), SamplingParams(max_tokens=16))
    engine.step()
    prompt, params = shared + list(range(300, 300 + 7 * KV_BLOCK)), SamplingParams(max_tokens=3)
    second = engine.add_request(prompt, params)
    waited = 0
    while engine.requests[second].num_computed_tokens == 0:
        engine.step()
        waited += 1
    assert first not in engine.requests  # it waited for the first's blocks
    assert waited > 2 * len(versions) and len(versions) == len(set(versions))
    assert engine.requests[second].num_cached_tokens == 2 * KV_BLOCK
    assert run_to_end(engine)[second].token_ids == solo(model, tokenizer, prompt, params)


# ---------------------------------------------------------------------------
# Per request: sampling, stops, logprobs, text, abort
# ---------------------------------------------------------------------------


def test_seeded_sampling_is_the_same_alone_and_in_any_batch(model, tokenizer) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    params = [
        SamplingParams(max_tokens=15, temperature=1.0, top_k=50, seed=seed) for seed in range(6)
    ]
    engine = engine_for(model, tokenizer, num_kv_blocks=60, max_num_batched_tokens=16)
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    finished = run_to_end(engine)
    for request_id, prompt, p in zip(ids, prompts, params, strict=True):
        assert finished[request_id].token_ids == solo(model, tokenizer, prompt, p)
    # Same seed, same tokens; another seed, other tokens (the sampler is the request's).
    assert finished[ids[0]].token_ids != solo(
        model, tokenizer, prompts[0], dataclasses.replace(params[0], seed=99)
    )


def test_stop_token_ids_logprobs_and_the_window(model, tokenizer) -> None:
    prompt = list(range(50, 60))
    oracle = generate(
        model, prompt, SamplingParams(max_tokens=20), use_cache=False, keep_logits=True
    )
    assert_clear_margins(oracle.step_logits)
    stop_id = oracle.token_ids[5]
    engine = engine_for(model, tokenizer, num_kv_blocks=40)
    stopped = engine.add_request(prompt, SamplingParams(max_tokens=20, stop_token_ids=(stop_id,)))
    scored = engine.add_request(prompt, SamplingParams(max_tokens=20, logprobs=3))
    long = engine.add_request([5] * (CONTEXT - 2), SamplingParams(max_tokens=50))
    finished = run_to_end(engine)
    first_stop = oracle.token_ids.index(stop_id)
    assert finished[stopped].token_ids == oracle.token_ids[: first_stop + 1]
    assert (finished[stopped].finish_reason, finished[stopped].stop_reason) == ("stop", stop_id)
    logprobs = finished[scored].logprobs
    assert [lp.token_id for lp in logprobs] == finished[scored].token_ids
    for lp, logits in zip(logprobs, oracle.step_logits, strict=True):
        want = torch.log_softmax(logits.float(), -1)
        assert abs(lp.logprob - float(want[lp.token_id])) < 1e-4
        assert [t for t, _ in lp.top] == torch.topk(want, 3).indices.tolist()
        assert lp.top[0][0] == lp.token_id  # greedy picks the best
    # At the window: the token sampled from the last position is kept, then "length".
    assert len(finished[long].token_ids) == 3 and finished[long].finish_reason == "length"


def test_text_is_utf8_safe_and_held_back_while_it_could_become_a_stop_string(tokenizer) -> None:
    ids = tokenizer.encode("a😀b STOP! c")
    params = SamplingParams(max_tokens=50, stop=("STOP",))
    seq = EngineSequence([1], params, decode=tokenizer.decode)
    pieces, texts = [], []
    for token in ids:
        seq.append_token(token)
        output = seq.report()
        pieces.append(output.new_text)
        texts.append(output.text)
        assert "\ufffd" not in output.text
        assert not output.text.endswith(("S", "ST", "STO"))
        if output.finished:
            break
    assert "".join(pieces) == texts[-1] == "a😀b "
    assert (seq.finish_reason, seq.stop_reason) == ("stop", "STOP")


def test_abort_frees_blocks_at_once_and_is_reported_by_the_next_step(model, tokenizer) -> None:
    engine = engine_for(model, tokenizer, num_kv_blocks=40, max_num_seqs=1)
    running = engine.add_request(list(range(20)), SamplingParams(max_tokens=10))
    waiting = engine.add_request(list(range(30)), SamplingParams(max_tokens=10))
    engine.step()
    assert engine.stats().num_kv_blocks_used > 0
    engine.abort(running)
    engine.abort(waiting)
    engine.abort("no-such-request")  # ignored
    assert engine.stats().num_kv_blocks_used == 0
    outputs = engine.step()
    assert {(o.request_id, o.finish_reason, o.finished) for o in outputs} == {
        (running, "abort", True),
        (waiting, "abort", True),
    }
    assert not engine.has_unfinished()


def test_bad_input_is_one_clear_error_and_the_engine_serves_the_others(model, tokenizer) -> None:
    engine = engine_for(model, tokenizer, num_kv_blocks=10)
    good = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4), request_id="good")
    engine.step()
    bad_requests = [
        (lambda: engine.add_request([1] * (CONTEXT + 1), SamplingParams()), "context"),
        (lambda: engine.add_request([1, 2], SamplingParams(max_tokens=60)), "pool holds 10"),
        (lambda: engine.add_request([1, 512], SamplingParams()), "vocabulary"),
        (lambda: engine.add_request([1], SamplingParams(), request_id="good"), "already"),
        (lambda: engine.add_request([1], SamplingParams(max_tokens=0)), "max_tokens"),
        (lambda: engine.add_request([1], SamplingParams(temperature=-1)), "temperature"),
        (lambda: engine.add_request([1], SamplingParams(top_p=0)), "top_p"),
    ]
    for bad, words in bad_requests:
        with pytest.raises(RoseError, match=words) as error:
            bad()
        assert "\n" not in str(error.value)
    assert list(engine.requests) == ["good"]
    finished = run_to_end(engine)
    assert finished[good].token_ids == solo(
        model, tokenizer, [1, 2, 3], SamplingParams(max_tokens=4)
    )


def test_an_empty_prompt_starts_from_end_of_text(tokenizer) -> None:
    model = make_test_model(1, block_size=CONTEXT, vocab_size=50257)
    engine = engine_for(model, tokenizer, num_kv_blocks=40)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    request_id = engine.add_request("", params)
    output = run_to_end(engine)[request_id]
    assert output.prompt_token_ids == [tokenizer.eot_id]
    assert output.token_ids == solo(model, tokenizer, [tokenizer.eot_id], params)


def test_a_stop_string_ends_the_text_before_it_and_streams_in_pieces(tokenizer) -> None:
    model = make_test_model(1, block_size=CONTEXT, vocab_size=50257)
    prompt = tokenizer.encode("ROMEO:")
    free = SamplingParams(max_tokens=30, ignore_eos=True)
    text = tokenizer.decode(solo(model, tokenizer, prompt, free))
    stop = text[12:15]  # three characters from the middle of the free-running text
    engine = engine_for(model, tokenizer, num_kv_blocks=40)
    request_id = engine.add_request(prompt, dataclasses.replace(free, stop=(stop,)))
    pieces, last = [], None
    while engine.has_unfinished():
        for output in engine.step():
            pieces.append(output.new_text)
            last = output
    assert (last.request_id, last.finish_reason, last.stop_reason) == (request_id, "stop", stop)
    assert last.text == text[: text.index(stop)] == "".join(pieces)
    assert tokenizer.decode(last.token_ids).startswith(last.text + stop)


def test_output_kinds_report_the_same_request(tokenizer) -> None:
    """Step by step, a DELTA request's outputs are a CUMULATIVE one's without the whole
    (until it finishes) and add up to it; a FINAL_ONLY request reports once, finished,
    as the others end. Also with drafts (several tokens a step) and held-back text."""
    model = make_test_model(1, block_size=CONTEXT, vocab_size=50257)
    prompt = tokenizer.encode("ROMEO:")
    free = SamplingParams(max_tokens=30, ignore_eos=True)
    stop = tokenizer.decode(solo(model, tokenizer, prompt, free))[12:15]
    params = [dataclasses.replace(free, stop=(stop,), logprobs=2), free]
    whole = ("prompt_token_ids", "token_ids", "text", "logprobs")
    times = ("arrival_time", "first_token_time", "finish_time")  # (each run its own)

    def same(a: RequestOutput, b: RequestOutput, fields: tuple[str, ...] = ()) -> bool:
        return dataclasses.replace(a, **dict.fromkeys(times + fields)) == dataclasses.replace(
            b, **dict.fromkeys(times + fields)
        )

    for drafts in (False, True):  # (the model drafts for itself: every draft is accepted)
        steps: dict[RequestOutputKind, list[list[RequestOutput]]] = {}
        for kind in RequestOutputKind:
            drafter = (ModelDrafter(model), 3) if drafts else ()
            engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=40), *drafter)
            for i, p in enumerate(params):
                engine.add_request(prompt, p, request_id=f"r{i}", output_kind=kind)
            steps[kind] = []
            while engine.has_unfinished():
                steps[kind].append(engine.step())
        cumulative, delta = steps[RequestOutputKind.CUMULATIVE], steps[RequestOutputKind.DELTA]
        assert len(cumulative) == len(delta)
        finals = {}
        for full_step, delta_step in zip(cumulative, delta, strict=True):
            for full, part in zip(full_step, delta_step, strict=True):
                assert same(full, part, () if part.finished else whole)
                assert part.finished or [getattr(part, f) for f in whole] == [None] * 4
                if full.finished:
                    finals[full.request_id] = full
        for request_id, final in finals.items():
            parts = [out for step in delta for out in step if out.request_id == request_id]
            assert [t for out in parts for t in out.new_token_ids] == final.token_ids
            assert "".join(out.new_text for out in parts) == final.text
            if final.logprobs is not None:
                assert [lp for out in parts for lp in out.new_logprobs] == final.logprobs
        several = any(len(out.new_token_ids) > 1 for step in delta for out in step)
        assert several == drafts
        final_only = [out for step in steps[RequestOutputKind.FINAL_ONLY] for out in step]
        assert all(out.finished for out in final_only)
        assert sorted(out.request_id for out in final_only) == sorted(finals)
        for out in final_only:
            assert same(out, finals[out.request_id], ("new_token_ids", "new_text", "new_logprobs"))
            assert (out.new_token_ids, out.new_text) == (out.token_ids, out.text)
    assert finals["r0"].stop_reason == stop  # (its text was held back on the way)
    with pytest.raises(RoseError, match="output_kind"):
        engine.add_request(prompt, free, output_kind="delta")


def test_fed_slice_reads_prompt_output_and_drafts_in_place() -> None:
    seq = EngineSequence([1, 2, 3], SamplingParams(max_tokens=9))
    seq.append_token(4)
    seq.append_token(5)
    seq.draft_ids = [6, 7]
    fed = [1, 2, 3, 4, 5, 6, 7]
    for start in range(len(fed) + 1):
        for end in range(start, len(fed) + 1):
            assert seq.fed_slice(start, end) == fed[start:end], (start, end)


def test_pool_size_from_bytes_or_blocks(model) -> None:
    per_block = EngineConfig(kv_block_size=4).bytes_per_block(model.config, 4)
    assert per_block == 2 * model.config.n_layer * model.config.n_embd * 4 * 4
    assert EngineConfig(kv_block_size=4, kv_cache_memory="1MiB").pool_blocks(model.config, 4) == (
        2**20 // per_block
    )
    assert EngineConfig(kv_cache_memory=2**30).pool_blocks(model.config, 4) > 0
    assert EngineConfig(num_kv_blocks=7).pool_blocks(model.config, 4) == 7
    # every binary and decimal unit up to tera, in any case
    assert parse_bytes("1TiB") == 2**40 and parse_bytes("2tb") == 2 * 10**12
    assert parse_bytes("1.5GiB") == 3 * 2**29 and parse_bytes("512 MiB") == 2**29
    for bad in ("lots", "0GiB", "-1", 0, "1PiB"):
        with pytest.raises(RoseError, match="kv_cache_memory"):
            EngineConfig(kv_cache_memory=bad)
    for zero in ("0", "0GiB", "0.0 MiB"):  # (a byte count, only not a positive one)
        with pytest.raises(RoseError, match=f"kv_cache_memory must be > 0 bytes, got '{zero}'"):
            EngineConfig(kv_cache_memory=zero)
    with pytest.raises(RoseError, match="not both"):
        EngineConfig(num_kv_blocks=4, kv_cache_memory="1MiB")


def test_a_pool_past_the_free_memory_is_refused_naming_the_setting(
    model, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The free memory is asked first (here: as if 1 MiB were free); where the system
    does not say, the allocation's own error is one line, not the allocator's traceback."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(engine_config, "available_memory", lambda device: 2**20)
    with pytest.raises(RoseError, match=r"^kv_cache_memory '2MiB' is a KV pool of 0\.0 GiB, more "):
        EngineConfig(kv_cache_memory="2MiB").pool_blocks(model.config, 4, device=cpu)
    with pytest.raises(RoseError, match=r"^num_kv_blocks 100000 is a KV pool of .* smaller num"):
        EngineConfig(num_kv_blocks=100_000).pool_blocks(model.config, 4, device=cpu)
    assert EngineConfig(kv_cache_memory="512KiB").pool_blocks(model.config, 4, device=cpu) > 0

    def no_memory(*args: object) -> None:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried...\nmore")

    monkeypatch.setattr(engine_config, "available_memory", lambda device: None)
    monkeypatch.setattr(llm_engine, "make_pool", no_memory)
    with pytest.raises(
        RoseError, match=r"does not fit on cpu \(RuntimeError: DefaultCPU.*\.\.\.\)"
    ):
        engine_for(model, tokenizer, num_kv_blocks=10)


def test_a_grouped_models_pool_holds_its_key_value_heads_only(model, grouped, tokenizer) -> None:
    """Four query heads over one key/value head: a quarter of the bytes per block, and so
    four times the blocks in the same memory; the pool's tensors are that size."""
    config = EngineConfig(kv_block_size=4, kv_cache_memory="1MiB")
    assert grouped.config.n_embd == model.config.n_embd
    assert config.bytes_per_block(model.config, 4) == 4 * config.bytes_per_block(grouped.config, 4)
    assert config.pool_blocks(grouped.config, 4) == 4 * config.pool_blocks(model.config, 4)
    engine = engine_for(grouped, tokenizer, num_kv_blocks=10)
    pool = engine.runner.pool
    assert pool.nbytes == 10 * config.bytes_per_block(grouped.config, 4)


# ---------------------------------------------------------------------------
# One request that breaks inside a step fails alone
# ---------------------------------------------------------------------------
# A request joins a running batch, then breaks where the engine handles it alone: its
# sampling (parameters the sampler cannot compute, or a sampler that raises) or its
# log-probabilities. It finishes as "abort" with an `error` and gives its blocks back;
# every other request's tokens equal their solo runs; the same engine (and the same
# `LLM`) serves later requests as before.

BAD_SEED = 666  # marks the request that breaks


def slip_past_validation(params: SamplingParams, **values: object) -> SamplingParams:
    """A SamplingParams holding values a validator might let through (the engine must
    not rely on every such value being caught before it)."""
    for name, value in values.items():
        object.__setattr__(params, name, value)
    return params


def breaking_request(how: str, monkeypatch: pytest.MonkeyPatch) -> SamplingParams:
    """The params of a request that breaks in its third step, one way or another."""
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=BAD_SEED)
    if how == "temperature":
        # float32(1e-300) is 0: its logits become 0/0 = nan, and multinomial raises.
        return slip_past_validation(params, temperature=1e-300)
    if how == "logprobs":
        return slip_past_validation(params, logprobs=10**6)  # more than the vocabulary
    if how == "text":
        return params  # its detokenizer breaks (break_text)
    real = llm_engine.sample_rows
    calls = {"bad": 0}

    def sampler(logits, seqs):
        tokens = real(logits, seqs)  # the others' streams have moved on: they go back
        calls["bad"] += any(seq.params.seed == BAD_SEED for seq in seqs)
        if calls["bad"] >= 3 and any(seq.params.seed == BAD_SEED for seq in seqs):
            raise RuntimeError("the sampler broke")
        return tokens

    monkeypatch.setattr(llm_engine, "sample_rows", sampler)
    return params


def break_text(seq) -> None:
    """Its text breaks at its third token (a decode that raises)."""
    decode, calls = seq.detokenizer.decode, []

    def broken(ids: list[int]) -> str:
        calls.append(ids)
        if len(calls) >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return decode(ids)

    seq.detokenizer.decode = broken


@pytest.mark.parametrize("how", ["temperature", "logprobs", "sampler", "text"])
def test_a_request_that_breaks_mid_batch_fails_alone(model, tokenizer, how, monkeypatch) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(3, 30))] for _ in range(5)]
    good = [
        SamplingParams(max_tokens=16),
        SamplingParams(max_tokens=16, temperature=0.8, seed=1),
        SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=2),
        SamplingParams(max_tokens=16, logprobs=2),
    ]
    engine = engine_for(model, tokenizer, num_kv_blocks=60, max_num_batched_tokens=16)
    ids = [engine.add_request(p, params) for p, params in zip(prompts, good, strict=False)]
    engine.step()
    engine.step()  # the batch is running
    bad = engine.add_request(prompts[4], breaking_request(how, monkeypatch))
    if how == "text":
        break_text(engine.requests[bad])
    finished = run_to_end(engine)  # the pool's invariants checked after every step

    failed = finished[bad]
    assert failed.finished and failed.finish_reason == "abort"
    assert failed.error and "\n" not in failed.error
    if how in ("sampler", "text"):
        assert failed.error.startswith(("RuntimeError: the sampler", "UnicodeDecodeError: "))
        assert len(failed.token_ids) == 2 + (how == "text")  # made before it broke
    for request_id, prompt, params in zip(ids, prompts[:4], good, strict=True):
        assert finished[request_id].error is None
        assert finished[request_id].token_ids == solo(model, tokenizer, prompt, params)
    # Nothing is left behind: no request, no block held.
    assert not engine.has_unfinished() and engine.stats().num_kv_blocks_used == 0

    # The same engine goes on serving.
    monkeypatch.undo()
    again = engine.add_request(prompts[0], good[1])
    assert run_to_end(engine)[again].token_ids == solo(model, tokenizer, prompts[0], good[1])


def test_the_same_llm_serves_after_a_request_failed(model, tokenizer) -> None:
    llm = roseinfer.LLM.from_model(model, tokenizer, num_kv_blocks=40)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    good = SamplingParams(max_tokens=8)
    bad = slip_past_validation(SamplingParams(max_tokens=8, temperature=0.5), temperature=1e-300)
    outputs = llm.generate(prompts, [good, bad, good], use_tqdm=False)
    assert [o.finish_reason for o in outputs] == ["length", "abort", "length"]
    assert outputs[1].error.startswith("RuntimeError: ")
    assert outputs[0].error is None and outputs[2].error is None
    for prompt, output in zip(prompts[::2], outputs[::2], strict=True):
        assert output.token_ids == solo(model, tokenizer, prompt, good)
    # Later calls work on the same LLM, and every block came back.
    (later,) = llm.generate([prompts[1]], good, use_tqdm=False)
    assert later.token_ids == solo(model, tokenizer, prompts[1], good)
    assert llm.engine.stats().num_kv_blocks_used == 0


def test_pool_bookkeeping_is_recorded_only_when_asked_for(model, tokenizer) -> None:
    """The tests turn the recording on (record_writes=True); a server's hot path keeps
    no copies of block tables and reads no written slots back from the device."""
    for check in (True, False):
        engine = engine_for(model, tokenizer, num_kv_blocks=40, record_writes=check)
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=3))
        engine.step()
        recorded = (engine.runner.written_slots, engine.runner.writer_tables)
        assert all(recorded) if check else not any(recorded)
