"""The paged KV cache: one pool of fixed-size blocks per layer, read and written
through block tables.

`KVPool` is the memory: per layer, keys and values for num_blocks * block_size token
slots, allocated once. Slot s is token s % block_size of physical block s // block_size.

`PagedKVCache` is one model call's view of the pool. It implements
`rosetrainer.model.KVCache` for many sequences at once, each at its own point: some
start a prompt, some continue one chunk by chunk, most add one decoded token. The
three invariants of a KV cache get their paged forms, each a named function looked up
at every call (so a chapter or test can swap in a buggy one):

* `paged_positions`: a sequence's new tokens take the positions after the ones it has
  computed (num_computed + arange), each sequence counting on its own;
* `slot_mapping`: the token at position p of a sequence is written to slot
  block_table[p // block_size] * block_size + p % block_size;
* `paged_causal_mask`: a query sees the keys of its own sequence at positions up to
  its own (the bottom-right rule, per sequence), and nothing of any other sequence.

Two layouts of the same call:

* "flat" (the readable reference): every new token of every sequence in one row of
  shape (1, total_new_tokens); attention reads every cached key of those sequences,
  and the mask keeps each query to its own sequence.
* "padded" (the fast path for decoding): one row per sequence with one new token,
  shape (num_seqs, 1); each row reads its own blocks, padded to the longest table.
  Attention then costs each query only its own context, not everyone's.
"""

from __future__ import annotations

import torch

from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError
from rosetrainer.model import LayerPast


class KVPool:
    """Keys and values of every block, per layer: (num_blocks, n_head, block_size, head_dim).

    Heads before tokens, as in the model's own (batch, n_head, time, head_dim): a
    sequence's blocks gathered in table order are then the keys attention reads, in one
    copy and already in the layout its matrix products want.
    """

    def __init__(
        self,
        config: GPTConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.n_head = config.n_head
        shape = (num_blocks, config.n_head, block_size, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)


def write_slots(blocks: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """Write one (n_head, head_dim) entry per token, `new` (tokens, n_head, head_dim), at
    pool slots `slots` (slot s: block s // block_size, offset s % block_size)."""
    block_size = blocks.size(2)
    blocks[slots // block_size, :, slots % block_size] = new


def read_slots(blocks: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The entries at pool slots `slots`: (n_head, len(slots), head_dim)."""
    block_size = blocks.size(2)
    return blocks[slots // block_size, :, slots % block_size].transpose(0, 1)


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
    block_tables: torch.Tensor, seq_of_token: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """The pool slot of each token: its sequence's physical block for that position, and
    the offset inside the block. block_tables is (num_seqs, max_blocks)."""
    physical_block = block_tables[seq_of_token, positions // block_size]
    return physical_block * block_size + positions % block_size


def paged_causal_mask(
    query_seq: torch.Tensor, query_pos: torch.Tensor, key_seq: torch.Tensor, key_pos: torch.Tensor
) -> torch.Tensor:
    """True where a query may look: a key of its own sequence, at a position <= its own.

    The arguments broadcast against each other (queries along one axis, keys along another).
    """
    return (key_seq == query_seq) & (key_pos <= query_pos)


# ---------------------------------------------------------------------------
# One model call's view of the pool
# ---------------------------------------------------------------------------


def padded_tables(block_tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """(num_seqs, longest table) physical block ids; short tables are padded with block 0,
    whose slots the mask then hides."""
    longest = max(map(len, block_tables))
    rows = [table + [0] * (longest - len(table)) for table in block_tables]
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
        self.block_size = pool.block_size
        self.tables = padded_tables(block_tables, pool.device)
        self.num_computed = torch.tensor(num_computed, dtype=torch.long)
        self.num_new = torch.tensor(num_new, dtype=torch.long)
        self.write_slots = torch.zeros(0, dtype=torch.long)
        self.read_slots: torch.Tensor | None = None

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
        self.write_slots = slot_mapping(self.tables, seq_of_token, positions, self.block_size)
        if self.layout == "flat":
            # Every key the new tokens may read: positions 0 .. num_computed + num_new - 1
            # of each sequence, one sequence after another.
            context = self.num_computed + self.num_new
            key_seq = torch.repeat_interleave(torch.arange(num_seqs), context).to(device)
            key_pos = paged_positions(torch.zeros_like(context), context).to(device)
            self.read_slots = slot_mapping(self.tables, key_seq, key_pos, self.block_size)
            mask = paged_causal_mask(
                seq_of_token[:, None], positions[:, None], key_seq[None, :], key_pos[None, :]
            )
            return positions[None, :], mask[None, None, :, :]
        # Padded: row i reads all of its blocks; key j of a row stands at position j.
        key_pos = torch.arange(self.tables.size(1) * self.block_size, device=device)
        rows = torch.arange(num_seqs, device=device)
        mask = paged_causal_mask(rows[:, None], positions[:, None], rows[:, None], key_pos[None, :])
        return positions[:, None], mask[:, None, None, :]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> LayerPast:
        k_blocks, v_blocks = self.pool.k[layer], self.pool.v[layer]
        # (rows, n_head, q_len, head_dim) -> one (n_head, head_dim) entry per new token,
        # in the order of write_slots (sequence by sequence, position by position).
        rows, n_head, q_len, head_dim = k.shape
        write_slots(k_blocks, self.write_slots, k.transpose(1, 2).reshape(-1, n_head, head_dim))
        write_slots(v_blocks, self.write_slots, v.transpose(1, 2).reshape(-1, n_head, head_dim))
        if self.layout == "flat":  # every key of the step's sequences: (1, n_head, keys, head_dim)
            return read_slots(k_blocks, self.read_slots)[None], read_slots(
                v_blocks, self.read_slots
            )[None]
        return self._read_blocks(k_blocks), self._read_blocks(v_blocks)

    def _read_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """Each row's blocks, whole and in table order: (rows, n_head, max_blocks * block_size,
        head_dim), gathered in one copy (row r, head h, table entry i: blocks[tables[r, i], h])."""
        rows, max_blocks = self.tables.shape
        heads = torch.arange(blocks.size(1), device=blocks.device)
        gathered = blocks[self.tables[:, None, :], heads[None, :, None]]  # (rows, h, blocks, bs, d)
        return gathered.view(rows, blocks.size(1), max_blocks * self.block_size, blocks.size(-1))
