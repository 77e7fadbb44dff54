"""Chapter 12's exercise: the scheduler's decision for one engine step. The learner's function
replaces Scheduler.schedule inside the engine.

The contract is the docstring of rosecourse/solutions/ch12_schedule.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from unittest import mock

from rosecourse.exercises.common import (
    CheckResult,
    Exercise,
    KnownWrong,
    check,
    outcome,
)
from rosecourse.exercises.engine import (
    KV_BLOCK,
    chapter_prompts,
    engine_runs,
    engine_step_name,
    greedy,
    make_engine,
)
from roseinfer.engine.block_manager import BlockManager
from roseinfer.engine.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.engine.outputs import RequestOutput
from roseinfer.engine.scheduler import ScheduledBatch, Scheduler
from roseinfer.request.sampling import SamplingParams

_real_schedule = Scheduler.schedule


def schedule(scheduler: Scheduler) -> ScheduledBatch:
    """The reference: Scheduler.schedule."""
    return _real_schedule(scheduler)


def plan(engine: LLMEngine, outputs: list[RequestOutput]) -> tuple:
    """What the scheduler decided in the step just run: who ran with how many tokens, who
    was preempted."""
    batch = engine.last_batch
    ran = tuple(
        (seq.request_id, n) for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
    )
    return ran, tuple(seq.request_id for seq in batch.preempted)


SCHEDULE_SETTINGS = {"max_num_batched_tokens": 10, "max_num_seqs": 3, "num_kv_blocks": 14}


def _schedule_workload() -> list[tuple[list[int], SamplingParams]]:
    return [(list(p), greedy()) for p in chapter_prompts()]


def _schedule_probe(fn: Callable) -> list[object]:
    """The plans of a small workload, steps only (no model): prompts of 9, 5 and 7 tokens."""
    config = EngineConfig(kv_block_size=KV_BLOCK, **SCHEDULE_SETTINGS)
    manager = BlockManager(6, KV_BLOCK)
    scheduler = Scheduler(config, manager)
    engine = make_engine(**SCHEDULE_SETTINGS)  # only to build sequences as it does
    for i, length in enumerate((9, 5, 7)):
        engine.add_request(list(range(1, length + 1)), greedy(3), request_id=f"p{i}")
        scheduler.add(engine.requests[f"p{i}"])

    def steps() -> list[tuple]:
        seen = []
        for _ in range(12):
            batch = fn(scheduler)
            seen.append(
                (
                    tuple(
                        (s.request_id, n)
                        for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
                    ),
                    tuple(s.request_id for s in batch.preempted),
                )
            )
            for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
                seq.num_computed_tokens += n
                if seq.num_computed_tokens == seq.num_tokens:
                    seq.append_token(7, 0.0)
                    if seq.is_finished:
                        scheduler.finish(seq)
        return seen

    return [outcome(steps)]


@contextlib.contextmanager
def _config_replaced(scheduler: Scheduler, **changes: object):
    kept = scheduler.config
    scheduler.config = dataclasses.replace(kept, **changes)
    try:
        yield
    finally:
        scheduler.config = kept


def _ignores_budget(scheduler):
    with _config_replaced(scheduler, max_num_batched_tokens=10**9):
        return schedule(scheduler)


def _ignores_max_seqs(scheduler):
    with _config_replaced(scheduler, max_num_seqs=10**9):
        return schedule(scheduler)


def _static_batching(scheduler):
    if not scheduler.running:
        return schedule(scheduler)
    waiting, scheduler.waiting = scheduler.waiting, type(scheduler.waiting)()
    try:
        return schedule(scheduler)
    finally:
        scheduler.waiting = waiting


EXERCISE = Exercise(
    name="schedule",
    reference=schedule,
    probe=_schedule_probe,
    swapped_in=lambda fn: mock.patch.object(Scheduler, "schedule", fn),
    runs=engine_runs(
        _schedule_workload,
        plan,
        "the plan of every step, against the reference scheduler's",
        **SCHEDULE_SETTINGS,
    ),
    known_wrong=[
        KnownWrong(
            "ignores_budget",
            _ignores_budget,
            "you ignore max_num_batched_tokens: a long prompt must be prefilled in chunks "
            "of what is left of the step's token budget",
        ),
        KnownWrong(
            "ignores_max_seqs",
            _ignores_max_seqs,
            "you admit more running sequences than max_num_seqs",
        ),
        KnownWrong(
            "static_batching",
            _static_batching,
            "nobody is admitted while anyone runs: that is static batching; continuous "
            "batching admits waiting requests into every step with room",
        ),
    ],
    fallback="your plan differs from the policy (running oldest first, the newest "
    "preempted, waiting first come first served, within the token budget)",
    step_label=engine_step_name,
)


def check_schedule(fn: Callable) -> CheckResult:
    """Chapter 12: `schedule(scheduler) -> ScheduledBatch`, the decision for one step."""
    return check(EXERCISE, fn)
