"""The KV block pool's bookkeeping: which physical block holds which tokens, for whom.

The pool's memory (roseinfer/cache/paged.py) is cut into blocks of
`kv_block_size` token slots. Here only block *numbers* move: each sequence holds a block
table (its logical block i lives in physical block `block_table[i]`), and each block
counts the tables that hold it (`ref_count`).

Prefix caching: once a block is full, its keys/values depend on its own tokens *and on
every token before it* (attention mixed them in, and each sits at its position). So a
full block is keyed by a hash chained over the previous block's key and its own
tokens (`chain_hash`). Another sequence whose tokens agree up to the end of that block
can take the block as it is. A block nobody holds any more keeps its contents and
stays findable until the pool needs the room: such blocks are evicted least recently
used first.

Sliding window: a model whose queries see only the last `window` keys (and the first
`sinks`) never reads a block again once it lies wholly behind a sequence's window, so
`drop_out_of_window` gives such blocks back while the sequence runs on; their table
entries become FREED (-1). A long request then holds at most ceil(window / block_size)
+ 1 blocks, and those of its sinks.

Every block is in exactly one of three states:
  free      no contents worth keeping, in `free_ids`
  used      held by at least one live sequence (ref_count > 0)
  cached    nobody holds it but its contents are keyed, in `evictable` (LRU order)
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from roseinfer.engine.sequence import EngineSequence


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0  # block tables that hold it
    hash: bytes | None = None  # its prefix-cache key, once full and registered
    token_ids: tuple[int, ...] = ()  # the tokens it holds when registered (checked on a hit)


def chain_hash(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    """A full block's key: its tokens and, through `parent`, every token before it."""
    data = parent + b"|" + ",".join(map(str, token_ids)).encode()
    return hashlib.sha256(data).digest()


FREED = -1  # a block-table entry whose block was given back behind the window


def blocks_for(num_tokens: int, kv_block_size: int) -> int:
    return -(-num_tokens // kv_block_size)


def blocks_short(seq: EngineSequence, kv_block_size: int) -> int:
    """How many more blocks seq needs for all of its tokens (0 when its table holds them)."""
    return max(0, blocks_for(seq.num_tokens, kv_block_size) - len(seq.block_table))


class BlockManagerProtocol(Protocol):
    """What the scheduler and the engine read and call on a block manager: BlockManager
    below, or any other (a learner's, say) passed to LLMEngine as `block_manager_class`."""

    kv_block_size: int
    # Bumped whenever a key enters or leaves the prefix cache: a lookup made since the
    # last bump would find the same blocks (the scheduler keeps its waiting head's).
    cache_version: int
    prefix_cache_queries: int  # full blocks looked up
    prefix_cache_hits: int  # full blocks found

    @property
    def num_blocks(self) -> int: ...
    @property
    def num_used(self) -> int: ...
    @property
    def num_available(self) -> int: ...
    def cached_prefix(self, token_ids: list[int]) -> list[int]: ...
    def can_start(self, cached_ids: list[int], num_tokens: int) -> bool: ...
    def start(self, seq: EngineSequence, cached_ids: list[int], num_tokens: int) -> None: ...
    def can_grow(self, seq: EngineSequence, num_tokens: int) -> bool: ...
    def grow(self, seq: EngineSequence, num_tokens: int) -> None: ...
    def drop_out_of_window(self, seq: EngineSequence) -> None: ...
    def release(self, seq: EngineSequence) -> None: ...
    def advance(self, seq: EngineSequence, num_new: int) -> None: ...
    def trim(self, seq: EngineSequence) -> None: ...


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        kv_block_size: int,
        enable_prefix_caching: bool = True,
        shuffle_seed: int | None = None,
        window: int | None = None,
        sinks: int = 0,
    ) -> None:
        self.kv_block_size = kv_block_size
        self.window, self.sinks = window, sinks  # the model's sliding window, if any
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # With a shuffle seed, free blocks are handed out in a random order (tests do this:
        # then block i of a sequence is almost never physical block i).
        self.rng = random.Random(shuffle_seed) if shuffle_seed is not None else None
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0, 1, ...
        self.cached: dict[bytes, int] = {}  # prefix-cache key -> block id
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unheld; oldest first
        self.cache_version = 0  # (see BlockManagerProtocol)
        self.prefix_cache_queries = 0  # full blocks looked up
        self.prefix_cache_hits = 0  # full blocks found

    # -- counts --

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_cached_unused(self) -> int:
        return len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached_unused

    @property
    def num_available(self) -> int:
        """Blocks a sequence could take now: free ones, and cached ones nobody holds."""
        return self.num_free + self.num_cached_unused

    # -- prefix cache --

    def cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Physical blocks that already hold the longest run of `token_ids`' full blocks.

        The last token is never served from the cache: the step that computes it gives
        the logits the next token is sampled from. Nothing is taken yet.
        """
        if not self.enable_prefix_caching:
            return []
        found, parent = [], b""
        for i in range(self.lookup_blocks(len(token_ids))):
            tokens = tuple(token_ids[i * self.kv_block_size : (i + 1) * self.kv_block_size])
            parent = chain_hash(parent, tokens)
            block_id = self.cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            found.append(block_id)
        return found

    def lookup_blocks(self, num_tokens: int) -> int:
        """Full blocks of a num_tokens sequence that the cache may serve (not the last token)."""
        return (num_tokens - 1) // self.kv_block_size if self.enable_prefix_caching else 0

    # -- a sequence's blocks --

    def can_start(self, cached_ids: list[int], num_tokens: int) -> bool:
        """Could a sequence take `cached_ids` and grow to hold num_tokens tokens?"""
        # Taking a cached block nobody holds removes it from the evictable ones.
        unheld = sum(1 for block_id in cached_ids if self.blocks[block_id].ref_count == 0)
        needed = blocks_for(num_tokens, self.kv_block_size) - len(cached_ids)
        return needed <= self.num_available - unheld

    def start(self, seq: EngineSequence, cached_ids: list[int], num_tokens: int) -> None:
        """Give a sequence with no blocks its cached prefix, then room for num_tokens."""
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        self.prefix_cache_queries += self.lookup_blocks(seq.num_tokens)
        self.prefix_cache_hits += len(cached_ids)
        for block_id in cached_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.evictable[block_id]
            block.ref_count += 1
        seq.block_table = list(cached_ids)
        seq.block_hashes = [self.blocks[block_id].hash for block_id in cached_ids]
        seq.num_computed_tokens = len(cached_ids) * self.kv_block_size
        if not seq.output_ids:  # a first start, not a recompute after preemption
            seq.num_cached_tokens = seq.num_computed_tokens
        self.grow(seq, num_tokens)

    def can_grow(self, seq: EngineSequence, num_tokens: int) -> bool:
        needed = blocks_for(num_tokens, self.kv_block_size) - len(seq.block_table)
        return needed <= self.num_available

    def grow(self, seq: EngineSequence, num_tokens: int) -> None:
        """Append blocks to seq's table until it has slots for num_tokens tokens."""
        while len(seq.block_table) * self.kv_block_size < num_tokens:
            seq.block_table.append(self._take_block())

    def drop_out_of_window(self, seq: EngineSequence) -> None:
        """Give back seq's blocks that no later query can read: wholly before the window of
        its next token (at position num_computed_tokens), and holding no sink."""
        if self.window is None:
            return
        first_needed = seq.num_computed_tokens - self.window + 1  # the next query's oldest key
        first_sinkless = -(-self.sinks // self.kv_block_size)
        # Newest first, down to the first block already given back: blocks go back in
        # order, so every one before it went back too, and a step looks at the few
        # blocks its sequence left behind since the last, not at its whole table.
        for i in reversed(range(first_sinkless, max(0, first_needed) // self.kv_block_size)):
            if seq.block_table[i] == FREED:
                break
            self._give_back(seq.block_table[i])
            seq.block_table[i] = FREED

    def release(self, seq: EngineSequence) -> None:
        """Drop every block the sequence holds (finished, aborted or preempted).

        Blocks go back last first, so that when the pool runs short the end of a
        prefix is evicted before its beginning (which more prompts share).
        """
        for block_id in reversed(seq.block_table):
            if block_id != FREED:
                self._give_back(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def _give_back(self, block_id: int) -> None:
        """One table fewer holds the block; unheld, it is free, or cached if keyed."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self.evictable[block_id] = None
            else:
                self.free_ids.append(block_id)

    def advance(self, seq: EngineSequence, num_new: int) -> None:
        """A step computed num_new more of seq's tokens into its blocks."""
        seq.num_computed_tokens += num_new
        self.register_full_blocks(seq)

    def trim(self, seq: EngineSequence) -> None:
        """Give back seq's blocks past its computed tokens: after a verify step, the blocks
        that held only drafts the target rejected. None of them is in the prefix cache:
        only blocks full of computed tokens are registered, and rejected drafts are never
        counted as computed (`advance` moves past accepted tokens only)."""
        keep = blocks_for(seq.num_computed_tokens, self.kv_block_size)
        for block_id in reversed(seq.block_table[keep:]):
            assert self.blocks[block_id].hash is None, f"block {block_id} is in the prefix cache"
            self._give_back(block_id)
        del seq.block_table[keep:]

    def register_full_blocks(self, seq: EngineSequence) -> None:
        """Key every block of seq that is now full and computed, so others can find it."""
        if not self.enable_prefix_caching:
            return
        size = self.kv_block_size
        # (Each key is computed once: block_hashes keeps those of the blocks keyed so far.)
        while len(seq.block_hashes) < seq.num_computed_tokens // size:
            i = len(seq.block_hashes)
            tokens = tuple(seq.fed_slice(i * size, (i + 1) * size))  # (computed: never drafts)
            key = chain_hash(seq.block_hashes[-1] if seq.block_hashes else b"", tokens)
            seq.block_hashes.append(key)
            block = self.blocks[seq.block_table[i]]
            # Two sequences may have computed the same block side by side: the first
            # one keyed stays the cached copy, the other is freed when its holder ends.
            if block.hash is None and key not in self.cached:
                block.hash, block.token_ids = key, tokens
                self.cached[key] = block.block_id
                self.cache_version += 1

    def _take_block(self) -> int:
        if self.free_ids:
            if self.rng is None:
                block_id = self.free_ids.pop()
            else:
                i = self.rng.randrange(len(self.free_ids))
                self.free_ids[i], self.free_ids[-1] = self.free_ids[-1], self.free_ids[i]
                block_id = self.free_ids.pop()
        else:  # evict the cached block unused the longest
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
            self.cache_version += 1
        self.blocks[block_id].ref_count = 1
        return block_id


def check_pool(
    manager: BlockManager,
    live: list[EngineSequence],
    written_slots: list[int] = (),
    writer_tables: list[list[int]] = (),
) -> None:
    """The pool's invariants; tests and chapters call it after every step.

    * each block's ref_count equals the number of live block tables that hold it;
    * free + used + cached-unused = total, and no block is in two of those states;
      num_used counts the blocks live tables hold, a shared block once;
    * no block is written by two live sequences: each slot written in the step lies in
      exactly one of the writers' block tables (as they were when it was written), and
      in at most one live table now.
    """
    holders = [0] * manager.num_blocks
    for seq in live:
        for block_id in seq.block_table:
            if block_id != FREED:
                holders[block_id] += 1
    for block in manager.blocks:
        assert block.ref_count == holders[block.block_id], (
            f"block {block.block_id}: ref_count {block.ref_count}, "
            f"held by {holders[block.block_id]} table(s)"
        )
    free, cached = set(manager.free_ids), set(manager.evictable)
    used = {b.block_id for b in manager.blocks if b.ref_count > 0}
    assert len(free) == manager.num_free, "a block is on the free list twice"
    assert not (free & cached) and not (used & (free | cached)), "a block is in two states"
    assert len(free) + len(cached) + len(used) == manager.num_blocks, "a block went missing"
    assert manager.num_used == len(used), (
        f"num_used is {manager.num_used} where live sequences hold {len(used)} blocks: "
        "num_used counts blocks, and a block shared by several tables is one block"
    )
    for block_id in cached:
        key = manager.blocks[block_id].hash
        assert manager.cached.get(key) == block_id, (
            f"block {block_id} is evictable with its key, but `cached` maps that key to "
            f"{manager.cached.get(key)}: the prefix cache would serve another block's KV"
        )
    for block_id in {slot // manager.kv_block_size for slot in written_slots}:
        writers = sum(block_id in table for table in writer_tables)
        assert writers == 1 and holders[block_id] <= 1, (
            f"block {block_id} was written while {writers} writer table(s) and "
            f"{holders[block_id]} live table(s) held it"
        )
