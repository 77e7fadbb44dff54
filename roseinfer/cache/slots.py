"""Decode slots: each decoding sequence's keys and values kept contiguous, in a row of
its own, so a decode step's attention reads them where they lie.

Without them the paged cache (roseinfer.cache.paged) gathers every decoding sequence's
blocks into a new tensor, in every layer, every step: the whole context copied to read
it once. Here the pool stays the memory of record (every new key and
value is written there as before, so prefix caching, preemption and the pool's
invariants are unchanged), and beside it `DecodeSlots` keeps, per layer, a key buffer
of shape (rows, n_head, capacity, head_dim): row r holds one decoding sequence's keys at
positions 0 .. held - 1. A step writes each sequence's one new key at its position and
attention reads rows 0 .. n - 1 as a view: no gather, nothing allocated per layer.

Attention reads each row whole, all of its capacity (positions past a sequence's
length are zeros, and the mask hides them): rows 0 .. n - 1 are then one contiguous
block, which the batched products read in place. A view cut to the step's width is
not: its rows are strided, and in bfloat16 oneDNN's batched product copies every
layer's slice before it multiplies. So the capacity
is kept close to the longest context (see `tight`).

In float32 the values are stored transposed, (rows, n_head, head_dim, capacity), and
handed to attention as a transposed view: the softmax weights times the values is then
one matrix-vector product per sequence and head with the matrix's rows contiguous, the
form CPU BLAS runs near memory speed (over values laid out like the keys it runs as
many one-row products). In bfloat16 the values are laid out like the keys, the form
oneDNN's bfloat16 product is fastest on. `DecodeSlots.attend` writes the step's new keys
and values and computes the rows' attention in the form their layout wants
(`slot_attention`). What each choice saved was measured (docs/benchmarks.md, "Figures
behind the code"; `python -m benchmarks.kernel_choices` repeats it).

A sequence gets a row the first step it decodes (its context copied from the pool
once) and keeps it while it decodes step after step; a sequence that was not in a
step's decode batch loses its row (a kept row from further down moves into its place,
so the rows in use stay 0 .. n - 1, and the batch's row i is buffer row i).

The price is memory: the rows hold a second copy of the decoding sequences' keys and
values, padded to the longest of them. So the buffers are sized to the step, not to
the model's whole window times every sequence: capacity in steps of CAPACITY_STEP
tokens, within two steps of the longest context; rows in steps of ROW_STEP and at
least doubled when they grow (a batch that ramps up to 64 sequences copies its rows a
few times, not eight), cut when they hold over three times what the step needs. Only
the rows in use are written, so rows allocated ahead take no memory from the OS until
a sequence fills one. `nbytes` is what they hold allocated; the engine reports it
beside the pool's, and keeps it under a budget (`fits`).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from roseinfer.cache.paged import KVPool
from rosetrainer import model as gpt
from rosetrainer.config import GPTConfig

ROW_STEP = 8  # rows are allocated in multiples of this
CAPACITY_STEP = 64  # token capacity in multiples of this (and of kv_block_size)
# The dtypes whose values are stored transposed (see the module's docstring).
TRANSPOSED_VALUES = (torch.float32,)


class DecodingSequence(Protocol):
    """What the slots read of a sequence (the engine's EngineSequence has it)."""

    block_table: list[int]
    num_computed_tokens: int


class DecodeSlots:
    def __init__(self, config: GPTConfig, max_rows: int, pool: KVPool, budget: int) -> None:
        self.pool = pool
        self.max_rows = max_rows
        self.budget = budget  # bytes the buffers may take at most (see fits)
        # one token's keys and values, every layer
        self.token_bytes = sum(t[0, :, 0].nbytes for t in pool.k + pool.v)
        bs = pool.kv_block_size
        self.row_step = ROW_STEP
        self.capacity_step = -(-CAPACITY_STEP // bs) * bs  # whole blocks
        # A full context, in whole blocks (a windowed model's rows never hold more).
        self.max_capacity = -(-config.block_size // bs) * bs
        self.n_head, self.head_dim = config.n_head, config.head_dim
        # the values' layout for attention's last product (see the module's docstring)
        self.values_transposed = pool.k[0].dtype in TRANSPOSED_VALUES
        self.k, self.v = self._new_buffers(0, 0)  # per layer
        self.owners: list[DecodingSequence] = []  # row r's sequence
        self.held: list[int] = []  # how many of its tokens row r holds

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    def arrange(self, seqs: list[DecodingSequence]) -> list[int]:
        """Give this step's decoding sequences rows 0 .. len(seqs) - 1 (rows of sequences
        not decoding now are given up); return each sequence's row."""
        decoding = {id(seq) for seq in seqs}
        self._keep(
            [
                row
                for row, seq in enumerate(self.owners)
                if id(seq) in decoding and self.held[row] == seq.num_computed_tokens
            ]
        )
        width = max((len(seq.block_table) for seq in seqs), default=0) * self.pool.kv_block_size
        self._fit(len(seqs), width)
        has_row = {id(seq) for seq in self.owners}
        for seq in seqs:
            if id(seq) not in has_row:
                self._fill(seq)
        rows = {id(seq): row for row, seq in enumerate(self.owners)}
        return [rows[id(seq)] for seq in seqs]

    def fits(self, seqs: list[DecodingSequence]) -> bool:
        """Whether rows for these decoding sequences, and no more, stay within the budget."""
        width = max(len(seq.block_table) for seq in seqs) * self.pool.kv_block_size
        return self._bytes(*self._dims(len(seqs), width, grow=False)) <= self.budget

    def clear(self) -> None:
        """Give every row up, and the buffers' memory with them."""
        self.owners, self.held = [], []
        self.k, self.v = self._new_buffers(0, 0)

    @property
    def capacity(self) -> int:
        """The tokens a row holds room for: every row's keys as attention reads them."""
        return self.k[0].size(2)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Write the new key and value of rows 0 .. n - 1 ((n, n_head, 1, head_dim), in row
        order) at their positions; return each row's query (q, the same shape) attended over
        its row, whole (mask: (n, 1, 1, capacity), True where the row's query may look)."""
        n = k.size(0)
        rows = torch.arange(n, device=k.device)
        self.k[layer][rows, :, positions] = k[:, :, 0]
        if self.values_transposed:
            self.v[layer][rows, :, :, positions] = v[:, :, 0]
        else:
            self.v[layer][rows, :, positions] = v[:, :, 0]
        return slot_attention(q, self.k[layer][:n], self.v[layer][:n], mask, self.values_transposed)

    def advance(self) -> None:
        """After a decode step: every row holds one more token."""
        self.held = [n + 1 for n in self.held]

    def _keep(self, kept: list[int]) -> None:
        """Keep only these rows (ascending), as rows 0 .. len(kept) - 1: each hole below
        that is filled by a kept row from above it (one row copied per hole)."""
        n, staying = len(kept), set(kept)
        holes = [row for row in range(n) if row not in staying]
        movers = [row for row in kept if row >= n]
        for hole, row in zip(holes, movers, strict=True):
            held = self.held[row]
            for buffer in self._by_token():
                buffer[hole, :, :held] = buffer[row, :, :held]
            self.owners[hole], self.held[hole] = self.owners[row], held
        del self.owners[n:], self.held[n:]

    def _fit(self, rows: int, width: int) -> None:
        """Buffers that hold `rows` rows of `width` tokens: reallocated when too small, or
        over three times too large. Only the rows in use are copied over (their tails
        zeroed where the capacity grew); the others are left unwritten, so the memory
        behind them is only taken when a sequence fills one (`_fill`)."""
        old_rows, _, old_capacity, _ = self.k[0].shape
        new_rows, capacity = self._dims(rows, width, grow=True)
        if self._bytes(new_rows, capacity) > self.budget:  # (the runner checked `fits`)
            new_rows, capacity = self._dims(rows, width, grow=False)
        if (new_rows, capacity) == (old_rows, old_capacity):
            return
        kept, copied = len(self.owners), min(old_capacity, capacity)
        olds = self._by_token()
        self.k, self.v = self._new_buffers(new_rows, capacity)
        for new, old in zip(self._by_token(), olds, strict=True):
            new[:kept, :, :copied] = old[:kept, :, :copied]
            new[:kept, :, copied:] = 0

    def _new_buffers(
        self, rows: int, capacity: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Unwritten buffers for `rows` rows of `capacity` tokens, one per layer: keys
        (rows, n_head, capacity, head_dim), values the same or, stored transposed,
        (rows, n_head, head_dim, capacity)."""
        pool_layer = self.pool.k[0]
        by_token = (rows, self.n_head, capacity, self.head_dim)
        keys = [pool_layer.new_empty(by_token) for _ in self.pool.k]
        stored = (
            (rows, self.n_head, self.head_dim, capacity) if self.values_transposed else by_token
        )
        values = [pool_layer.new_empty(stored) for _ in self.pool.v]
        return keys, values

    def _by_token(self) -> list[torch.Tensor]:
        """Every layer's key buffer, then every layer's value buffer, each seen as (rows,
        n_head, capacity, head_dim) (values stored transposed through a transposed view):
        what writes and copies index, whatever the layout."""
        if not self.values_transposed:
            return self.k + self.v
        return self.k + [values.transpose(-2, -1) for values in self.v]

    def _dims(self, rows: int, width: int, grow: bool) -> tuple[int, int]:
        """(rows, capacity) of buffers for `rows` rows of `width` tokens, from the present
        ones; with grow, rows grow to at least twice what they were (see `fitted`)."""
        old_rows, _, old_capacity, _ = self.k[0].shape
        return (
            fitted(old_rows, rows, self.row_step, self.max_rows, double=grow),
            tight(old_capacity, width, self.capacity_step, self.max_capacity),
        )

    def _bytes(self, rows: int, capacity: int) -> int:
        return rows * capacity * self.token_bytes

    def _fill(self, seq: DecodingSequence) -> None:
        """A new row for seq: its num_computed_tokens keys and values, copied from the
        pool once (the rest of the row zeroed)."""
        row, held, bs = len(self.owners), seq.num_computed_tokens, self.pool.kv_block_size
        blocks = seq.block_table[: -(-held // bs)]
        blocks = torch.tensor(blocks, dtype=torch.long, device=self.pool.device)
        for pool_layer, buffer in zip(self.pool.k + self.pool.v, self._by_token(), strict=True):
            # (blocks, n_head, bs, head_dim) -> (n_head, blocks * bs, head_dim)
            context = pool_layer[blocks].transpose(0, 1).flatten(1, 2)
            buffer[row, :, :held] = context[:, :held]
            # Never-written memory may hold anything, even NaN, and attention
            # multiplies the masked keys' values by zero: zeros instead.
            buffer[row, :, held:] = 0
        self.owners.append(seq)
        self.held.append(held)


def fitted(size: int, needed: int, step: int, most: int, double: bool) -> int:
    """A buffer dimension for `needed`, in multiples of `step` (at most `most`, unless
    more is needed). Kept while it holds the need and is at most three times it, else
    cut or grown to the need; with `double`, grown to at least twice its size, so that
    a batch ramping up copies its rows a few times rather than at every `step`."""
    if needed <= size <= 3 * max(needed, step):
        return size
    target = max(needed, 2 * size) if double and needed > size else needed
    return max(needed, min(most, -(-target // step) * step))


def tight(size: int, needed: int, step: int, most: int) -> int:
    """A row's capacity for a longest context of `needed` tokens: kept while it holds
    the need with less than two `step`s to spare (attention reads all of it), else the
    need in multiples of `step` (at most `most`, unless more is needed). The spare step
    keeps a context that ends just past a multiple from reallocating back and forth."""
    if needed <= size < needed + 2 * step:
        return size
    return max(needed, min(most, -(-needed // step) * step))


def slot_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    values_transposed: bool,
) -> torch.Tensor:
    """`rosetrainer.model.one_query_attention` over the slots' rows: the same math, its
    last product in the form the values' layout wants. Stored transposed ((rows, n_head,
    head_dim, capacity)), the weighted sum of the values is written matrix first, values @
    weights^T, the form BLAS runs near memory speed with the matrix's rows contiguous."""
    if not values_transposed:
        return gpt.one_query_attention(q, k, v, mask)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return (v @ weights.transpose(-2, -1)).transpose(-2, -1)
