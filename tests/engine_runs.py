"""Driving the engine as a server does, checked after every step (`run_checked`), on
schedules hypothesis draws (`schedules`)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator

from hypothesis import HealthCheck, settings

from roseinfer.engine import LLMEngine
from roseinfer.engine.block_manager import check_pool
from roseinfer.engine.sequence import EngineSequence


def run_checked(
    engine: LLMEngine,
    arrivals: list,
    rng: random.Random,
    check_live: Callable[[EngineSequence], None] | None = None,
) -> dict:
    """Feed `arrivals` ((prompt, params) pairs) between steps at random, step to the end,
    the pool checked after every step (and each live sequence by `check_live`); the
    finished outputs by request id, with what each asked for."""
    assert engine.config.record_writes, "the pool's writes are checked: pass record_writes=True"
    pending, requests, finished = list(arrivals), {}, {}
    while pending or engine.has_unfinished():
        while pending and rng.random() < 0.5:
            prompt, params = pending.pop(0)
            requests[engine.add_request(prompt, params)] = (prompt, params)
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        runner = engine.runner
        live = list(engine.requests.values())
        check_pool(engine.block_manager, live, runner.written_slots, runner.writer_tables)
        assert engine.last_batch.num_tokens <= engine.config.max_num_batched_tokens
        for seq in live:
            if seq.draft_ids:  # proposed after the step, for the next one to feed
                assert seq in engine.scheduler.running and seq.params.greedy
                assert seq.num_computed_tokens + 1 == seq.num_tokens  # it decodes next
                assert len(seq.draft_ids) <= engine.num_speculative_tokens
                assert len(seq.output_ids) + len(seq.draft_ids) < seq.params.max_tokens
            if check_live is not None:
                check_live(seq)
    assert set(finished) == set(requests)
    manager = engine.block_manager
    assert manager.num_available == manager.num_blocks  # every block free or cached
    assert not getattr(engine.drafter, "caches", {})  # every request's draft cache let go
    return {request_id: (finished[request_id], *asked) for request_id, asked in requests.items()}


def schedules(max_examples: int) -> settings:
    """Hypothesis's settings for a property test over engine schedules: few examples,
    the same ones every run, no deadline (a step's time depends on the machine)."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


@contextlib.contextmanager
def model_calls(engine: LLMEngine) -> Iterator[list[dict[str, int]]]:
    """Every call of the model the engine's steps run, as it happens: the shape of the ids
    it was fed, the rows that went through the first layer's q/k/v product and through the
    vocabulary projection (hooks on the modules themselves, so a second call anywhere
    inside a step would show), and the rows that sample (postprocess's logits: one per
    sampling sequence, one more per draft it carries)."""
    model = engine.runner.model
    calls: list[dict[str, int]] = []

    def on_model(module, args, kwargs) -> None:
        ids = args[0] if args else kwargs["idx"]
        calls.append({"batch": ids.size(0), "tokens": ids.size(1), "qkv": 0, "head": 0})

    def counting(name: str):
        def hook(module, args) -> None:
            calls[-1][name] += args[0].numel() // args[0].size(-1)

        return hook

    postprocess = engine.postprocess

    def spied(sampling, logits):
        rows = sum(1 + len(seq.draft_ids) for seq in sampling)
        assert logits.size(0) == rows
        calls[-1]["sampled"] = rows
        return postprocess(sampling, logits)

    handles = [
        model.register_forward_pre_hook(on_model, with_kwargs=True),
        model.transformer.h[0].attn.c_attn.register_forward_pre_hook(counting("qkv")),
        model.lm_head.register_forward_pre_hook(counting("head")),
    ]
    engine.postprocess = spied
    try:
        yield calls
    finally:
        del engine.postprocess
        for handle in handles:
            handle.remove()


def assert_one_call_a_step(engine: LLMEngine, calls: list[dict[str, int]]) -> None:
    """After a step (`calls`: model_calls' record of it): the model ran once if the step
    had work (not at all if not), fed every scheduled token in one row, and its products
    ran once over all of them (the vocabulary projection over the rows that sample). A
    decode step through the static (CUDA-graph) step feeds its tokens padded to a bucket
    and projects every row."""
    batch = engine.last_batch
    if not batch.seqs:
        assert calls == []
        return
    assert len(calls) == 1, calls
    call = calls[0]
    padded = engine.runner.graph_rows
    rows = batch.num_tokens if padded is None else padded
    assert batch.num_tokens <= rows < 2 * batch.num_tokens
    assert (call["batch"], call["tokens"]) == (1, rows)
    assert call["qkv"] == rows  # the first layer's product: one pass, every row
    assert call["head"] == (call["sampled"] if padded is None else rows)
