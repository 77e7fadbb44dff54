"""The block manager build's known wrong answers (data: what `rose-course check
block_manager` names).

Each is the reference solution (block_manager/reference.py) with one
method or function written wrong, as a learner writes it into build_block_manager.py: it
runs as if written there (grading.replaced rebinds it to the module's globals).
`# the mistake` marks the line.
"""

from __future__ import annotations

import hashlib

from rosecourse.builds.grading import KnownWrong
from roseinfer.engine.sequence import EngineSequence


def _unchained(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    # the mistake: was `data = parent + b"|" + ",".join(map(str, token_ids)).encode()`
    data = b"|" + ",".join(map(str, token_ids)).encode()
    return hashlib.sha256(data).digest()


def _hit_not_held(self, seq: EngineSequence, cached_ids: list[int], num_tokens: int) -> None:
    self.prefix_cache_queries += self.lookup_blocks(len(seq.all_ids))
    self.prefix_cache_hits += len(cached_ids)
    for block_id in cached_ids:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.evictable[block_id]
        # the mistake: `block.ref_count += 1` left out
    seq.block_table = list(cached_ids)
    seq.block_hashes = [self.blocks[block_id].hash for block_id in cached_ids]
    seq.num_computed_tokens = len(cached_ids) * self.kv_block_size
    if not seq.output_ids:
        seq.num_cached_tokens = seq.num_computed_tokens
    self.grow(seq, num_tokens)


def _serves_the_last_token(self, num_tokens: int) -> int:
    if not self.enable_prefix_caching:
        return 0
    # the mistake: was `return (num_tokens - 1) // self.kv_block_size`
    return num_tokens // self.kv_block_size


def _cache_dropped_on_release(self, seq: EngineSequence) -> None:
    for block_id in reversed(seq.block_table):
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            # the mistake: was `if block.hash is not None: self.evictable[block_id] = None else:
            # self.free_ids.append(block_id)`
            self.free_ids.append(block_id)
    seq.block_table = []
    seq.block_hashes = []
    seq.num_computed_tokens = 0


def _evicts_the_newest(self, seq: EngineSequence, num_tokens: int) -> None:
    while len(seq.block_table) * self.kv_block_size < num_tokens:
        if self.free_ids:
            block_id = self.free_ids.pop()
        else:
            # the mistake: was `block_id, _ = self.evictable.popitem(last=False)`
            block_id, _ = self.evictable.popitem(last=True)
            block = self.blocks[block_id]
            del self.cached[block.hash]
            self.cache_version += 1
            block.hash, block.token_ids = None, ()
        self.blocks[block_id].ref_count = 1
        seq.block_table.append(block_id)


def _cached_blocks_unavailable(self, seq: EngineSequence, num_tokens: int) -> bool:
    needed = -(-num_tokens // self.kv_block_size) - len(seq.block_table)
    # the mistake: was `return needed <= self.num_free + len(self.evictable)`
    return needed <= self.num_free


KNOWN_WRONG = (
    KnownWrong(
        "unchained",
        {"chain_hash": _unchained},
        "a block's key is its own tokens alone: chain the previous block's key in, or a "
        "block is found behind any other prefix (and a repeated block finds itself)",
    ),
    KnownWrong(
        "hit_not_held",
        {"BlockManager.start": _hit_not_held},
        "a block the prefix cache serves is not counted as held by the new sequence: "
        "add one to its ref_count",
    ),
    KnownWrong(
        "serves_the_last_token",
        {"BlockManager.lookup_blocks": _serves_the_last_token},  # fmt: skip
        "the cache may serve a block holding the prompt's last token: that token must "
        "be computed, its logits give the first new token",
    ),
    KnownWrong(
        "cache_dropped_on_release",
        {"BlockManager.release": _cache_dropped_on_release},
        "a keyed block nobody holds goes back to the free list, so the prefix cache "
        "never serves a finished request's blocks: keep it cached (evictable)",
    ),
    KnownWrong(
        "evicts_the_newest",
        {"BlockManager.grow": _evicts_the_newest},
        "the pool evicts the cached block given back most recently; evict the least "
        "recently given back",
    ),
    KnownWrong(
        "cached_blocks_unavailable",
        {"BlockManager.can_grow": _cached_blocks_unavailable},  # fmt: skip
        "can_grow counts the free blocks only: the cached blocks nobody holds are room "
        "too (evicted when taken)",
    ),
)
