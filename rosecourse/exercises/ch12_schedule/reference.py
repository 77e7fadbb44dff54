"""Chapter 12: the scheduler's decision for one engine step."""

from __future__ import annotations

from roseinfer.engine.scheduler import ScheduledBatch, Scheduler


def schedule(scheduler: Scheduler) -> ScheduledBatch:
    """Which sequences run in this step, with how many new tokens each; who is preempted.

    The policy, where `manager` is `scheduler.block_manager` and the step's token budget
    is `scheduler.config.max_num_batched_tokens`:
    1. Running sequences (`scheduler.running`, oldest first) each take the tokens they
       have not computed yet, as many as the budget has left (a prefill may be chunked).
       When the pool cannot grow one to hold them (`manager.can_grow(seq, n)`), the
       newest running sequence is preempted (`scheduler._preempt`, listed in
       `batch.preempted`) until it can, or until the one in hand was the one preempted.
       A sequence that runs is grown first (`manager.grow`).
    2. Only if nobody was preempted: waiting sequences (`scheduler.waiting`), first come
       first served, while budget is left and fewer than `config.max_num_seqs` run. Each
       first gets the blocks the prefix cache holds for it (`manager.cached_prefix`) and
       computes the rest; when the pool cannot take it (`manager.can_start`) nobody
       behind it may start either. A started one is popped from waiting,
       `manager.start`ed (which records what the prefix cache served) and appended to
       `running`.
    3. `running` ends sorted by arrival (`scheduler.arrival_order`).
    Each scheduled sequence goes into batch.seqs with its count in batch.num_new_tokens.
    The engine's scheduler also serves a model with a sliding window (chapter 18) and
    feeds drafted tokens (chapter 19); the check's engine has neither, so your function
    need not.
    """
    batch = ScheduledBatch()
    budget = scheduler.config.max_num_batched_tokens
    manager = scheduler.block_manager

    # This is the engine's scheduler (tests/test_course_copies.py runs it beside
    # roseinfer/engine/scheduler.py on random schedules, a sliding window's included), but
    # for the drafted tokens a step may feed with speculative decoding (chapter 19).
    index = 0
    while index < len(scheduler.running) and budget > 0:
        seq = scheduler.running[index]
        # Not the exercise (chapter 18): the engine's own step for a sliding-window model,
        # whose blocks behind the window go back; without a window it does nothing.
        manager.drop_out_of_window(seq)
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        while not manager.can_grow(seq, seq.num_computed_tokens + num_new):
            victim = scheduler.running.pop()  # the newest gives its blocks back
            scheduler._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                break
        else:
            manager.grow(seq, seq.num_computed_tokens + num_new)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
            index += 1

    while (
        not batch.preempted
        and scheduler.waiting
        and budget > 0
        and len(scheduler.running) < scheduler.config.max_num_seqs
    ):
        seq = scheduler.waiting[0]
        cached = manager.cached_prefix(seq.all_ids)
        num_cached = len(cached) * manager.kv_block_size
        num_new = min(seq.num_tokens - num_cached, budget)
        if not manager.can_start(cached, num_cached + num_new):
            break  # first come, first served: nobody overtakes the head of the queue
        scheduler.waiting.popleft()
        manager.start(seq, cached, num_cached + num_new)
        scheduler.running.append(seq)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)
        budget -= num_new
    scheduler.running.sort(key=scheduler.arrival_order.__getitem__)
    return batch


# `rose-course hint 12` gives these one at a time, the idea first and the near-code
# last (`rose-course check 12` counts how many were used); the stub leaves them out.
HINTS = (
    "Two passes: the running sequences first, oldest first, each taking what it still has "
    "to compute within the budget; then, only if nobody was preempted, the waiting ones in "
    "order while the budget, max_num_seqs and the pool allow.",
    "Preemption: while not manager.can_grow(seq, seq.num_computed_tokens + n), pop the "
    "newest running sequence (scheduler.running.pop()), scheduler._preempt it and list it "
    "in batch.preempted, until the pool can grow seq or seq itself was the one popped. "
    "Python's while ... else: the else runs only when the loop ended without a break.",
    "Admission: for the head of waiting, cached = manager.cached_prefix(seq.all_ids); it "
    "computes the rest, n = min(seq.num_tokens - cached tokens, budget). If not "
    "manager.can_start(cached, cached tokens + n), stop: nobody overtakes it. Else popleft, "
    "manager.start, append to running and to the batch.",
    "At the end: scheduler.running.sort(key=scheduler.arrival_order.__getitem__). Sorting "
    "by request id is not arrival order: ids are strings, and 'r10' < 'r2'.",
)
