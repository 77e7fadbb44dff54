"""The engine's draft model: its keys and values in the pool's blocks.

A `ModelDrafter` (roseinfer.speculative.drafters) keeps a cache of its own per request,
which is what the teaching loop's single request needs. Inside the engine those caches
would be a second store of keys beside the pool, outside its sizing and its stats,
re-padded and stacked every step, and caught up one request at a time. The engine
instead gives the draft model the target's blocks: block i of a sequence's table holds
its positions i * kv_block_size onwards for the draft's layers as well as the target's,
so one block table, one block manager and one prefix cache serve both.

* A separate draft model gets a pool of its own (a `KVPool` of its layers, as many blocks
  as the target's: the engine sizes the two together and `stats()` counts both). After
  each step's forward the draft model reads the step's tokens into it (`mirror`), so its
  keys are in every block the target's are, prefix-cached blocks included.
* A self-draft (the target's first n layers) over a plain pool needs no pool: the
  target's pool already holds those layers' keys.

`propose` drafts for every asking sequence at once: one model call feeds each one's
newest token, then one call per further draft feeds each one's latest draft; every call
is a decode batch over the pool (the compiled kernel reads the blocks where they lie,
as in the target's step). So the number of calls depends on k, not on the batch. The
draft positions lie past what the target has computed, in blocks the engine reserved
for them before asking (`LLMEngine.propose_drafts`); the verify step writes the target's
own keys over them, and a rejected draft's keys are written over before anything reads
them (a block is shared or cached only once all of its tokens are computed).
"""

from __future__ import annotations

import torch

from roseinfer.cache.paged import PagedKVCache
from roseinfer.engine.model_runner import ModelRunner
from roseinfer.engine.sequence import EngineSequence
from roseinfer.speculative.drafters import choose_draft
from roseinfer.speculative.verify import Draft


class PoolDrafter:
    """A draft model reading and writing its keys through `runner` (a `ModelRunner` of
    the draft model, its linear layers packed where the target's are): over a pool of
    its own, which `mirror` fills, or over the target's (a self-draft over a plain pool:
    `mirrors` False)."""

    def __init__(self, runner: ModelRunner, mirrors: bool) -> None:
        self.runner = runner
        self.model, self.pool = runner.model, runner.pool
        self.mirrors = mirrors

    def mirror(self, seqs: list[EngineSequence], num_new: list[int]) -> None:
        """The step's tokens (before it counts them as computed) into the draft's pool, at
        the slots the target wrote them to: one call, no logits."""
        self.runner.fill(seqs, num_new)

    @torch.inference_mode()
    def propose(self, seqs: list[EngineSequence], ks: list[int]) -> list[Draft]:
        """Up to k greedy drafts per sequence, each within its grammar (a fork of its
        matcher), from its newest token on; a sequence stops being fed once it has its k.
        Every sequence has blocks for k more tokens (the engine reserved them)."""
        grammars = [None if seq.matcher is None else seq.matcher.fork() for seq in seqs]
        drafted: list[list[int]] = [[] for _ in seqs]
        rows = list(range(len(seqs)))
        fed = [seq.fed_slice(seq.num_tokens - 1, seq.num_tokens)[0] for seq in seqs]
        while rows:
            logits = self._decode([seqs[r] for r in rows], [len(drafted[r]) for r in rows], fed)
            for logits_row, r in zip(logits, rows, strict=True):
                token = choose_draft(logits_row, seqs[r], [], grammars[r])
                drafted[r].append(token)
            rows = [r for r in rows if len(drafted[r]) < ks[r]]
            fed = [drafted[r][-1] for r in rows]
        return [Draft(tokens) for tokens in drafted]

    def _decode(self, seqs: list[EngineSequence], ahead: list[int], ids: list[int]) -> torch.Tensor:
        """Feed each sequence one token, ahead[i] places past its newest: the logits, one
        row each."""
        positions = [seq.num_tokens - 1 + n for seq, n in zip(seqs, ahead, strict=True)]
        cache = PagedKVCache(
            self.pool,
            [seq.block_table for seq in seqs],
            positions,
            [1] * len(seqs),
            self.runner.in_place,
            self.runner.flex,
        )
        idx = torch.tensor([ids], device=self.pool.device)
        return self.model(idx, cache=cache, validate=False).logits[0]

    def release(self, seq: EngineSequence) -> None:
        """Nothing is kept per request: its keys are in its blocks, which go back with it."""
