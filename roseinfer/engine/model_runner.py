"""One engine step through the model: scheduled sequences in, next-token logits out.

The runner never holds a model of its own: it builds a `PagedKVCache` over the pool for
the scheduled sequences and calls `GPT.forward` with it once, as every other generation
path calls the model with its cache. One call a step: every new token of every
scheduled sequence (decoding tokens, prompt chunks, verify chunks) in one flat row with
its sequence's position and pool slot, so every product with the weights runs once, over
all of the step's rows. The decoding sequences go first (in the order of their decode
slots' rows), then the chunks; attention is the cache's own step, each sequence over its
own keys (roseinfer.cache.paged).

How the decoding sequences read their keys is the one choice (`EngineConfig.attention`):
"fast" (the default) reads them from `DecodeSlots` (roseinfer.cache.slots), kept
contiguous across steps; "gather" gathers each sequence's blocks from the pool every
step. Both give the same tokens (tests check it).
"""

from __future__ import annotations

import time

import torch

from roseinfer.cache.paged import KVPool, PagedKVCache
from roseinfer.cache.slots import DecodeSlots
from roseinfer.engine.config import default_slots_bytes
from roseinfer.engine.packed import can_pack, packed_linears
from roseinfer.engine.sequence import EngineSequence
from rosetrainer.model import GPT


class ModelRunner:
    def __init__(
        self,
        model: GPT,
        pool: KVPool,
        attention: str = "fast",
        record_writes: bool = False,
        max_num_seqs: int = 64,
        pack_weights: bool = False,
        slots_memory: int | None = None,
    ) -> None:
        # The model the steps run: on a CPU its linear layers packed once for oneDNN, for
        # the decode batch's row count (roseinfer.engine.packed); the caller's stays as it was.
        packing = pack_weights and can_pack(model)
        self.model = packed_linears(model, max_num_seqs) if packing else model
        self.pool = pool
        self.attention = attention
        # A quantized pool's old blocks are read dequantized, so its decode rows gather.
        fast = attention == "fast" and not pool.quantized
        # The decode slots take at most slots_memory bytes (None: the default budget).
        budget = default_slots_bytes(pool.nbytes) if slots_memory is None else slots_memory
        self.slots = DecodeSlots(model.config, max_num_seqs, pool, budget) if fast else None
        # For checks (record_writes: tests, chapters): the pool slots the last step wrote,
        # and the block tables of the sequences that wrote them, as they were then. Off,
        # a step copies no table and never waits for the device to hand the slots back.
        self.record_writes = record_writes
        self.written_slots: list[int] = []
        self.writer_tables: list[list[int]] = []
        self.seconds: dict[str, float] = {}  # the last step's model time ("model")
        self.num_decode = 0  # the last step's decode batch: sequences feeding one token

    @property
    def decode_slot_bytes(self) -> int:
        """What the decode slots hold allocated now (0 without them)."""
        return self.slots.nbytes if self.slots is not None else 0

    def release(self) -> None:
        """No request is left: the decode slots give back their rows and memory (while
        requests run, a finished one's row goes at the next step)."""
        if self.slots is not None:
            self.slots.clear()

    @torch.inference_mode()
    def run(
        self, seqs: list[EngineSequence], num_new: list[int]
    ) -> tuple[list[EngineSequence], torch.Tensor]:
        """Feed each sequence its next num_new tokens, all in one model call; return the
        sequences that reached their last token (they sample next) and their logits: one
        row each, or, for a sequence carrying drafts, 1 + len(draft_ids) rows (after its
        newest token, then after each draft), consecutive and in the order of the
        sequences returned."""
        seqs, num_new, slotted = self._order(seqs, num_new)
        if self.record_writes:
            self.writer_tables = [list(seq.block_table) for seq in seqs]
        cache = PagedKVCache(
            self.pool,
            [seq.block_table for seq in seqs],
            [seq.num_computed_tokens for seq in seqs],
            num_new,
            self.slots if slotted else None,
        )
        ids = [
            token
            for seq, n in zip(seqs, num_new, strict=True)
            for token in seq.fed_ids[seq.num_computed_tokens : seq.num_computed_tokens + n]
        ]
        # A sequence samples after this step if the step feeds its last known token (and
        # its drafts: a verify chunk is its newest token and the drafts).
        done = [
            i
            for i, (seq, n) in enumerate(zip(seqs, num_new, strict=True))
            if seq.num_computed_tokens + n == seq.num_tokens + len(seq.draft_ids)
        ]
        # Each sampling sequence's last token, or its newest token and every draft (None:
        # every token of the step samples, as in most decode steps).
        ends = torch.cumsum(torch.tensor(num_new), 0) - 1
        at = torch.cat(
            [torch.arange(ends[i] - len(seqs[i].draft_ids), ends[i] + 1) for i in done]
            or [torch.zeros(0, dtype=torch.long)]
        )
        logits_at = at.to(self.pool.device) if len(at) < len(ids) else None
        started = time.perf_counter()
        idx = torch.tensor([ids], device=self.pool.device)  # (1, the step's tokens)
        out = self.model(idx, cache=cache, logits_at=logits_at, validate=False)
        self.seconds = {"model": time.perf_counter() - started}
        self.num_decode = num_new.count(1)  # (they come first)
        if slotted:
            self.slots.advance()
        if self.record_writes:
            self.written_slots = cache.written_slots.tolist()
        return [seqs[i] for i in done], out.logits[0]

    def _order(
        self, seqs: list[EngineSequence], num_new: list[int]
    ) -> tuple[list[EngineSequence], list[int], bool]:
        """The step's sequences as the call lays them out: those feeding one token (the
        decode batch) first, in their decode slots' row order when the slots take them,
        then the others; and whether the slots take them (within their memory budget)."""
        decode = [seq for seq, n in zip(seqs, num_new, strict=True) if n == 1]
        chunks = [(seq, n) for seq, n in zip(seqs, num_new, strict=True) if n != 1]
        slotted = self.slots is not None and bool(decode)
        if slotted and not self.slots.fits(decode):
            # Past the slots' memory budget this step gathers instead (same tokens).
            if self.slots.nbytes:
                self.slots.clear()
            slotted = False
        if slotted:
            rows = self.slots.arrange(decode)  # decode row i reads slot row i
            decode = [seq for _, seq in sorted(zip(rows, decode, strict=True), key=lambda p: p[0])]
        elif self.slots is not None and not decode:
            self.slots.arrange([])  # nobody decodes now: every row is given up
        ordered = decode + [seq for seq, _ in chunks]
        return ordered, [1] * len(decode) + [n for _, n in chunks], slotted
