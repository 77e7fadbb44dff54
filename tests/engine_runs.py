"""Driving the engine as a server does, checked after every step (`run_checked`), on
schedules hypothesis draws (`schedules`)."""

from __future__ import annotations

import random
from collections.abc import Callable

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
            assert not seq.draft_ids  # drafts live inside a step only
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
