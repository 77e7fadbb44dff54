"""The paged KV cache: one pool of fixed-size blocks per layer, read and written
through block tables.

`KVPool` is the memory: per layer, keys and values for num_blocks * kv_block_size token
slots, allocated once. Slot s is token s % kv_block_size of physical block s // kv_block_size.

`PagedKVCache` is one model call's view of the pool, for many sequences at once, each
at its own point: some start a prompt, some continue one chunk by chunk, most add one
decoded token. The three invariants of a KV cache get their paged forms, each a named function looked up
at every call (so a chapter or test can swap in a buggy one):

* `paged_positions`: a sequence's new tokens take the positions after the ones it has
  computed (num_computed + arange), each sequence counting on its own;
* `slot_mapping`: the token at position p of a sequence is written to slot
  block_table[p // kv_block_size] * kv_block_size + p % kv_block_size;
* `paged_causal_mask`: a query sees the keys of its own sequence at positions up to
  its own (the bottom-right rule, per sequence), and nothing of any other sequence;
  with a sliding window only the last W of them and the sinks (`window_mask`). (Each
  sequence attends over its own keys alone here, so the "own sequence" part only ever
  compares a sequence with itself; chapter 11 draws the mask of many sequences side by
  side.)

A sliding-window model reads only its window's keys (and its sinks), so the engine may
free the blocks behind a sequence's window.

One engine step is one model call (`PagedKVCache`): every new token of every scheduled
sequence in one flat row, (1, total_new_tokens), sequence after sequence, so every
product with the weights runs once over the step's rows. Attention is the cache's own
step (`rosetrainer.model.AttendingKVCache`): each sequence's queries attend to its own
keys, read from the pool, never to another sequence's tokens. The sequences that feed
one token (decoding) come first and attend together, one query per row, each over its
own blocks: read where they lie by a compiled kernel on a CPU (roseinfer.cache.kernels:
no copy of any key or value, the engine's default), or gathered in table order, padded
to the longest, the padding masked (one copy a step, in PyTorch: anywhere else, or
asked for). Each prompt or verify chunk then attends alone over its own keys under the
bottom-right causal mask. (The readable version that lays every
sequence's keys side by side under one mask that keeps each query to its own sequence
is chapter 11's, `FlatPagedKVCache` below: the teaching version, and the tests' reference,
never an engine setting.)

`QuantizedKVPool` keeps full blocks in int8 or int4 (roseinfer.cache.quantized) and the blocks
still being written, or in a sequence's recent window, exact; `PagedKVCache` reads
either pool the same way.
"""

from __future__ import annotations

from typing import Protocol

import torch

from roseinfer.cache import kernels
from roseinfer.cache.flex import FlexStep, block_places, table_tensor
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
        self.attention_window, self.attention_sinks = config.sliding_window, config.attention_sinks
        # one layer's keys (or values) of every block, key/value heads only
        self.layer_shape = (num_blocks, config.kv_heads, kv_block_size, config.head_dim)


class KVPool(BlockGeometry):
    """Keys and values of every block, per layer: (num_blocks, n_kv_head, kv_block_size,
    head_dim) (a grouped model's key/value heads: its bytes per token shrink by the group).

    Heads before tokens, as in the model's own (batch, n_kv_head, time, head_dim): a
    sequence's blocks gathered in table order are then the keys attention reads, in one
    copy and already in the layout its matrix products want. heads_major: the same view
    of a layer stored heads first, (n_head, num_blocks, ...), so that the whole layer is
    one key axis for FlexAttention (roseinfer.cache.flex) without a copy.
    """

    quantized = False

    def __init__(
        self,
        config: GPTConfig,
        num_blocks: int,
        kv_block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        heads_major: bool = False,
    ) -> None:
        super().__init__(config, num_blocks, kv_block_size)
        shape = self.layer_shape
        if heads_major:  # stored (n_head, num_blocks, ...), seen as layer_shape
            stored = (shape[1], shape[0], *shape[2:])
            self.k = [torch.zeros(stored, dtype=dtype, device=device).transpose(0, 1)
                      for _ in range(config.n_layer)]  # fmt: skip
            self.v = [torch.zeros(stored, dtype=dtype, device=device).transpose(0, 1)
                      for _ in range(config.n_layer)]  # fmt: skip
        else:
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    def before_write(self, slots: torch.Tensor) -> None:
        """A step is about to write these slots (nothing to do here: every block is exact)."""

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """New keys and values (tokens, n_head, head_dim) at pool slots `slots`."""
        write_slots(self.k[layer], slots, k)
        write_slots(self.v[layer], slots, v)

    def read_slots(self, layer: int, slots: torch.Tensor) -> LayerPast:
        """Keys and values at pool slots `slots`, (n_head, len(slots), head_dim) each."""
        return read_slots(self.k[layer], slots), read_slots(self.v[layer], slots)

    def read_tables(self, layer: int, tables: torch.Tensor) -> LayerPast:
        """Each row's blocks, whole and in table order: (rows, n_head, blocks * kv_block_size,
        head_dim) each, gathered in one copy (row r, head h, entry i: blocks[tables[r, i], h])."""
        return gather_tables(self.k[layer], tables), gather_tables(self.v[layer], tables)


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
        exact_shape = (num_exact_blocks, config.kv_heads, kv_block_size, config.head_dim)
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

    def before_write(self, slots: torch.Tensor) -> None:
        """A step is about to write these slots: their blocks take their exact places now."""
        self.make_exact(torch.unique(slots // self.kv_block_size).tolist())

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

    def read_slots(self, layer: int, slots: torch.Tensor) -> LayerPast:
        """Keys and values at pool slots `slots`, (n_head, len(slots), head_dim) each: only
        the blocks they lie in are read (dequantized), numbered 0.. in a local copy."""
        blocks, local = torch.unique(slots // self.kv_block_size, return_inverse=True)
        k_blocks, v_blocks = self.read_blocks(layer, blocks)
        local_slots = local * self.kv_block_size + slots % self.kv_block_size
        return read_slots(k_blocks, local_slots), read_slots(v_blocks, local_slots)

    def read_tables(self, layer: int, tables: torch.Tensor) -> LayerPast:
        """Each row's blocks in table order (see KVPool.read_tables), dequantized."""
        rows, max_blocks = tables.shape
        k_blocks, v_blocks = self.read_blocks(layer, tables.flatten())
        _, n_head, kv_block_size, head_dim = k_blocks.shape
        by_row = (rows, max_blocks, n_head, kv_block_size, head_dim)
        keys = k_blocks.view(by_row).transpose(1, 2).reshape(rows, n_head, -1, head_dim)
        values = v_blocks.view(by_row).transpose(1, 2).reshape(rows, n_head, -1, head_dim)
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

    def attention_on(self, device: torch.device) -> str: ...


def make_pool(
    config: GPTConfig,
    num_blocks: int,
    engine: PoolSettings,
    dtype: torch.dtype,
    device: torch.device,
) -> KVPool | QuantizedKVPool:
    """The engine's pool: plain for kv_cache_dtype "auto" (stored heads first where
    FlexAttention reads it), else quantized."""
    if engine.kv_cache_dtype == "auto":
        flex = engine.attention_on(device) == "flex"
        return KVPool(config, num_blocks, engine.kv_block_size, dtype, device, flex)
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


def gather_tables(blocks: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Each row's blocks of one layer, whole and in table order: (rows, n_head,
    max_blocks * kv_block_size, head_dim), gathered in one copy."""
    rows, max_blocks = tables.shape
    _, n_head, kv_block_size, head_dim = blocks.shape
    heads = torch.arange(n_head, device=blocks.device)
    gathered = blocks[tables[:, None, :], heads[None, :, None]]  # (rows, h, blocks, bs, d)
    return gathered.view(rows, n_head, max_blocks * kv_block_size, head_dim)


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
    rows = [table + [0] * (longest - len(table)) for table in block_tables]
    # A block freed behind a sliding window is -1 in its table; its keys are never read.
    # (Clamped as a tensor: a Python loop over every entry would cost a step far more.)
    return torch.tensor(rows, dtype=torch.long, device=device).clamp_(min=0)


class PagedKVCache:
    """One engine step's view of the pool, a `rosetrainer.model.AttendingKVCache` (see the
    module's docstring): the step's new tokens in one flat row, sequence after sequence.

    block_tables, num_computed, num_new: per sequence, its blocks (enough for
    num_computed + num_new tokens), how many of its tokens the pool already holds, and
    how many new tokens this call feeds. The leading sequences that feed one token each
    attend together as a decode batch: with in_place, through the compiled kernel reading
    their blocks where they lie (the caller checked `kernels.runs_on(pool)`), else over
    their blocks gathered. With flex, the decode rows and the chunks each attend in one
    FlexAttention call reading the pool in place (roseinfer.cache.flex: a plain pool
    stored heads first).
    """

    def __init__(
        self,
        pool: KVPool | QuantizedKVPool,
        block_tables: list[list[int]],
        num_computed: list[int],
        num_new: list[int],
        in_place: bool = False,
        flex: bool = False,
    ) -> None:
        self.pool = pool
        self.kv_block_size = pool.kv_block_size
        self.block_tables = block_tables if flex else None
        self.tables = padded_tables(block_tables, pool.device)
        self.num_computed = torch.tensor(num_computed, dtype=torch.long)
        self.num_new = torch.tensor(num_new, dtype=torch.long)
        # the decode batch: the leading sequences that feed one token each
        self.num_decode = next((i for i, n in enumerate(num_new) if n != 1), len(num_new))
        self.in_place = in_place
        self.written_slots = torch.zeros(0, dtype=torch.long)

    # -- what the model asks of it (rosetrainer.model.AttendingKVCache) --

    def prepare(self, batch: int, q_len: int, device: torch.device) -> tuple[torch.Tensor, None]:
        """Positions of the new tokens, (1, total_new); where each is written (written_slots);
        and, per sequence, which keys its queries read and may see."""
        num_seqs, total_new = len(self.num_new), int(self.num_new.sum())
        if (batch, q_len) != (1, total_new):
            raise RoseError(
                f"this paged cache was built for ids of shape {(1, total_new)}, got {(batch, q_len)}"
            )
        positions = paged_positions(self.num_computed, self.num_new).to(device)
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), self.num_new).to(device)
        self.written_slots = slot_mapping(self.tables, seq_of_token, positions, self.kv_block_size)
        self.pool.before_write(self.written_slots)
        if self.block_tables is not None:  # FlexAttention reads for the whole step
            pool, tables = self.pool, table_tensor(self.block_tables, device)
            self.flex = FlexStep(
                tables, block_places(tables, pool.num_blocks), positions,
                self.num_new.tolist(), self.num_decode, self.kv_block_size,
                pool.attention_window, pool.attention_sinks,
            )  # fmt: skip
            return positions[None, :], None
        self.flex = None
        self.decode_positions = positions[: self.num_decode]
        gathered = self.num_decode and not self.in_place
        self.decode_mask = self._decode_mask(device) if gathered else None
        self.chunks = self._chunks(seq_of_token, positions, device)
        return positions[None, :], None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Keep this layer's new keys and values (1, n_head, total_new, head_dim) in the
        pool, then each sequence's queries over its own keys: the outputs, shaped like q."""
        new_k, new_v = k[0].transpose(0, 1), v[0].transpose(0, 1)  # (total_new, *entries)
        self.pool.write(layer, self.written_slots, new_k, new_v)
        if self.flex is not None:
            return self.flex.attend(q, self.pool.k[layer], self.pool.v[layer])
        outputs = []
        n = self.num_decode
        if n:  # one query per row: (n, n_head, head_dim)
            y = self._decode_attention(layer, q[0, :, :n].transpose(0, 1))
            outputs.append(y.transpose(0, 1)[None])
        for start, end, key_slots, mask in self.chunks:
            if key_slots is None:  # a whole prompt: its keys are the ones it just made
                keys, values = k[:, :, start:end], v[:, :, start:end]
            else:
                keys, values = (t[None] for t in self.pool.read_slots(layer, key_slots))
            outputs.append(gpt.attention(q[:, :, start:end], keys, values, mask))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)

    # -- the decode batch: one query per row, each over its own keys --

    def _decode_mask(self, device: torch.device) -> torch.Tensor:
        """For the gathered decode rows: (rows, 1, 1, blocks * kv_block_size), row i sees
        key j (at position j) of its own keys up to its position, inside its window or a
        sink (its table's padding and the blocks freed behind a window never)."""
        window, sinks = self.pool.attention_window, self.pool.attention_sinks
        key_pos = torch.arange(self.tables.size(1) * self.kv_block_size, device=device)
        rows = torch.arange(self.num_decode, device=device)
        positions = self.decode_positions
        mask = paged_causal_mask(
            rows[:, None], positions[:, None], rows[:, None], key_pos[None, :], window, sinks
        )
        return mask[:, None, None, :]

    def _decode_attention(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The decode rows' attention: q (rows, n_head, head_dim) -> the same shape."""
        tables, pool = self.tables[: self.num_decode], self.pool
        if self.in_place:  # every row's blocks read where they lie, nothing copied
            lens = self.decode_positions + 1  # (each query sees up to its own position)
            window, sinks = pool.attention_window, pool.attention_sinks
            return kernels.paged_decode_attention(
                q, pool.k[layer], pool.v[layer], tables, lens, window, sinks
            )
        keys, values = pool.read_tables(layer, tables)  # (rows, n_head, width, head_dim)
        return gpt.one_query_attention(q[:, :, None], keys, values, self.decode_mask)[:, :, 0]

    # -- the chunks: each sequence that feeds several tokens, alone over its own keys --

    def _chunks(
        self, seq_of_token: torch.Tensor, positions: torch.Tensor, device: torch.device
    ) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """Per chunk: its tokens' range in the row, the pool slots of the keys it reads (in
        position order) and its mask, (q_len, keys): the bottom-right causal rule (cut to
        the window and its sinks). A whole prompt in one chunk (no window) reads only the
        keys it makes in this call: no slots and no mask (None, None), the plain causal
        rule of the uncached model, with nothing read back from the pool."""
        window, sinks = self.pool.attention_window, self.pool.attention_sinks
        ends = torch.cumsum(self.num_new, 0).tolist()
        chunks = []
        for i in range(self.num_decode, len(ends)):
            start, end = ends[i] - int(self.num_new[i]), ends[i]
            if self.num_computed[i] == 0 and window is None:
                chunks.append((start, end, None, None))
                continue
            key_pos = self._keys_read(i, device)
            key_seq = torch.full_like(key_pos, i)
            key_slots = slot_mapping(self.tables, key_seq, key_pos, self.kv_block_size)
            mask = paged_causal_mask(
                seq_of_token[start:end, None], positions[start:end, None],
                key_seq[None, :], key_pos[None, :], window, sinks,
            )  # fmt: skip
            chunks.append((start, end, key_slots, mask))
        return chunks

    def _keys_read(self, i: int, device: torch.device) -> torch.Tensor:
        pool = self.pool
        computed, new = int(self.num_computed[i]), int(self.num_new[i])
        return keys_read(computed, new, pool.attention_window, pool.attention_sinks, device)


def keys_read(
    num_computed: int, num_new: int, window: int | None, sinks: int, device: torch.device
) -> torch.Tensor:
    """Positions of the keys a sequence's num_new new tokens may read: 0 .. num_computed +
    num_new - 1, or with a sliding window only the sinks and the positions from the first
    new token's window on."""
    context = num_computed + num_new
    sinks = min(context, sinks)
    first = 0 if window is None else max(num_computed - window + 1, sinks)
    return torch.cat([torch.arange(sinks), torch.arange(first, context)]).to(device)


class FlatPagedKVCache:
    """The readable paged cache (chapter 11; the tests' reference): gather, then attend.

    A plain `rosetrainer.model.KVCache` over the same call as `PagedKVCache` (the same
    arguments, so a chapter or test can swap it in for the engine's): the step's new
    tokens in one flat row; `update` writes them to the pool and hands back every key the
    step's sequences hold, side by side, and the mask of `prepare` keeps each query to its
    own sequence's keys (`paged_causal_mask`: lower triangles on a diagonal). The model
    then runs one attention over all of them: each query pays for every sequence's keys,
    and a mask that forgot whose key is whose would mix sequences, the mistakes the
    engine's own step (each sequence over its own keys) cannot make.
    """

    def __init__(
        self,
        pool: KVPool | QuantizedKVPool,
        block_tables: list[list[int]],
        num_computed: list[int],
        num_new: list[int],
        in_place: bool = False,  # (not read: the flat row attends in the model, over gathered keys)
        flex: bool = False,  # (nor this)
    ) -> None:
        self.pool = pool
        self.kv_block_size = pool.kv_block_size
        self.tables = padded_tables(block_tables, pool.device)
        self.num_computed, self.num_new = num_computed, num_new
        self.written_slots = torch.zeros(0, dtype=torch.long)

    def prepare(
        self, batch: int, q_len: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_new = torch.tensor(self.num_new)
        if (batch, q_len) != (1, int(num_new.sum())):
            raise RoseError(
                f"this paged cache was built for ids of shape {(1, int(num_new.sum()))}"
            )
        positions = paged_positions(torch.tensor(self.num_computed), num_new).to(device)
        seq_of_token = torch.repeat_interleave(torch.arange(len(num_new)), num_new).to(device)
        self.written_slots = slot_mapping(self.tables, seq_of_token, positions, self.kv_block_size)
        self.pool.before_write(self.written_slots)
        # Every key the step's sequences may read, one sequence after another.
        window, sinks = self.pool.attention_window, self.pool.attention_sinks
        key_pos = [
            keys_read(computed, new, window, sinks, device)
            for computed, new in zip(self.num_computed, self.num_new, strict=True)
        ]
        key_seq = torch.cat([torch.full_like(pos, i) for i, pos in enumerate(key_pos)])
        key_pos = torch.cat(key_pos)
        self.key_slots = slot_mapping(self.tables, key_seq, key_pos, self.kv_block_size)
        mask = paged_causal_mask(
            seq_of_token[:, None], positions[:, None], key_seq[None, :], key_pos[None, :],
            window, sinks,
        )  # fmt: skip
        return positions[None, :], mask[None, None, :, :]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> LayerPast:
        self.pool.write(layer, self.written_slots, k[0].transpose(0, 1), v[0].transpose(0, 1))
        keys, values = self.pool.read_slots(layer, self.key_slots)
        return keys[None], values[None]  # (1, n_head, every key, head_dim)
