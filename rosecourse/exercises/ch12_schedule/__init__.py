"""Chapter 12's exercise: the scheduler's decision for one engine step.

The learner's function is the policy of the scheduler the engine is given (`ScheduleOf`,
through LLMEngine's scheduler_class: no patch).

The contract is the docstring of rosecourse/exercises/ch12_schedule/reference.py.
"""

from __future__ import annotations

from collections.abc import Callable

from rosecourse.exercises.answers import known_mistakes
from rosecourse.exercises.common import (
    CheckResult,
    Exercise,
    Probe,
    check,
    held_function,
    hold,
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


class ScheduleOf(Scheduler):
    """rose's Scheduler whose policy is the function `hold` holds (the learner's, in a
    check): LLMEngine takes it as its scheduler_class."""

    def schedule(self) -> ScheduledBatch:
        return held_function(schedule)(self)


def plan(engine: LLMEngine, outputs: list[RequestOutput]) -> tuple:
    """What the scheduler decided in the step just run: who ran with how many tokens, who
    was preempted."""
    batch = engine.last_batch
    ran = tuple(
        (seq.request_id, n) for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
    )
    return ran, tuple(seq.request_id for seq in batch.preempted)


SCHEDULE_SETTINGS = {"max_num_batched_tokens": 10, "max_num_seqs": 3, "num_kv_blocks": 14}
# Fewer tokens a step than sequences may run: the decoding rows themselves are cut.
TIGHT_BUDGET = {"max_num_batched_tokens": 2, "max_num_seqs": 4, "num_kv_blocks": 40}


def _schedule_workload() -> list[tuple[list[int], SamplingParams]]:
    return [(list(p), greedy()) for p in chapter_prompts()]


# Small workloads for the probe, steps only (no model): (what binds, engine settings, pool
# blocks, prompt lengths, tokens each request makes).
PROBE_WORKLOADS = [
    ("the token budget", {"max_num_batched_tokens": 10, "max_num_seqs": 3}, 16, (25, 5, 7), 3),
    ("max_num_seqs", {"max_num_batched_tokens": 64, "max_num_seqs": 2}, 32, (4, 6, 4, 5), 3),
    ("the pool: preemption", {"max_num_batched_tokens": 16, "max_num_seqs": 4}, 5, (4, 4, 4), 6),
    ("the pool and the budget", {"max_num_batched_tokens": 10, "max_num_seqs": 3}, 6, (9, 5, 7), 3),
    # A step that preempts while the pool could take the head of the queue: it admits nobody.
    ("the pool (a step that preempts admits nobody)",
     {"max_num_batched_tokens": 8, "max_num_seqs": 2}, 4, (4, 9, 4), 4),
    # p10 arrives after p2 (though "p10" < "p2"): running stays in arrival order.
    ("the budget, with 12 requests (running in arrival order: p10 after p2)",
     {"max_num_batched_tokens": 8, "max_num_seqs": 12}, 40, (3,) * 12, 10),
]  # fmt: skip
PROBE_STEPS = 16


def _schedule_probe(fn: Callable) -> Probe:
    """The plans (who runs with how many tokens, who is preempted) of each probe workload,
    step by step, each token computed as the plan says."""

    def plans(settings: dict, num_blocks: int, lengths: tuple[int, ...], new: int) -> list:
        config = EngineConfig(kv_block_size=KV_BLOCK, **settings)
        scheduler = Scheduler(config, BlockManager(num_blocks, KV_BLOCK))
        engine = make_engine(**settings)  # only to build sequences as it does
        for i, length in enumerate(lengths):
            prompt = [100 * (i + 1) + j for j in range(length)]  # no shared prefix
            engine.add_request(prompt, greedy(new), request_id=f"p{i}")
            scheduler.add(engine.requests[f"p{i}"])
        seen = []
        for _ in range(PROBE_STEPS):
            batch = fn(scheduler)
            ran = tuple(
                (s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
            )
            seen.append((ran, tuple(s.request_id for s in batch.preempted)))
            for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
                seq.num_computed_tokens += n
                if seq.num_computed_tokens == seq.num_tokens:
                    seq.append_token(7, 0.0)
                    if seq.is_finished:
                        scheduler.finish(seq)
        return seen

    return {
        f"the plans when {binds} binds ({settings}, {blocks} blocks of {KV_BLOCK}, "
        f"prompts of {list(lengths)} tokens)": outcome(
            lambda a=(settings, blocks, lengths, new): plans(*a)
        )
        for binds, settings, blocks, lengths, new in PROBE_WORKLOADS
    }


EXERCISE = Exercise(
    name="schedule",
    reference=schedule,
    probe=_schedule_probe,
    swapped_in=hold,
    runs=engine_runs(
        _schedule_workload,
        plan,
        "the plan of every step, against the reference scheduler's",
        parts={"scheduler_class": ScheduleOf},
        **SCHEDULE_SETTINGS,
    )
    + engine_runs(
        _schedule_workload,
        plan,
        "the plan of every step with a budget below the sequence cap, against the "
        "reference scheduler's",
        tokens_too=False,
        parts={"scheduler_class": ScheduleOf},
        **TIGHT_BUDGET,
    ),
    known_wrong=known_mistakes(__name__),
    fallback="your plan differs from the policy (running oldest first, the newest "
    "preempted, waiting first come first served, within the token budget)",
    step_label=engine_step_name,
)


def check_schedule(fn: Callable) -> CheckResult:
    """Chapter 12: `schedule(scheduler) -> ScheduledBatch`, the decision for one step."""
    return check(EXERCISE, fn)
