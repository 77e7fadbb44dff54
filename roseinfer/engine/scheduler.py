"""Continuous batching: which sequences run in the next step, and how many tokens each.

Two queues. `waiting` holds admitted sequences without a cache (new ones, and
preempted ones that will recompute theirs), first come first served. `running` holds
the sequences with blocks in the pool, oldest first.

Each step packs one flat batch under two limits, `max_num_batched_tokens` tokens and
`max_num_seqs` sequences:

1. every running sequence, oldest first, gets its next tokens: one to decode, or the
   next chunk of a prompt it is still reading. When the pool has no block left for
   one, the newest running sequence is preempted: its blocks go back to the pool and
   it returns to the front of `waiting`, to recompute its tokens later (its blocks
   may still be in the prefix cache then). No sequence ever waits on another's
   blocks, so the engine cannot deadlock.
2. then, if nothing was preempted, waiting sequences join in arrival order while the
   budget, the sequence limit and the pool allow, each starting after the part of its
   tokens the prefix cache already holds. A long prompt takes what is left of the
   budget and reads the rest in later steps (chunked prefill).

A sequence leaves `running` the moment it finishes or is aborted, and its blocks go
back at once, so the next step already fills its place.

Speculative decoding: a running sequence about to decode may carry drafted tokens
(`draft_ids`, which the engine's drafter proposed after the previous step's forward), its
verify chunk then being its newest token and the drafts. The scheduler never asks for
drafts; it only takes as many of a sequence's drafts as fit with its own token (what is
left of the token budget, and only pool slots no later running sequence needs for its
tokens: a draft never preempts anyone) and drops the rest. A preempted sequence loses its
drafts; one the step leaves out keeps them for the next (vLLM v1's scheduler takes a
request's `spec_token_ids` the same way).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from roseinfer.engine.block_manager import BlockManagerProtocol, blocks_short
from roseinfer.engine.config import EngineConfig
from roseinfer.engine.sequence import EngineSequence


@dataclass
class ScheduledBatch:
    seqs: list[EngineSequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each feeds this step
    preempted: list[EngineSequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManagerProtocol) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[EngineSequence] = deque()
        self.running: list[EngineSequence] = []  # oldest first
        self.arrival_order: dict[EngineSequence, int] = {}
        self._counter = itertools.count()
        self.num_preemptions = 0
        # The waiting head's prefix-cache lookup: (sequence, cache version, blocks found).
        # A head the pool cannot take yet waits step after step; it is looked up (its
        # tokens joined and every block hashed) again only once the cache has changed.
        self._head_lookup: tuple[EngineSequence, int, list[int]] | None = None

    def add(self, seq: EngineSequence) -> None:
        self.arrival_order[seq] = next(self._counter)
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        manager = self.block_manager

        # 1. Running sequences, oldest first.
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            manager.drop_out_of_window(seq)  # (a sliding-window model's blocks behind it)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not manager.can_grow(seq, seq.num_computed_tokens + num_new):
                victim = self.running.pop()  # the newest
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                num_new += self._draft_room(seq, num_new, budget, index)
                manager.grow(seq, seq.num_computed_tokens + num_new)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                index += 1

        # 2. Waiting sequences, in arrival order, while there is room.
        while (
            not batch.preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            cached = self._cached_prefix(seq)
            num_cached = len(cached) * manager.kv_block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if not manager.can_start(cached, num_cached + num_new):
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            self._head_lookup = None  # (its tokens grow once it runs)
            manager.start(seq, cached, num_cached + num_new)
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        self.running.sort(key=self.arrival_order.__getitem__)
        return batch

    def _cached_prefix(self, seq: EngineSequence) -> list[int]:
        """The blocks the prefix cache holds of seq's tokens (a waiting sequence's tokens
        do not change): the last lookup's, when it was seq's and the cache is as it was."""
        version = self.block_manager.cache_version
        if self._head_lookup is not None:
            last, last_version, cached = self._head_lookup
            if last is seq and last_version == version:
                return cached
        cached = self.block_manager.cached_prefix(seq.all_ids)
        self._head_lookup = (seq, version, cached)
        return cached

    def _draft_room(self, seq: EngineSequence, num_new: int, budget: int, index: int) -> int:
        """How many of running[index]'s drafts it feeds in this step, after its own token
        (0 unless it decodes): at most its drafts, the budget left after that token, and
        the slots its blocks and the spare ones hold, spare being what no later running
        sequence needs for all of its tokens. The drafts that do not fit are dropped (the
        drafter proposes afresh after the step)."""
        if not seq.draft_ids:
            return 0
        decoding = num_new == 1 and seq.num_computed_tokens + 1 == seq.num_tokens
        room = 0
        if decoding:
            manager = self.block_manager
            size = manager.kv_block_size
            later = sum(blocks_short(other, size) for other in self.running[index + 1 :])
            slots = (len(seq.block_table) + max(0, manager.num_available - later)) * size
            room = max(0, min(len(seq.draft_ids), budget - 1, slots - seq.num_tokens))
        del seq.draft_ids[room:]
        return room

    def _preempt(self, seq: EngineSequence) -> None:
        """Give back all of seq's blocks; it recomputes them when it runs again."""
        seq.draft_ids = []
        self.block_manager.release(seq)
        self.num_preemptions += 1
        # Back into the waiting queue at its place by arrival: ahead of every newer request.
        position = 0
        while (
            position < len(self.waiting)
            and self.arrival_order[self.waiting[position]] < self.arrival_order[seq]
        ):
            position += 1
        self.waiting.insert(position, seq)

    def finish(self, seq: EngineSequence) -> None:
        """seq finished or was aborted: out of the queues, its blocks back at once (and its
        drafts gone with it)."""
        assert seq.is_finished, f"{seq.request_id} is not finished"
        seq.draft_ids = []
        self.arrival_order.pop(seq, None)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.release(seq)
