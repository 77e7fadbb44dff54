"""Attention reading the paged pool in place through FlexAttention (the engine's "flex").

The C kernel (roseinfer.cache.kernels) reads the pool in place on a CPU; this is the same
promise wherever PyTorch compiles FlexAttention (CUDA, and the CPU, where CI tests it):
one compiled `flex_attention` call per layer for the step's decode rows and one for its
prompt and verify chunks, reading every key and value where it lies in the pool, with no
per-sequence loop and no gather (PyTorch's own paged pattern,
`torch.nn.attention.experimental._paged_attention`, and nano-vllm's
`flash_attn_with_kvcache(block_table=...)` do the same).

How a query finds its keys:

* the pool's layer is one long key axis, (1, n_kv_head, num_blocks * kv_block_size,
  head_dim): a view, no copy (the pool keeps its blocks heads first for this,
  `KVPool(heads_major=True)`); key index s is slot s, token s % kv_block_size of physical
  block s // kv_block_size;
* each sequence is one batch row of the call, its block table the row's list of blocks
  to visit (the `BlockMask`'s kv_indices, one mask block per KV block): no query ever
  reads a block outside its own table;
* inside those blocks the mask (`mask_mod`) is the paged causal rule on positions
  (`rosetrainer.model.window_mask`): a slot's position is its block's place in the table
  times kv_block_size plus its offset. A physical block has one place in every table
  that holds it (prefix caching shares a block only between sequences with the same
  tokens before it, hence at the same place), so one `block_place` per step serves
  every row.

Keys and values may have fewer heads than queries (grouped-query attention:
`enable_gqa`). A block freed behind a sliding window (-1 in its table) is left out of
the row's list.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from rosetrainer import model as gpt


class PlainPool(Protocol):
    """What FlexAttention reads of a pool (roseinfer.cache.paged.KVPool, heads_major)."""

    kv_block_size: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...


Q_BLOCK = 128  # queries per mask block (FlexAttention's default)


def paged_flex_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: torch.Tensor,
    visits: torch.Tensor,
    num_visits: torch.Tensor,
    block_place: torch.Tensor,
    query_pos: torch.Tensor,
    kv_block_size: int,
    window: int | None,
    sinks: int,
) -> torch.Tensor:
    """One FlexAttention call: q (rows, n_head, q_len, head_dim), row b over the blocks of
    its table, tables[b] (-1: none), in the pool's keys (1, n_kv_head, slots, head_dim),
    under the paged causal rule at query_pos (rows, q_len). The mask says it all (a key
    is seen only if its block is the row's at the block's place); the blocks to visit,
    visits[b, :num_visits[b]], let the fused kernel skip every other block. Compiled whole
    (`compiled`): the mask is built inside, so that its tensors are the compiled call's
    inputs, read anew every call."""

    def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202 (FlexAttention's signature)
        block = kv_idx // kv_block_size
        place = block_place[block]
        key_pos = place * kv_block_size + kv_idx % kv_block_size
        own = tables[b, place] == block  # the row's table holds this block (at that place)
        return own & gpt.window_mask(query_pos[b, q_idx], key_pos, window, sinks)

    q_blocks = -(-q.size(2) // Q_BLOCK)
    num_visits = num_visits[:, None, None].expand(-1, 1, q_blocks).contiguous()
    visits = visits[:, None, None, :].expand(-1, 1, q_blocks, -1).contiguous()
    block_mask = BlockMask.from_kv_blocks(
        num_visits,
        visits,
        # No block is known to be wholly seen (every key goes through the mask); said
        # explicitly, as inductor's CPU kernel for a windowed mask otherwise fails to build.
        torch.zeros_like(num_visits),
        torch.zeros_like(visits),
        BLOCK_SIZE=(Q_BLOCK, kv_block_size),
        mask_mod=mask_mod,
        seq_lengths=(q.size(2), keys.size(2)),
        compute_q_blocks=False,  # (the backward pass's index: inference has none)
    )
    enable_gqa = q.size(1) != keys.size(1)
    # On CUDA the kernel's tile of keys (BLOCK_N) must divide the mask's KV block, the
    # pool's kv_block_size (16 by default; Triton's default tile is wider). Not yet run on
    # a GPU (benchmarks/gpu.sh will).
    options = {"BLOCK_N": min(64, kv_block_size)} if q.is_cuda else None
    return flex_attention(
        q, keys, values, block_mask=block_mask, enable_gqa=enable_gqa, kernel_options=options
    )


@functools.cache
def compiled() -> Callable[..., torch.Tensor]:
    """paged_flex_attention compiled once per process (eager FlexAttention materialises
    every score; compiled, it is one fused kernel)."""
    return torch.compile(paged_flex_attention, dynamic=None)


def table_tensor(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """(rows, longest table) physical block ids, short tables padded with -1 (none)."""
    longest = max(map(len, tables))
    return torch.tensor([t + [-1] * (longest - len(t)) for t in tables], device=device)


def block_places(tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Each physical block's place in the tables (rows, longest) that hold it (0 where
    none does): one per block, as a block has the same place in every table holding it."""
    held = tables >= 0
    place = torch.arange(tables.size(1), device=tables.device).expand_as(tables)
    block_place = torch.zeros(num_blocks, dtype=torch.long, device=tables.device)
    block_place[tables[held]] = place[held]
    return block_place


class FlexStep:
    """One engine step's reading plan: built once a step, used by every layer.

    tables: (rows, longest) each sequence's blocks (-1: none, or freed behind a window);
    block_place: `block_places(tables)`; positions: (total_new,) the new tokens'
    positions, sequence after sequence; num_new: tokens each sequence feeds;
    num_decode: the leading sequences that feed one (the decode rows). Nothing here
    waits for the device (a decode step's plan over static buffers is what a CUDA graph
    captures, roseinfer.engine.cuda_graphs).
    """

    def __init__(
        self,
        tables: torch.Tensor,
        block_place: torch.Tensor,
        positions: torch.Tensor,
        num_new: list[int],
        num_decode: int,
        kv_block_size: int,
        window: int | None,
        sinks: int,
    ) -> None:
        device = positions.device
        self.num_decode, self.kv_block_size = num_decode, kv_block_size
        self.window, self.sinks = window, sinks
        self.tables, self.block_place = tables, block_place
        # Each row's blocks to visit: its table up to its last block (a freed entry
        # visits block 0, whose keys the mask hides). As wide as the pool, as
        # FlexAttention's CPU kernel asks.
        rows, longest = tables.shape
        self.visits = torch.zeros(rows, len(block_place), dtype=torch.int32, device=device)
        self.visits[:, :longest] = tables.clamp(min=0)
        upto = torch.arange(1, longest + 1, device=device) * (tables >= 0)
        self.num_visits = upto.amax(1).to(torch.int32)
        # The chunks' queries laid out one chunk per row, padded to the longest
        # (chunk_index[c, i]: its i-th token's index in the step's row; padding repeats
        # the chunk's last token, whose output is dropped).
        lengths = torch.tensor(num_new[num_decode:], dtype=torch.long)
        starts = torch.cumsum(torch.tensor(num_new), 0)[num_decode:] - lengths
        self.chunk_tokens = int(lengths.sum())
        if len(lengths):
            offsets = torch.arange(int(lengths.max()))
            index = starts[:, None] + torch.minimum(offsets[None, :], lengths[:, None] - 1)
            self.chunk_index = index.to(device)
            self.chunk_valid = (offsets[None, :] < lengths[:, None]).to(device)
            self.chunk_positions = positions[self.chunk_index]
        self.decode_positions = positions[:num_decode, None]  # (rows, 1)

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """q (1, n_head, total_new, head_dim) the step's queries; k_pool, v_pool one
        layer's blocks, (num_blocks, n_kv_head, kv_block_size, head_dim), stored heads
        first. The attention outputs, shaped like q."""
        keys, values = (pool_as_keys(t) for t in (k_pool, v_pool))
        outputs = []
        n = self.num_decode
        if n:  # one query per row: (rows, n_head, 1, head_dim)
            rows = q[0, :, :n].transpose(0, 1)[:, :, None].contiguous()
            y = self._call(rows, keys, values, self.decode_positions, slice(0, n))
            outputs.append(y[:, :, 0].transpose(0, 1)[None])
        if self.chunk_tokens:  # (chunks, n_head, longest, head_dim)
            rows = q[0][:, self.chunk_index].transpose(0, 1).contiguous()
            y = self._call(rows, keys, values, self.chunk_positions, slice(n, None))
            y = y.transpose(0, 1)[:, self.chunk_valid]  # (n_head, chunk tokens, head_dim)
            outputs.append(y[None])
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)

    def _call(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        query_pos: torch.Tensor,
        rows: slice,
    ) -> torch.Tensor:
        tables, visits, num_visits = self.tables[rows], self.visits[rows], self.num_visits[rows]
        return compiled()(
            q, keys, values, tables, visits, num_visits, self.block_place, query_pos,
            self.kv_block_size, self.window, self.sinks,
        )  # fmt: skip


class StaticDecodeCache:
    """A decode step's view of a plain pool over static buffers (a
    `rosetrainer.model.AttendingKVCache`; roseinfer.engine.cuda_graphs fills them): row
    i's new key and value written at slots[i], then every row's query over its own
    blocks (tables, block_place as `FlexStep` takes them) through FlexAttention in place.
    Nothing here waits for the device, so a CUDA graph can hold the step."""

    def __init__(
        self,
        pool: PlainPool,
        slots: torch.Tensor,
        positions: torch.Tensor,
        tables: torch.Tensor,
        block_place: torch.Tensor,
    ) -> None:
        self.pool, self.slots, self.positions = pool, slots, positions
        rows = len(slots)
        self.flex = FlexStep(
            tables, block_place, positions, [1] * rows, rows, pool.kv_block_size, None, 0
        )

    def prepare(self, batch: int, q_len: int, device: torch.device) -> tuple[torch.Tensor, None]:
        return self.positions[None, :], None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.write(layer, self.slots, k[0].transpose(0, 1), v[0].transpose(0, 1))
        return self.flex.attend(q, self.pool.k[layer], self.pool.v[layer])


def pool_as_keys(blocks: torch.Tensor) -> torch.Tensor:
    """One layer's blocks (num_blocks, n_kv_head, kv_block_size, head_dim), stored heads
    first, as one key axis: (1, n_kv_head, num_blocks * kv_block_size, head_dim), a view."""
    num_blocks, n_kv_head, kv_block_size, head_dim = blocks.shape
    heads_first = blocks.transpose(0, 1)
    assert heads_first.is_contiguous(), "the pool must be built with heads_major=True"
    return heads_first.view(1, n_kv_head, num_blocks * kv_block_size, head_dim)
