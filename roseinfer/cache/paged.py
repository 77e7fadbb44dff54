"""The paged KV cache: one pool of fixed-size blocks per layer, read and written
through block tables.

`KVPool` is the memory: per layer, keys and values for num_blocks * kv_block_size token
slots, allocated once. Slot s is token s % kv_block_size of physical block s // kv_block_size.

`PagedKVCache` is one model call's view of the pool. It implements
`rosetrainer.model.KVCache` for many sequences at once, each at its own point: some
start a prompt, some continue one chunk by chunk, most add one decoded token. The
three invariants of a KV cache get their paged forms, each a named function looked up
at every call (so a chapter or test can swap in a buggy one):

* `paged_positions`: a sequence's new tokens take the positions after the ones it has
  computed (num_computed + arange), each sequence counting on its own;
* `slot_mapping`: the token at position p of a sequence is written to slot
  block_table[p // kv_block_size] * kv_block_size + p % kv_block_size;
* `paged_causal_mask`: a query sees the keys of its own sequence at positions up to
  its own (the bottom-right rule, per sequence), and nothing of any other sequence;
  with a sliding window only the last W of them and the sinks (`window_mask`).

A sliding-window model reads only its window's keys (and its sinks): the flat layout
gathers just those, so the engine may free the blocks behind a sequence's window.

Two layouts of the same call:

* "flat" (the readable reference): every new token of every sequence in one row of
  shape (1, total_new_tokens); attention reads every cached key of those sequences,
  and the mask keeps each query to its own sequence.
* "padded" (the decoding path): one row per sequence with one new token, shape
  (num_seqs, 1); each row reads its own blocks, padded to the longest table.
  Attention then costs each query only its own context, not everyone's. Its blocks
  are gathered anew every call; roseinfer.cache.slots keeps the rows instead (the
  engine's default), written one token a step and read where they lie.

`QuantizedKVPool` keeps full blocks in int8 or int4 (roseinfer.cache.quantized) and the blocks
still being written, or in a sequence's recent window, exact; `PagedKVCache` reads
either pool the same way.
"""

from __future__ import annotations

from typing import Protocol

import torch

from roseinfer.cache.quantized import BITS, CHANNEL_DIM, TIME_DIM, QuantizedStore
from rosetrainer import model as gpt
from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError
from rosetrainer.model import LayerPast


class BlockGeometry:
    """What every pool knows: how many blocks of how many tokens, and the model's window."""

    def __init__(self, config: GPTConfig, num_blocks: int, kv_block_size: int) -> None:
        self.num_blocks = num_blocks
        self.kv_block_size = kv_block_size
        self.n_head = config.n_head
        self.attention_window, self.attention_sinks = config.sliding_window, config.attention_sinks
        # one layer's keys (or values) of every block
        self.layer_shape = (num_blocks, config.n_head, kv_block_size, config.head_dim)


class KVPool(BlockGeometry):
    """Keys and values of every block, per layer: (num_blocks, n_head, kv_block_size, head_dim).

    Heads before tokens, as in the model's own (batch, n_head, time, head_dim): a
    sequence's blocks gathered in table order are then the keys attention reads, in one
    copy and already in the layout its matrix products want.
    """

    quantized = False

    def __init__(
        self,
        config: GPTConfig,
        num_blocks: int,
        kv_block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(config, num_blocks, kv_block_size)
        shape = self.layer_shape
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)


class QuantizedKVPool(BlockGeometry):
    """A pool whose blocks are stored in int8 or int4 (roseinfer.cache.quantized), the recent ones exact.

    Every block has quantized codes: keys per channel, one group per block (the
    kv_block_size tokens of a channel), values per token in groups of group_size channels.
    A full block never changes again, so it is quantized once, when it falls out of
    every running sequence's window. Until then it sits in the exact pool, in the
    model's dtype: a block being written (new keys and values always go there), a
    sequence's still-filling last block, and the blocks holding its latest `window`
    tokens (rounded out to whole blocks). `exact_slot[b]` is block b's place in the
    exact pool, or -1 when its codes are what it holds.

    Reads (`read_blocks`) dequantize the blocks asked for and lay the exact ones over them.
    """

    quantized = True

    def __init__(
        self,
        config: GPTConfig,
        num_blocks: int,
        kv_block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        kv_cache_dtype: str,
        window: int,
        group_size: int,
        num_exact_blocks: int,
    ) -> None:
        super().__init__(config, num_blocks, kv_block_size)
        self.dtype, self.window = dtype, window
        shape = self.layer_shape
        bits = BITS[kv_cache_dtype]
        self.k = [
            QuantizedStore(shape, bits, kv_block_size, TIME_DIM, device)
            for _ in range(config.n_layer)
        ]
        self.v = [
            QuantizedStore(shape, bits, group_size, CHANNEL_DIM, device)
            for _ in range(config.n_layer)
        ]
        exact_shape = (num_exact_blocks, config.n_head, kv_block_size, config.head_dim)
        self.exact_k = [torch.zeros(exact_shape, dtype=dtype, device=device) for _ in self.k]
        self.exact_v = [torch.zeros(exact_shape, dtype=dtype, device=device) for _ in self.k]
        self.exact_slot = torch.full((num_blocks,), -1, dtype=torch.long, device=device)
        self.free_exact = list(range(num_exact_blocks))

    @property
    def device(self) -> torch.device:
        return self.exact_slot.device

    @property
    def nbytes(self) -> int:
        stores = sum(store.nbytes for store in self.k + self.v)
        return stores + sum(t.nbytes for t in self.exact_k + self.exact_v)

    def exact_blocks(self) -> list[int]:
        return torch.nonzero(self.exact_slot >= 0).flatten().tolist()

    def make_exact(self, block_ids: list[int]) -> None:
        """Give these blocks a place in the exact pool (before a step writes to them),
        holding what their codes hold until the writes land."""
        new = [b for b in block_ids if self.exact_slot[b] < 0]
        if not new:
            return
        if len(new) > len(self.free_exact):
            raise RuntimeError(f"exact KV pool full: {len(new)} blocks asked for, sized too small")
        slots = [self.free_exact.pop() for _ in new]
        blocks = torch.tensor(new, device=self.device)
        places = torch.tensor(slots, device=self.device)
        for layer in range(len(self.k)):
            self.exact_k[layer][places] = self.k[layer].read_rows(blocks, self.dtype)
            self.exact_v[layer][places] = self.v[layer].read_rows(blocks, self.dtype)
        self.exact_slot[blocks] = places

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """New keys and values (tokens, n_head, head_dim) at pool slots `slots` (their
        blocks made exact first): into the exact pool."""
        exact = self.exact_slot[slots // self.kv_block_size] * self.kv_block_size
        exact = exact + slots % self.kv_block_size
        write_slots(self.exact_k[layer], exact, k)
        write_slots(self.exact_v[layer], exact, v)

    def read_blocks(self, layer: int, block_ids: torch.Tensor) -> LayerPast:
        """Keys and values of these blocks, (len, n_head, kv_block_size, head_dim) each."""
        keys = self.k[layer].read_rows(block_ids, self.dtype)
        values = self.v[layer].read_rows(block_ids, self.dtype)
        places = self.exact_slot[block_ids]
        exact = places >= 0
        keys[exact] = self.exact_k[layer][places[exact]]
        values[exact] = self.exact_v[layer][places[exact]]
        return keys, values

    def settle(self, tables: list[list[int]], num_tokens: list[int]) -> None:
        """After a step: quantize every exact block no running sequence keeps exact (each
        keeps the blocks of its latest `window` tokens and its filling block), and free
        its place in the exact pool. tables, num_tokens: the running sequences' blocks and
        how many tokens of each the pool holds."""
        keep: set[int] = set()
        for table, n in zip(tables, num_tokens, strict=True):
            first = max(0, n - self.window) // self.kv_block_size  # the window's first block
            keep.update(table[first : -(-n // self.kv_block_size)])
        drop = [b for b in self.exact_blocks() if b not in keep]
        if not drop:
            return
        blocks = torch.tensor(drop, device=self.device)
        places = self.exact_slot[blocks]
        for layer in range(len(self.k)):
            self.k[layer].write_rows(blocks, self.exact_k[layer][places])
            self.v[layer].write_rows(blocks, self.exact_v[layer][places])
        self.exact_slot[blocks] = -1
        self.free_exact += places.tolist()


class PoolSettings(Protocol):
    """What the pool takes from the engine's settings (roseinfer.engine.config.EngineConfig)."""

    kv_block_size: int
    kv_cache_dtype: str
    kv_cache_window: int
    kv_cache_group_size: int

    def exact_blocks(self) -> int: ...


def make_pool(
    config: GPTConfig,
    num_blocks: int,
    engine: PoolSettings,
    dtype: torch.dtype,
    device: torch.device,
) -> KVPool | QuantizedKVPool:
    """The engine's pool: plain for kv_cache_dtype "auto", else quantized."""
    if engine.kv_cache_dtype == "auto":
        return KVPool(config, num_blocks, engine.kv_block_size, dtype, device)
    return QuantizedKVPool(
        config,
        num_blocks,
        engine.kv_block_size,
        dtype,
        device,
        kv_cache_dtype=engine.kv_cache_dtype,
        window=engine.kv_cache_window,
        group_size=engine.kv_cache_group_size,
        num_exact_blocks=min(num_blocks, engine.exact_blocks()),
    )


def write_slots(blocks: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """Write one (n_head, head_dim) entry per token, `new` (tokens, n_head, head_dim), at
    pool slots `slots` (slot s: block s // kv_block_size, offset s % kv_block_size)."""
    kv_block_size = blocks.size(2)
    blocks[slots // kv_block_size, :, slots % kv_block_size] = new


def read_slots(blocks: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The entries at pool slots `slots`: (n_head, len(slots), head_dim)."""
    kv_block_size = blocks.size(2)
    return blocks[slots // kv_block_size, :, slots % kv_block_size].transpose(0, 1)


# ---------------------------------------------------------------------------
# The three invariants, paged
# ---------------------------------------------------------------------------


def paged_positions(num_computed: torch.Tensor, num_new: torch.Tensor) -> torch.Tensor:
    """Positions of the new tokens, sequence after sequence: each continues after its
    num_computed tokens (for sequence i: arange(num_computed[i], num_computed[i] + num_new[i]))."""
    seq_of_token = torch.repeat_interleave(torch.arange(len(num_new)), num_new)
    first_token = torch.cumsum(num_new, 0) - num_new  # where each sequence's tokens start
    index_in_seq = torch.arange(int(num_new.sum())) - first_token[seq_of_token]
    return num_computed[seq_of_token] + index_in_seq


def slot_mapping(
    block_tables: torch.Tensor,
    seq_of_token: torch.Tensor,
    positions: torch.Tensor,
    kv_block_size: int,
) -> torch.Tensor:
    """The pool slot of each token: its sequence's physical block for that position, and
    the offset inside the block. block_tables is (num_seqs, max_blocks)."""
    physical_block = block_tables[seq_of_token, positions // kv_block_size]
    return physical_block * kv_block_size + positions % kv_block_size


def paged_causal_mask(
    query_seq: torch.Tensor,
    query_pos: torch.Tensor,
    key_seq: torch.Tensor,
    key_pos: torch.Tensor,
    window: int | None = None,
    sinks: int = 0,
) -> torch.Tensor:
    """True where a query may look: a key of its own sequence, at a position <= its own
    (and inside its sliding window, or a sink, when the model has one).

    The arguments broadcast against each other (queries along one axis, keys along another).
    """
    return (key_seq == query_seq) & gpt.window_mask(query_pos, key_pos, window, sinks)


# ---------------------------------------------------------------------------
# One model call's view of the pool
# ---------------------------------------------------------------------------


def padded_tables(block_tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """(num_seqs, longest table) physical block ids; short tables are padded with block 0,
    whose slots the mask then hides."""
    longest = max(map(len, block_tables))
    # A block freed behind a sliding window is -1 in its table; its keys are never read.
    rows = [[max(b, 0) for b in table] + [0] * (longest - len(table)) for table in block_tables]
    return torch.tensor(rows, dtype=torch.long, device=device)


class PagedKVCache:
    """The KVCache of one model call over several sequences (see the module's docstring).

    block_tables, num_computed, num_new: per sequence, its blocks (enough for
    num_computed + num_new tokens), how many of its tokens the pool already holds, and
    how many new tokens this call feeds.
    """

    def __init__(
        self,
        pool: KVPool,
        block_tables: list[list[int]],
        num_computed: list[int],
        num_new: list[int],
        layout: str = "flat",
    ) -> None:
        if layout not in ("flat", "padded"):
            raise RoseError(f"layout must be 'flat' or 'padded', got {layout!r}")
        if layout == "padded" and any(n != 1 for n in num_new):
            raise RoseError("the padded layout feeds one new token per sequence")
        self.pool = pool
        self.layout = layout
        self.kv_block_size = pool.kv_block_size
        self.tables = padded_tables(block_tables, pool.device)
        self.num_computed = torch.tensor(num_computed, dtype=torch.long)
        self.num_new = torch.tensor(num_new, dtype=torch.long)
        self.written_slots = torch.zeros(0, dtype=torch.long)
        self.key_slots: torch.Tensor | None = None

    # -- what the model asks of a cache (rosetrainer.model.KVCache) --

    def prepare(
        self, batch: int, q_len: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_seqs, total_new = len(self.num_new), int(self.num_new.sum())
        expected = (1, total_new) if self.layout == "flat" else (num_seqs, 1)
        if (batch, q_len) != expected:
            raise RoseError(
                f"this paged cache was built for ids of shape {expected}, got {(batch, q_len)}"
            )
        positions = paged_positions(self.num_computed, self.num_new).to(device)
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), self.num_new).to(device)
        self.written_slots = slot_mapping(self.tables, seq_of_token, positions, self.kv_block_size)
        if self.pool.quantized:  # the blocks written in this call take their exact places now
            self.pool.make_exact(torch.unique(self.written_slots // self.kv_block_size).tolist())
        window, sinks = self.pool.attention_window, self.pool.attention_sinks
        if self.layout == "flat":
            key_seq, key_pos = self._keys_read(device)
            self.key_slots = slot_mapping(self.tables, key_seq, key_pos, self.kv_block_size)
            mask = paged_causal_mask(
                seq_of_token[:, None], positions[:, None], key_seq[None, :], key_pos[None, :],
                window, sinks,
            )  # fmt: skip
            return positions[None, :], mask[None, None, :, :]
        # Padded: row i reads all of its blocks; key j of a row stands at position j.
        key_pos = torch.arange(self.key_width(), device=device)
        rows = torch.arange(num_seqs, device=device)
        mask = paged_causal_mask(
            rows[:, None], positions[:, None], rows[:, None], key_pos[None, :], window, sinks
        )
        return positions[:, None], mask[:, None, None, :]

    def key_width(self) -> int:
        """The keys each row of the padded layout reads: its blocks, padded to the longest table."""
        return self.tables.size(1) * self.kv_block_size

    def _keys_read(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence, position) of every key the new tokens may read, one sequence after
        another: positions 0 .. num_computed + num_new - 1, or with a sliding window
        only the sinks and the positions from the first new token's window on."""
        context = self.num_computed + self.num_new
        sinks = context.clamp(max=self.pool.attention_sinks)
        first = torch.zeros_like(context)
        if self.pool.attention_window is not None:
            first = (self.num_computed - self.pool.attention_window + 1).clamp(min=sinks)
        seqs = torch.arange(len(context))
        key_seq = torch.cat(
            [seqs.repeat_interleave(sinks), seqs.repeat_interleave(context - first)]
        )
        key_pos = torch.cat(
            [
                paged_positions(torch.zeros_like(sinks), sinks),
                paged_positions(first, context - first),
            ]
        )
        return key_seq.to(device), key_pos.to(device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> LayerPast:
        if self.pool.quantized:
            return self._update_quantized(layer, k, v)
        self.write(layer, k, v)
        k_blocks, v_blocks = self.pool.k[layer], self.pool.v[layer]
        if self.layout == "flat":  # every key of the step's sequences: (1, n_head, keys, head_dim)
            return read_slots(k_blocks, self.key_slots)[None], read_slots(v_blocks, self.key_slots)[
                None
            ]
        return self._read_blocks(k_blocks), self._read_blocks(v_blocks)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep this layer's new keys and values (rows, n_head, q_len, head_dim) in the pool:
        one (n_head, head_dim) entry per new token, in the order of written_slots
        (sequence by sequence, position by position)."""
        rows, n_head, q_len, head_dim = k.shape
        entries = (-1, n_head, head_dim)
        write_slots(self.pool.k[layer], self.written_slots, k.transpose(1, 2).reshape(entries))
        write_slots(self.pool.v[layer], self.written_slots, v.transpose(1, 2).reshape(entries))

    def _update_quantized(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> LayerPast:
        """update() on a QuantizedKVPool: write to the exact pool, read the step's blocks
        dequantized (the exact ones as they are), then pick slots as the plain path does."""
        rows, n_head, q_len, head_dim = k.shape
        entries = (-1, n_head, head_dim)
        self.pool.write(
            layer,
            self.written_slots,
            k.transpose(1, 2).reshape(entries),
            v.transpose(1, 2).reshape(entries),
        )
        if self.layout == "flat":
            # Only the blocks the step reads, numbered 0.. in a local copy.
            blocks, local = torch.unique(self.key_slots // self.kv_block_size, return_inverse=True)
            k_blocks, v_blocks = self.pool.read_blocks(layer, blocks)
            slots = local * self.kv_block_size + self.key_slots % self.kv_block_size
            return read_slots(k_blocks, slots)[None], read_slots(v_blocks, slots)[None]
        # Each row's blocks in table order, then (rows, n_head, max_blocks * kv_block_size, head_dim).
        rows, max_blocks = self.tables.shape
        k_blocks, v_blocks = self.pool.read_blocks(layer, self.tables.flatten())
        by_row = (rows, max_blocks, n_head, self.kv_block_size, head_dim)
        keys = k_blocks.view(by_row).transpose(1, 2).reshape(rows, n_head, -1, head_dim)
        values = v_blocks.view(by_row).transpose(1, 2).reshape(rows, n_head, -1, head_dim)
        return keys, values

    def _read_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """Each row's blocks, whole and in table order: (rows, n_head, max_blocks * kv_block_size,
        head_dim), gathered in one copy (row r, head h, table entry i: blocks[tables[r, i], h])."""
        rows, max_blocks = self.tables.shape
        heads = torch.arange(blocks.size(1), device=blocks.device)
        gathered = blocks[self.tables[:, None, :], heads[None, :, None]]  # (rows, h, blocks, bs, d)
        return gathered.view(rows, blocks.size(1), max_blocks * self.kv_block_size, blocks.size(-1))
