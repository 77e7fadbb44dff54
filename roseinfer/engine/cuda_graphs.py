"""Decode steps replayed through CUDA graphs, one graph per batch-size bucket.

A decode step on a GPU is a few hundred small kernels; launched one by one from Python,
the launches, not the card, set its time. vLLM and nano-vllm capture the step once per
batch size into a CUDA graph and replay it: every kernel launched by one call. A graph
replays the same kernels on the same memory, so the step reads its inputs from static
buffers (`DecodeGraphs`: token ids, positions, pool slots, block tables, each block's
place), filled before each replay, and writes its logits to a static output. Batch sizes
are padded up to a bucket (1, 2, 4, 8, 16, ... up to max_num_seqs): one graph each,
captured at start-up, largest first (the smaller ones reuse its memory); the time and
memory it took are printed. A padding row feeds token 0 at position 0 of the spare
block (`pad_block`, a block of the pool the block manager never hands out): it writes
its key and value there and reads only that block, so it touches nothing a sequence
holds, and its logits are dropped.

`DecodeGraphs.step(rows)` is the decode step over the first `rows` static rows: the
function each graph captures, and what `run` calls directly where there are no graphs
(on a CPU: tests check that it gives the eager step's tokens). Only steps where every
sequence feeds one token (no prompt chunk, no verify chunk) replay; the rest run eager,
as does everything with `EngineConfig(enforce_eager=True)` (`--enforce-eager`).
Sampling is outside the graph: each request keeps its own sampling stream.
"""

from __future__ import annotations

import sys
import time

import torch

from roseinfer.cache.flex import StaticDecodeCache, block_places
from roseinfer.cache.paged import KVPool
from rosetrainer.model import GPT


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes a graph is captured for: powers of two below max_num_seqs, and it."""
    buckets, size = [], 1
    while size < max_num_seqs:
        buckets.append(size)
        size *= 2
    return [*buckets, max_num_seqs]


def bucket_for(rows: int, buckets: list[int]) -> int:
    """The smallest bucket that holds `rows` rows."""
    return next(size for size in buckets if size >= rows)


class DecodeGraphs:
    """Static buffers for decode steps of up to max_num_seqs rows, and (capture=True, on
    CUDA) one CUDA graph per bucket. max_blocks: the most blocks a sequence holds;
    pad_block: the pool's spare block, for padding rows."""

    def __init__(
        self,
        model: GPT,
        pool: KVPool,
        max_num_seqs: int,
        max_blocks: int,
        pad_block: int,
        capture: bool,
    ) -> None:
        self.model, self.pool, self.pad_block = model, pool, pad_block
        self.buckets = batch_buckets(max_num_seqs)
        device, rows = pool.device, self.buckets[-1]
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.zeros(rows, dtype=torch.long, device=device)
        self.tables = torch.full((rows, max_blocks), -1, dtype=torch.long, device=device)
        self.block_place = torch.zeros(pool.num_blocks, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # each graph's output
        if capture:
            self._capture()

    def takes(self, num_new: list[int], max_blocks_held: int) -> bool:
        """Whether a step replays: every sequence feeds one token, few enough of them."""
        return (
            len(num_new) <= self.buckets[-1]
            and all(n == 1 for n in num_new)
            and max_blocks_held <= self.tables.size(1)
        )

    @torch.inference_mode()
    def step(self, rows: int) -> torch.Tensor:
        """The decode step over the first `rows` static rows: (rows, vocab) logits."""
        cache = StaticDecodeCache(
            self.pool, self.slots[:rows], self.positions[:rows], self.tables[:rows],
            self.block_place,
        )  # fmt: skip
        return self.model(self.ids[None, :rows], cache=cache, validate=False).logits[0]

    def fill(self, tables: list[list[int]], positions: list[int], ids: list[int]) -> int:
        """Copy a step's rows into the static buffers, padded to their bucket (built on the
        host, copied in one go each); the bucket."""
        bucket = bucket_for(len(ids), self.buckets)
        pad = bucket - len(ids)
        width = self.tables.size(1)
        rows = [t + [-1] * (width - len(t)) for t in tables]
        rows += [[self.pad_block] + [-1] * (width - 1)] * pad
        host_tables = torch.tensor(rows, dtype=torch.long)
        host_positions = torch.tensor(positions + [0] * pad, dtype=torch.long)
        bs = self.pool.kv_block_size
        block = host_tables.gather(1, (host_positions // bs)[:, None])[:, 0]
        host_slots = block * bs + host_positions % bs
        for static, host in (
            (self.ids[:bucket], torch.tensor(ids + [0] * pad, dtype=torch.long)),
            (self.positions[:bucket], host_positions),
            (self.slots[:bucket], host_slots),
            (self.tables[:bucket], host_tables),
            (self.block_place, block_places(host_tables, self.pool.num_blocks)),
        ):
            static.copy_(host, non_blocking=True)
        return bucket

    def run(self, tables: list[list[int]], positions: list[int], ids: list[int]) -> torch.Tensor:
        """One decode step: each row feeds ids[i] at positions[i] with its block table;
        the (rows, vocab) logits. Replayed where a graph was captured, else run."""
        bucket = self.fill(tables, positions, ids)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            return self.logits[bucket][: len(ids)]
        return self.step(bucket)[: len(ids)]

    def _capture(self) -> None:
        """One graph per bucket, largest first, all in one memory pool: each after a
        warm-up run (which compiles FlexAttention for its shape) on padding rows only."""
        started = time.perf_counter()
        free_before, _ = torch.cuda.mem_get_info()
        memory = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            self.fill([[self.pad_block]] * bucket, [0] * bucket, [0] * bucket)
            self.step(bucket)  # warm-up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory):
                self.logits[bucket] = self.step(bucket)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        used = (free_before - torch.cuda.mem_get_info()[0]) / 2**20
        print(
            f"[rose] decode CUDA graphs captured for batch sizes {self.buckets} in "
            f"{time.perf_counter() - started:.1f} s, {used:,.0f} MiB (--enforce-eager: none)",
            file=sys.stderr,
        )
