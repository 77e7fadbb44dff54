"""One engine step through the model: scheduled sequences in, next-token logits out.

The runner never holds a model of its own: it builds a `PagedKVCache` over the pool for
the scheduled sequences and calls `GPT.forward` with it once, as every other generation
path calls the model with its cache. One call a step: every new token of every
scheduled sequence (decoding tokens, prompt chunks, verify chunks) in one flat row with
its sequence's position and pool slot, so every product with the weights runs once, over
all of the step's rows. The decoding sequences go first, then the chunks; attention is
the cache's own step, each sequence over its own keys (roseinfer.cache.paged).

How attention reads the keys is the one choice (`EngineConfig.attention`, resolved for
the pool's device): "kernel" (the CPU's default) reads each decoding sequence's blocks
where they lie in the pool with a small compiled kernel (roseinfer.cache.kernels: on a
CPU, for a plain pool; elsewhere, or where it cannot be built, the gather); "flex" (the
default on CUDA) reads the pool in place for the decode rows and the chunks alike, one
compiled FlexAttention call each (roseinfer.cache.flex; a quantized pool gathers);
"gather" gathers each sequence's blocks into one tensor every step and attends in
PyTorch. All give the same tokens (tests check it). The pool is the only copy of the
keys and values.
"""

from __future__ import annotations

import time

import torch

from roseinfer.cache import kernels
from roseinfer.cache.paged import KVPool, PagedKVCache, QuantizedKVPool
from roseinfer.engine.cuda_graphs import DecodeGraphs, bucket_for
from roseinfer.engine.packed import can_pack, packed_linears
from roseinfer.engine.sequence import EngineSequence
from rosetrainer.model import GPT


class ModelRunner:
    def __init__(
        self,
        model: GPT,
        pool: KVPool | QuantizedKVPool,
        attention: str = "kernel",
        record_writes: bool = False,
        max_num_seqs: int = 64,
        pack_weights: bool = False,
        decode_graphs: bool = False,
    ) -> None:
        # The model the steps run: on a CPU its linear layers packed once for oneDNN, for
        # the decode batch's row count (roseinfer.engine.packed); the caller's stays as it was.
        packing = pack_weights and can_pack(model)
        self.model = packed_linears(model, max_num_seqs) if packing else model
        self.pool = pool
        self.attention = attention
        # Decode rows read their blocks in place where the kernel runs on this pool; with
        # flex, the whole step does (a plain pool, stored heads first for it).
        self.in_place = attention == "kernel" and kernels.runs_on(pool)
        self.flex = attention == "flex" and not pool.quantized
        # Decode steps through static buffers, replayed as CUDA graphs on a GPU (the pool's
        # last block is the padding rows' spare: the caller left it out of the manager's).
        self.graphs = None
        if decode_graphs and self.flex:
            max_blocks = -(-model.config.block_size // pool.kv_block_size)
            capture = pool.device.type == "cuda"
            pad_block = pool.num_blocks - 1
            self.graphs = DecodeGraphs(
                self.model, pool, max_num_seqs, max_blocks, pad_block, capture
            )  # For checks (record_writes: tests, chapters): the pool slots the last step wrote,
        # and the block tables of the sequences that wrote them, as they were then. Off,
        # a step copies no table and never waits for the device to hand the slots back.
        self.record_writes = record_writes
        self.written_slots: list[int] = []
        self.writer_tables: list[list[int]] = []
        self.seconds: dict[str, float] = {}  # the last step's model time ("model")
        self.num_decode = 0  # the last step's decode batch: sequences feeding one token
        # The rows the last step's static decode step ran over (its tokens padded to a
        # bucket, every row's logits made), or None where the step ran eager.
        self.graph_rows: int | None = None

    @torch.inference_mode()
    def run(
        self, seqs: list[EngineSequence], num_new: list[int]
    ) -> tuple[list[EngineSequence], torch.Tensor]:
        """Feed each sequence its next num_new tokens, all in one model call; return the
        sequences that reached their last token (they sample next) and their logits: one
        row each, or, for a sequence carrying drafts, 1 + len(draft_ids) rows (after its
        newest token, then after each draft), consecutive and in the order of the
        sequences returned."""
        seqs, num_new, ids, cache = self._step_inputs(seqs, num_new)
        if self.record_writes:
            self.writer_tables = [list(seq.block_table) for seq in seqs]
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
        tables = [seq.block_table for seq in seqs]
        self.graph_rows = None
        if self.graphs is not None and self.graphs.takes(num_new, max(map(len, tables))):
            self.graph_rows = bucket_for(len(ids), self.graphs.buckets)
            positions = [seq.num_computed_tokens for seq in seqs]
            logits = self.graphs.run(tables, positions, ids)
            logits = logits if logits_at is None else logits[logits_at]
            written = self.graphs.slots[: len(ids)]
        else:
            idx = torch.tensor([ids], device=self.pool.device)  # (1, the step's tokens)
            out = self.model(idx, cache=cache, logits_at=logits_at, validate=False)
            logits, written = out.logits[0], cache.written_slots
        self.seconds = {"model": time.perf_counter() - started}
        self.num_decode = num_new.count(1)  # (they come first)
        if self.record_writes:
            self.written_slots = written.tolist()
        return [seqs[i] for i in done], logits

    @torch.inference_mode()
    def fill(self, seqs: list[EngineSequence], num_new: list[int]) -> None:
        """Feed each sequence its next num_new tokens for their keys and values alone (a
        draft model reading the target's step into its own pool): one call, no logits."""
        _, _, ids, cache = self._step_inputs(seqs, num_new)
        idx = torch.tensor([ids], device=self.pool.device)
        nothing = torch.zeros(0, dtype=torch.long, device=self.pool.device)
        self.model(idx, cache=cache, logits_at=nothing, validate=False)

    def _step_inputs(
        self, seqs: list[EngineSequence], num_new: list[int]
    ) -> tuple[list[EngineSequence], list[int], list[int], PagedKVCache]:
        """The step's sequences, the decode batch (sequences feeding one token) first,
        then the chunks; their token counts in that order; every token fed, in one flat
        row; and the pool's view for the call."""
        order = sorted(range(len(seqs)), key=lambda i: num_new[i] != 1)
        seqs, num_new = [seqs[i] for i in order], [num_new[i] for i in order]
        computed = [seq.num_computed_tokens for seq in seqs]
        tables = [seq.block_table for seq in seqs]
        cache = PagedKVCache(self.pool, tables, computed, num_new, self.in_place, self.flex)
        ids = [
            token
            for seq, start, n in zip(seqs, computed, num_new, strict=True)
            for token in seq.fed_slice(start, start + n)
        ]
        return seqs, num_new, ids, cache
