"""Chapter 12: the scheduler's decision for one engine step."""

from __future__ import annotations

from roseinfer.engine.scheduler import ScheduledBatch, Scheduler

# The reference is rose's own Scheduler.schedule (roseinfer/engine/scheduler.py), bound
# before a check swaps a learner's in; the stub leaves this line out, with the body below.
rose_schedule = Scheduler.schedule


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
    return rose_schedule(scheduler)


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
