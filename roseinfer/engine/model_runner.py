"""One engine step through the model: scheduled sequences in, next-token logits out.

The runner never holds a model of its own: it builds a `PagedKVCache` over the
pool for the scheduled sequences and calls `GPT.forward` with it, as every other
generation path calls the model with its cache.

With attention="reference" every scheduled token goes in one flat row. With "gather"
the sequences that feed one token (decoding) go in one padded batch, one row each, so
each query's attention costs only its own context (its blocks gathered from the pool);
the others (prompts being read) go in one flat row. "fast" (the default) is "gather"
whose decode rows read their keys from `DecodeSlots` (roseinfer.cache.slots), kept
contiguous across steps instead of gathered every step. All give the same tokens
(tests check it).
"""

from __future__ import annotations

import time

import torch

from roseinfer.cache.paged import KVPool, PagedKVCache
from roseinfer.cache.slots import DecodeSlots, SlotKVCache
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
        # The model the steps run: on a CPU its linear layers packed once for the
        # decode batch's row count (roseinfer.engine.packed); the caller's stays as it was.
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
        self.seconds: dict[str, float] = {}  # the last step's model time: decode, prefill

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
        """Feed each sequence its next num_new tokens; return the sequences that reached
        their last token (they sample next) and their logits: one row each, or, for a
        sequence carrying drafts, 1 + len(draft_ids) rows (after its newest token, then
        after each draft), consecutive and in the order of the sequences returned."""
        written: list[torch.Tensor] = []
        if self.record_writes:
            self.writer_tables = [list(seq.block_table) for seq in seqs]
        if self.attention == "reference":
            groups = [(list(range(len(seqs))), "flat")]
        else:
            decode = [i for i, n in enumerate(num_new) if n == 1]
            prefill = [i for i, n in enumerate(num_new) if n != 1]
            if self.slots is not None and not decode:
                self.slots.arrange([])  # nobody decodes now: every row is given up
            groups = [(decode, "padded"), (prefill, "flat")]
        sampled: list[EngineSequence] = []
        logits: list[torch.Tensor] = []
        self.seconds = {}
        for rows, layout in groups:
            if not rows:
                continue
            started = time.perf_counter()
            group_seqs = [seqs[i] for i in rows]
            group_new = [num_new[i] for i in rows]
            done, group_logits, slots = self._forward(group_seqs, group_new, layout)
            sampled += done
            logits.append(group_logits)
            written.append(slots)
            # fast: the padded group decodes, the flat one reads prompts; reference: one call
            phase = (
                "model"
                if self.attention == "reference"
                else {"padded": "decode"}.get(layout, "prefill")
            )
            self.seconds[phase] = time.perf_counter() - started
        if self.record_writes:
            self.written_slots = torch.cat(written).tolist()
        return sampled, torch.cat(logits)

    def _forward(
        self, seqs: list[EngineSequence], num_new: list[int], layout: str
    ) -> tuple[list[EngineSequence], torch.Tensor, torch.Tensor]:
        device = self.pool.device
        slotted = layout == "padded" and self.slots is not None
        if slotted and not self.slots.fits(seqs):
            # Past the slots' memory budget this step gathers instead (same tokens).
            if self.slots.nbytes:
                self.slots.clear()
            slotted = False
        if slotted:
            rows = self.slots.arrange(seqs)  # batch row i reads slot row i
            seqs = [seq for _, seq in sorted(zip(rows, seqs, strict=True), key=lambda p: p[0])]
            cache = SlotKVCache(self.slots, seqs)
        else:
            cache = PagedKVCache(
                self.pool,
                [seq.block_table for seq in seqs],
                [seq.num_computed_tokens for seq in seqs],
                num_new,
                layout,
            )
        ids = [
            seq.fed_ids[seq.num_computed_tokens : seq.num_computed_tokens + n]
            for seq, n in zip(seqs, num_new, strict=True)
        ]
        # A sequence samples after this step if the step feeds its last known token (and
        # its drafts: a verify chunk is its newest token and the drafts).
        done = [
            i
            for i, (seq, n) in enumerate(zip(seqs, num_new, strict=True))
            if seq.num_computed_tokens + n == seq.num_tokens + len(seq.draft_ids)
        ]
        if layout == "padded":
            idx = torch.tensor(ids, device=device)  # (num_seqs, 1)
            out = self.model(idx, cache=cache, last_only=True, validate=False)
            # (every row samples, as in most decode steps: a view, not a copy of the logits)
            logits = out.logits[:, -1] if len(done) == len(seqs) else out.logits[done, -1]
            if slotted:
                self.slots.advance()
        else:
            idx = torch.tensor([sum(ids, [])], device=device)  # (1, total new tokens)
            ends = torch.cumsum(torch.tensor(num_new), 0) - 1  # each sequence's last new token
            # Each sampling sequence's last token, or its newest token and every draft.
            at = torch.cat(
                [torch.arange(ends[i] - len(seqs[i].draft_ids), ends[i] + 1) for i in done]
                or [torch.zeros(0, dtype=torch.long)]
            ).to(device)
            out = self.model(idx, cache=cache, logits_at=at, validate=False)
            logits = out.logits[0]
        return [seqs[i] for i in done], logits, cache.written_slots
