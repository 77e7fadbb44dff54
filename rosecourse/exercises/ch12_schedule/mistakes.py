"""Chapter 12's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

from rosecourse.exercises.answers import alternative, blind, known, mutant
from rosecourse.exercises.ch12_schedule import schedule
from roseinfer.engine.scheduler import ScheduledBatch, Scheduler

# -- the known mistakes: the check names each one it meets (answers.known) ----------


@contextlib.contextmanager
def _config_replaced(scheduler: Scheduler, **changes: object):
    kept = scheduler.config
    scheduler.config = dataclasses.replace(kept, **changes)
    try:
        yield
    finally:
        scheduler.config = kept


@known(
    "12",
    "you ignore max_num_batched_tokens: a long prompt must be prefilled in chunks "
    "of what is left of the step's token budget",
)
def _ignores_budget(scheduler):
    with _config_replaced(scheduler, max_num_batched_tokens=10**9):
        return schedule(scheduler)


@known(
    "12",
    "you admit more running sequences than max_num_seqs: count the running ones "
    "before admitting another",
)
def _ignores_max_seqs(scheduler):
    with _config_replaced(scheduler, max_num_seqs=10**9):
        return schedule(scheduler)


@known(
    "12",
    "a preempted sequence gives its blocks back but never returns to the waiting "
    "queue (scheduler._preempt puts it there): its request never finishes",
)
def _forgets_preempted(scheduler):
    # The victim's blocks go back, but it never returns to the waiting queue.
    with mock.patch.object(scheduler, "_preempt", scheduler.block_manager.release):
        return schedule(scheduler)


@known(
    "12",
    "when the pool cannot grow a sequence you preempt that sequence: preempt the "
    "newest running one (its work is the least to redo), until the pool can",
)
def _preempts_current(scheduler):
    """The policy, except that a sequence the pool cannot grow is preempted itself."""
    batch = ScheduledBatch()
    budget = scheduler.config.max_num_batched_tokens
    manager = scheduler.block_manager
    for seq in list(scheduler.running):
        if budget == 0:
            break
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if manager.can_grow(seq, seq.num_computed_tokens + num_new):
            manager.grow(seq, seq.num_computed_tokens + num_new)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        else:
            scheduler.running.remove(seq)
            scheduler._preempt(seq)
            batch.preempted.append(seq)
    if batch.preempted or budget == 0:
        return batch
    # The waiting part is the policy's: the reference with what is left of the limits.
    running, scheduler.running = scheduler.running, []
    room = scheduler.config.max_num_seqs - len(running)
    with _config_replaced(scheduler, max_num_batched_tokens=budget, max_num_seqs=room):
        admitted = schedule(scheduler)
    scheduler.running = sorted(running + scheduler.running, key=scheduler.arrival_order.get)
    batch.seqs += admitted.seqs
    batch.num_new_tokens += admitted.num_new_tokens
    return batch


@known(
    "12",
    "nobody is admitted while anyone runs: that is static batching; continuous "
    "batching admits waiting requests into every step with room",
)
def _static_batching(scheduler):
    if not scheduler.running:
        return schedule(scheduler)
    waiting, scheduler.waiting = scheduler.waiting, type(scheduler.waiting)()
    try:
        return schedule(scheduler)
    finally:
        scheduler.waiting = waiting


# -- 12: schedule(scheduler) ----------------------------------------------------------------


def _schedule(scheduler, **mistake: bool):
    """The policy of rosecourse/exercises/ch12_schedule/reference.py with one `mistake` in it."""
    from roseinfer.engine.scheduler import ScheduledBatch

    batch = ScheduledBatch()
    budget = scheduler.config.max_num_batched_tokens
    manager = scheduler.block_manager
    index = 0
    while index < len(scheduler.running) and budget > 0:
        seq = scheduler.running[index]
        num_new = seq.num_tokens - seq.num_computed_tokens
        if not mistake.get("running_uncapped"):
            num_new = min(num_new, budget)
        while not manager.can_grow(seq, seq.num_computed_tokens + num_new):
            victim = scheduler.running.pop(0 if mistake.get("oldest_preempted") else -1)
            scheduler._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                break
            if mistake.get("oldest_preempted"):
                index = max(index - 1, 0)
        else:
            manager.grow(seq, seq.num_computed_tokens + num_new)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= 0 if mistake.get("running_free") else num_new
            index += 1
    position = -1 if mistake.get("newest_waiting_first") else 0
    limit = scheduler.config.max_num_seqs + (1 if mistake.get("one_seq_too_many") else 0)
    stopped = bool(batch.preempted) and not mistake.get("admits_after_preempting")
    passed_over = []  # heads the pool could not take, when a later one may overtake them
    while not stopped and scheduler.waiting and budget > 0 and len(scheduler.running) < limit:
        seq = scheduler.waiting[position]
        cached = [] if mistake.get("no_prefix_cache") else manager.cached_prefix(seq.all_ids)
        num_cached = len(cached) * manager.kv_block_size
        num_new = min(seq.num_tokens - num_cached, budget)
        if mistake.get("whole_prompts_only") and num_new < seq.num_tokens - num_cached:
            break
        if not manager.can_start(cached, num_cached + num_new):
            if not mistake.get("blocked_head_overtaken"):
                break
            passed_over.append(scheduler.waiting.popleft())
            continue
        scheduler.waiting.remove(seq)
        manager.start(seq, cached, num_cached + num_new)
        scheduler.running.append(seq)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)
        budget -= num_new + (num_cached if mistake.get("cached_tokens_charged") else 0)
    scheduler.waiting.extendleft(reversed(passed_over))
    if mistake.get("sorted_by_request_id"):
        scheduler.running.sort(key=lambda seq: seq.request_id)  # "r10" < "r2"
    else:
        scheduler.running.sort(key=scheduler.arrival_order.__getitem__)
    return batch


@mutant("12")
def oldest_preempted(scheduler):
    return _schedule(scheduler, oldest_preempted=True)


@mutant("12")
def running_free(scheduler):
    return _schedule(scheduler, running_free=True)


@mutant("12")
def newest_waiting_first(scheduler):
    return _schedule(scheduler, newest_waiting_first=True)


@mutant("12")
def one_seq_too_many(scheduler):
    return _schedule(scheduler, one_seq_too_many=True)


@mutant("12")
def running_uncapped(scheduler):
    return _schedule(scheduler, running_uncapped=True)


@mutant("12")
def no_prefix_cache(scheduler):
    return _schedule(scheduler, no_prefix_cache=True)


@mutant("12")
def whole_prompts_only(scheduler):
    return _schedule(scheduler, whole_prompts_only=True)


@mutant("12")
def running_sorted_by_request_id(scheduler):
    return _schedule(scheduler, sorted_by_request_id=True)


@mutant("12")
def admits_after_preempting(scheduler):
    return _schedule(scheduler, admits_after_preempting=True)


@mutant("12")
def blocked_head_overtaken(scheduler):
    return _schedule(scheduler, blocked_head_overtaken=True)


@mutant("12")
def cached_tokens_charged(scheduler):
    return _schedule(scheduler, cached_tokens_charged=True)


@alternative("12")
def the_policy_written_out(scheduler):
    return _schedule(scheduler)


# -- Written blind (issue 45) --


def _blind_12(
    scheduler: Scheduler, victim_at=-1, after_preempting=False, capped=True, skip_blocked=False
) -> ScheduledBatch:
    batch = ScheduledBatch()
    budget = scheduler.config.max_num_batched_tokens
    manager = scheduler.block_manager
    index = 0
    while index < len(scheduler.running) and budget > 0:
        seq = scheduler.running[index]
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        preempted_self = False
        while not manager.can_grow(seq, seq.num_computed_tokens + num_new):
            victim = scheduler.running.pop(victim_at)
            scheduler._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                preempted_self = True
                break
        if preempted_self:
            continue
        manager.grow(seq, seq.num_computed_tokens + num_new)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)
        budget -= num_new
        index += 1
    for seq in list(scheduler.waiting):
        if (batch.preempted and not after_preempting) or budget <= 0:
            break
        if capped and len(scheduler.running) >= scheduler.config.max_num_seqs:
            break
        cached = manager.cached_prefix(seq.all_ids)
        num_cached = len(cached) * manager.kv_block_size
        num_new = min(seq.num_tokens - num_cached, budget)
        if not manager.can_start(cached, num_cached + num_new):
            if skip_blocked:
                continue
            break
        scheduler.waiting.remove(seq)
        manager.start(seq, cached, num_cached + num_new)
        scheduler.running.append(seq)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)
        budget -= num_new
    scheduler.running.sort(key=scheduler.arrival_order.__getitem__)
    return batch


# WRONG: admits waiting sequences even when someone was preempted this step
@blind("12")
def admit_after_preempt(scheduler):
    return _blind_12(scheduler, after_preempting=True)


# WRONG: ignores max_num_seqs when admitting
@blind("12", known="ignores_max_seqs")
def no_max_num_seqs(scheduler):
    return _blind_12(scheduler, capped=False)


# WRONG: preempts the oldest running sequence (running.pop(0)) instead of the newest
@blind("12")
def preempt_oldest(scheduler):
    return _blind_12(scheduler, victim_at=0)


# WRONG: a waiting sequence the pool cannot take is skipped and the next one tried (no FCFS)
@blind("12")
def skip_blocked_head(scheduler):
    return _blind_12(scheduler, skip_blocked=True)
