"""Build (chapters 11-13): the block manager, the bookkeeping of rose's paged KV pool.

The pool's memory (roseinfer/cache/paged.py) is cut into `num_blocks` blocks of
`kv_block_size` token slots. Only block numbers move here: each sequence holds a block
table, `seq.block_table`, whose entry i is the physical block holding its tokens
i * kv_block_size .. (i + 1) * kv_block_size - 1; each block counts the tables that hold
it (`ref_count`). The engine (roseinfer/engine/scheduler.py and llm_engine.py) calls
the methods below; its sequences are `roseinfer.engine.sequence.EngineSequence`s, of
which you read `all_ids` (prompt and output tokens so far) and `output_ids`, and write
`block_table`, `num_computed_tokens` (how many of its tokens the pool holds) and
`num_cached_tokens` (how many prompt tokens the prefix cache served, for its report);
`block_hashes`, an empty list at first, is yours to keep its blocks' keys in.

Prefix caching: a full block's keys and values depend on its own tokens and on every
token before it. So once full and computed, a block is keyed by `chain_hash` of the
previous block's key (b"" for a sequence's first block) and its own tokens, and another
sequence whose tokens agree up to the end of that block takes it as it is. A block that
nobody holds any more keeps its contents and stays findable until the pool needs room.

Every block is in exactly one of three states, and the engine's tests check it after
every step (`roseinfer.engine.block_manager.check_pool` reads the attributes named in
`BlockManager.__init__`):
  free     holds nothing worth keeping; its id is in `free_ids`
  used     held by at least one live sequence's table (ref_count > 0)
  cached   held by nobody, but keyed: its id is in `evictable`, the least recently
           given back first; the pool takes these only when no free block is left
           (evicting it: it is keyed no more)

`rose-course check block_manager` scripts a few lives of small pools beside rose's
BlockManager (every answer and counter compared, the prefix cache's contents too: after
an eviction no key maps to a block that no longer holds it; blocks filled by generated
tokens are keyed like the prompt's; a prompt whose first block is evicted finds nothing;
without prefix caching nothing is keyed), then runs rose's engine with your BlockManager
in place of rose's, on random schedules (arrivals, block sizes, pools small enough to
preempt and evict, shared prefixes), checks the pool's invariants after every step and
compares every request with its solo uncached run, and the prefix cache's hits and
counters with rose's.
"""

from __future__ import annotations

from collections import OrderedDict

from roseinfer.engine.block_manager import Block

# The key is rose's own (roseinfer/engine/block_manager.py); the stub leaves this line out,
# with the body below.
from roseinfer.engine.block_manager import chain_hash as rose_chain_hash
from roseinfer.engine.sequence import EngineSequence


def chain_hash(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    """A full block's key: a digest of the previous block's key `parent` and of the
    block's tokens, so that two blocks get one key only when their tokens and every
    token before them agree (tokens (1, 23) and (12, 3) are different blocks)."""
    return rose_chain_hash(parent, token_ids)


class BlockManager:
    """Which physical block holds which sequence's tokens, and the prefix cache."""

    def __init__(self, num_blocks: int, kv_block_size: int, enable_prefix_caching: bool) -> None:
        """A pool of `num_blocks` free blocks of `kv_block_size` slots. Attributes the
        engine and check_pool read: `kv_block_size`; `blocks`, one
        `roseinfer.engine.block_manager.Block` per physical block (block_id = its index,
        ref_count, and the hash and token_ids it is cached under, or None and ()); `free_ids`,
        the free blocks' ids (a list); `cached`, a dict from key to the block cached
        under it; `evictable`, an OrderedDict whose keys are the cached blocks nobody
        holds (values None), least recently given back first; and the prefix cache's
        counters `prefix_cache_queries` and `prefix_cache_hits` (full blocks looked up
        by `start` and found, both 0 at first); `cache_version`, a number that changes
        whenever a key enters or leaves `cached` (the scheduler looks the head of its
        queue up again only then). Without `enable_prefix_caching` nothing is ever keyed
        or found."""
        self.kv_block_size = kv_block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.free_ids = list(range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.cache_version = 0

    @property
    def num_blocks(self) -> int:
        """How many blocks the pool has."""
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """How many blocks are free."""
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        """How many blocks live sequences hold."""
        return self.num_blocks - self.num_free - len(self.evictable)

    def lookup_blocks(self, num_tokens: int) -> int:
        """How many full blocks of a num_tokens sequence the prefix cache may serve: never
        the block of its last token, whose step must compute the logits the next token is
        drawn from (0 without prefix caching)."""
        if not self.enable_prefix_caching:
            return 0
        return (num_tokens - 1) // self.kv_block_size

    def cached_prefix(self, token_ids: list[int]) -> list[int]:
        """The physical blocks that already hold the longest run of `token_ids`' first
        full blocks (at most `lookup_blocks(len(token_ids))`), in order: block i is found
        when its chained key is cached and the block cached under it holds exactly these
        tokens. Nothing is taken, nothing counted."""
        found: list[int] = []
        parent = b""
        size = self.kv_block_size
        for i in range(self.lookup_blocks(len(token_ids))):
            tokens = tuple(token_ids[i * size : (i + 1) * size])
            parent = chain_hash(parent, tokens)
            block_id = self.cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            found.append(block_id)
        return found

    def can_start(self, cached_ids: list[int], num_tokens: int) -> bool:
        """Could a sequence without blocks take `cached_ids` (from cached_prefix) and grow
        to hold num_tokens tokens?"""
        unheld = sum(1 for block_id in cached_ids if self.blocks[block_id].ref_count == 0)
        needed = -(-num_tokens // self.kv_block_size) - len(cached_ids)
        return needed <= self.num_free + len(self.evictable) - unheld

    def start(self, seq: EngineSequence, cached_ids: list[int], num_tokens: int) -> None:
        """Give `seq` (which holds no blocks) the cached blocks `cached_ids` as its first
        table entries, each held once more (out of `evictable` if nobody held it), then
        grow it to num_tokens. Its num_computed_tokens becomes the tokens those blocks hold;
        on its first start (no output yet: not a restart after preemption) so does its
        num_cached_tokens. The counters: prefix_cache_queries grows by
        lookup_blocks(len(seq.all_ids)), prefix_cache_hits by len(cached_ids)."""
        self.prefix_cache_queries += self.lookup_blocks(len(seq.all_ids))
        self.prefix_cache_hits += len(cached_ids)
        for block_id in cached_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.evictable[block_id]
            block.ref_count += 1
        seq.block_table = list(cached_ids)
        seq.block_hashes = [self.blocks[block_id].hash for block_id in cached_ids]
        seq.num_computed_tokens = len(cached_ids) * self.kv_block_size
        if not seq.output_ids:
            seq.num_cached_tokens = seq.num_computed_tokens
        self.grow(seq, num_tokens)

    def can_grow(self, seq: EngineSequence, num_tokens: int) -> bool:
        """Could `seq`'s table grow to hold num_tokens tokens with the free blocks and the
        cached blocks nobody holds?"""
        needed = -(-num_tokens // self.kv_block_size) - len(seq.block_table)
        return needed <= self.num_free + len(self.evictable)

    def grow(self, seq: EngineSequence, num_tokens: int) -> None:
        """Append blocks to `seq`'s table until it has slots for num_tokens tokens: a free
        block if there is one, else the least recently given back cached one (evicted:
        no longer keyed). A block taken is held once (ref_count 1)."""
        while len(seq.block_table) * self.kv_block_size < num_tokens:
            if self.free_ids:
                block_id = self.free_ids.pop()
            else:
                block_id, _ = self.evictable.popitem(last=False)
                block = self.blocks[block_id]
                del self.cached[block.hash]
                block.hash, block.token_ids = None, ()
                self.cache_version += 1
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)

    def release(self, seq: EngineSequence) -> None:
        """`seq` finished, was aborted or preempted: give back every block of its table,
        its last block first (so that a short pool evicts the end of a prefix before its
        beginning, which more prompts share). A block nobody holds any more becomes free,
        or evictable if keyed. The sequence is left with an empty table and no computed
        tokens."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self.evictable[block_id] = None
                else:
                    self.free_ids.append(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def advance(self, seq: EngineSequence, num_new: int) -> None:
        """A model step computed `num_new` more of seq's tokens into its blocks. Every
        block of seq that is now full and computed gets its chained key (with prefix
        caching); a block is cached under its key only when that key is not cached yet
        (two sequences may compute the same block side by side: the first one keyed stays
        the cached copy, the other is freed when its holders are done)."""
        seq.num_computed_tokens += num_new
        if not self.enable_prefix_caching:
            return
        size = self.kv_block_size
        while len(seq.block_hashes) < seq.num_computed_tokens // size:
            i = len(seq.block_hashes)
            tokens = tuple(seq.all_ids[i * size : (i + 1) * size])
            key = chain_hash(seq.block_hashes[-1] if seq.block_hashes else b"", tokens)
            seq.block_hashes.append(key)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and key not in self.cached:
                block.hash, block.token_ids = key, tokens
                self.cached[key] = block.block_id
                self.cache_version += 1


# `rose-course hint block_manager` gives these one at a time, the idea first and the
# near-code last (`rose-course check block_manager` counts how many were used); the stub
# leaves them out.
HINTS = (
    "Keep the three states exact and every method follows: a block is free (its id in "
    "free_ids), used (ref_count > 0) or cached (keyed, nobody holds it: its id in "
    "evictable). `check_pool` holds you to them after every engine step, so a broken "
    "state shows at the step that broke it.",
    "Counting blocks: a sequence of n tokens needs -(-n // kv_block_size) blocks (the "
    "ceiling); those it may still take are the free ones and the evictable ones.",
    "can_start: the cached blocks it would take count against what is available only if "
    "nobody holds them (they are in evictable now, and would leave it).",
    "cached_prefix: walk the full blocks in order, each key chained on the previous one "
    "(b'' before the first); stop at the first key not in `cached`, or whose block holds "
    "other tokens (a block's token_ids are what it was keyed with).",
    "grow and release: take from free_ids while there are any, else the least recently "
    "given back evictable block (`evictable.popitem(last=False)`), which loses its key "
    "(delete it from `cached`, reset its hash and token_ids). Give back a table last block "
    "first: ref_count - 1, and at 0 to evictable if keyed, to free_ids otherwise.",
    "advance: with prefix caching, every block of seq that is now full and computed "
    "(num_computed_tokens // kv_block_size of them) and has no key in seq.block_hashes "
    "yet gets one, in order. Cache the block under it only when the key is not cached "
    "already and the block has none: another sequence may have computed the same block.",
    "advance, near-code:\n"
    "    while len(seq.block_hashes) < seq.num_computed_tokens // size:\n"
    "        i = len(seq.block_hashes); tokens = tuple(seq.all_ids[i * size : (i + 1) * size])\n"
    "        key = chain_hash(seq.block_hashes[-1] if seq.block_hashes else b'', tokens)\n"
    "        seq.block_hashes.append(key); block = self.blocks[seq.block_table[i]]\n"
    "        if block.hash is None and key not in self.cached: key it, cached[key] = block_id",
)
