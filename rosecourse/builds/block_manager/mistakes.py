"""The block manager build's known answers, as data (rosecourse/exercises/answers.py says
what each kind is; tests/course/test_builds.py runs them against this build's check).

Each is the reference solution (reference.py, beside this file) with one class, function or
method replaced by the code below, as a learner writes it into build_block_manager.py: it
runs as if written there (grading.replaced rebinds a function to the module's globals, so
the names it reads are the module's; those imported below from the reference are for the
reader and the linter). First the known mistakes (`KNOWN_WRONG`: what `rose-course check
block_manager` names when a learner's module probes like one); then the other wrong answers
(`build_mutant`) and the right ones written another way (`build_alternative`); last the
wrong answers written blind (`blind_build`). Where a piece was written as an edit of the
reference's text, `# the mistake` marks the line.
"""

from __future__ import annotations

import hashlib

from rosecourse.builds.block_manager import reference
from rosecourse.builds.block_manager.reference import chain_hash
from rosecourse.builds.grading import KnownWrong
from rosecourse.exercises.answers import blind_build, build_mutant
from roseinfer.engine.sequence import EngineSequence

# == The known mistakes: the check names each one it meets (KNOWN_WRONG) ======================


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


# == Other wrong answers (build_mutant), and right ones (build_alternative) ==================
# tests/course/test_builds.py asserts that each wrong one fails a part of the check without
# being taken for a known mistake, and that each right one passes every part.

# -- written as code -----------------------------------------------------------------------

_chain_hash = reference.chain_hash


@build_mutant("block_manager", "BlockManager", name="cache_version_never_changes")
class CacheVersionNeverChanges(reference.BlockManager):
    # the mistake: keys enter and leave `cached`, and cache_version stays 0 (the scheduler
    # keeps serving a waiting request its first lookup's blocks)
    cache_version = property(lambda self: 0, lambda self, value: None)


@build_mutant("block_manager", "BlockManager", name="lookup_skips_a_missing_block")
class LookupSkipsAMissingBlock(reference.BlockManager):
    def cached_prefix(self, token_ids):
        found, parent, size = [], b"", self.kv_block_size
        for i in range(self.lookup_blocks(len(token_ids))):
            tokens = tuple(token_ids[i * size : (i + 1) * size])
            parent = _chain_hash(parent, tokens)
            block_id = self.cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                continue  # on to the next block: the table no longer lines up with the text
            found.append(block_id)
        return found


class _AdvanceOf(reference.BlockManager):
    """The reference's advance, the blocks keyed up to keyed_end(seq) tokens, each keyed by
    tokens_of(seq, i)."""

    def keyed_end(self, seq):
        return seq.num_computed_tokens

    def tokens_of(self, seq, i):
        return tuple(seq.all_ids[i * self.kv_block_size : (i + 1) * self.kv_block_size])

    def keying(self):
        return self.enable_prefix_caching

    def advance(self, seq, num_new):
        seq.num_computed_tokens += num_new
        if not self.keying():
            return
        while len(seq.block_hashes) < self.keyed_end(seq) // self.kv_block_size:
            i = len(seq.block_hashes)
            tokens = self.tokens_of(seq, i)
            key = _chain_hash(seq.block_hashes[-1] if seq.block_hashes else b"", tokens)
            seq.block_hashes.append(key)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and key not in self.cached:
                block.hash, block.token_ids = key, tokens
                self.cached[key] = block.block_id
                self.cache_version += 1


@build_mutant("block_manager", "BlockManager", name="generated_blocks_never_cached")
class GeneratedBlocksNeverCached(_AdvanceOf):
    def keyed_end(self, seq):
        return min(seq.num_computed_tokens, len(seq.prompt_ids))


@build_mutant("block_manager", "BlockManager", name="blocks_keyed_from_the_prompt_alone")
class BlocksKeyedFromThePromptAlone(_AdvanceOf):
    def tokens_of(self, seq, i):
        return tuple(seq.prompt_ids[i * self.kv_block_size : (i + 1) * self.kv_block_size])


@build_mutant("block_manager", "BlockManager", name="blocks_keyed_with_prefix_caching_off")
class BlocksKeyedWithPrefixCachingOff(_AdvanceOf):
    def keying(self):
        return True  # lookup_blocks still finds nothing without prefix caching


@build_mutant("block_manager", "BlockManager", name="evicted_keys_left_in_the_map")
class EvictedKeysLeftInTheMap(reference.BlockManager):
    def grow(self, seq, num_tokens):
        while len(seq.block_table) * self.kv_block_size < num_tokens:
            if self.free_ids:
                block_id = self.free_ids.pop()
            else:
                block_id, _ = self.evictable.popitem(last=False)
                block = self.blocks[block_id]
                block.hash, block.token_ids = None, ()  # its key left in self.cached
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)


@build_mutant("block_manager", "BlockManager", name="queries_counted_by_the_tokens_to_hold")
class QueriesCountedByTheTokensToHold(reference.BlockManager):
    def start(self, seq, cached_ids, num_tokens):
        queries = self.prefix_cache_queries + self.lookup_blocks(num_tokens)
        super().start(seq, cached_ids, num_tokens)
        self.prefix_cache_queries = queries  # by the tokens this start holds, not the text's


@build_mutant("block_manager", "BlockManager", name="hits_counted_at_lookup")
class HitsCountedAtLookup(reference.BlockManager):
    def cached_prefix(self, token_ids):
        found = super().cached_prefix(token_ids)
        self.prefix_cache_hits += len(found)  # a lookup that starts nothing counted too
        return found

    def start(self, seq, cached_ids, num_tokens):
        hits = self.prefix_cache_hits
        super().start(seq, cached_ids, num_tokens)
        self.prefix_cache_hits = hits


@build_mutant("block_manager", "BlockManager", name="unkeyed_blocks_kept_evictable")
class UnkeyedBlocksKeptEvictable(reference.BlockManager):
    def release(self, seq):
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:  # every block kept for later, keyed or not
                self.evictable[block_id] = None
        seq.block_table, seq.block_hashes, seq.num_computed_tokens = [], [], 0


@build_mutant("block_manager", "BlockManager", name="num_used_sums_ref_counts")
class NumUsedSumsRefCounts(reference.BlockManager):
    @property
    def num_used(self):
        return sum(block.ref_count for block in self.blocks)  # a shared block counted twice


# -- first written as edits of the reference's text: `# the mistake` marks the line ----------
# A mutant that replaces two pieces is registered twice under one name.


@build_mutant("block_manager", "chain_hash")
def key_without_separator(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    # the mistake: was `data = parent + b"|" + ",".join(map(str, token_ids)).encode()`
    data = parent + b"|" + "".join(map(str, token_ids)).encode()
    return hashlib.sha256(data).digest()


@build_mutant("block_manager", "BlockManager.release")
def released_first_block_first(self, seq: EngineSequence) -> None:
    # the mistake: was `for block_id in reversed(seq.block_table):`
    for block_id in seq.block_table:
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


@build_mutant("block_manager", "BlockManager.can_grow")
def room_for_the_whole_sequence(self, seq: EngineSequence, num_tokens: int) -> bool:
    # the mistake: was `-(-num_tokens // self.kv_block_size)`: room for the whole sequence,
    # not for the chunk asked for (a prompt prefilled under a small budget is preempted
    # where it fits; only a budget below the prompt shows it)
    needed = -(-seq.num_tokens // self.kv_block_size) - len(seq.block_table)
    return needed <= self.num_free + len(self.evictable)


@build_mutant("block_manager", "BlockManager.can_start")
def blocks_rounded_down(self, cached_ids: list[int], num_tokens: int) -> bool:
    unheld = sum(1 for block_id in cached_ids if self.blocks[block_id].ref_count == 0)
    # the mistake: was `needed = -(-num_tokens // self.kv_block_size) - len(cached_ids)`
    needed = num_tokens // self.kv_block_size - len(cached_ids)
    return needed <= self.num_free + len(self.evictable) - unheld


@build_mutant("block_manager", "BlockManager.grow")
def grows_a_block_too_many(self, seq: EngineSequence, num_tokens: int) -> None:
    # the mistake: was `while len(seq.block_table) * self.kv_block_size < num_tokens:`
    while len(seq.block_table) * self.kv_block_size <= num_tokens:
        if self.free_ids:
            block_id = self.free_ids.pop()
        else:
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self.cached[block.hash]
            self.cache_version += 1
            block.hash, block.token_ids = None, ()
        self.blocks[block_id].ref_count = 1
        seq.block_table.append(block_id)


@build_mutant("block_manager", "BlockManager.start")
def hits_not_counted(self, seq: EngineSequence, cached_ids: list[int], num_tokens: int) -> None:
    self.prefix_cache_queries += self.lookup_blocks(len(seq.all_ids))
    # the mistake: `self.prefix_cache_hits += len(cached_ids)` left out
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


@build_mutant("block_manager", "BlockManager.start")
def served_count_reset_on_restart(
    self, seq: EngineSequence, cached_ids: list[int], num_tokens: int
) -> None:
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
    # the mistake: was `if not seq.output_ids: seq.num_cached_tokens = seq.num_computed_tokens`
    if True:
        seq.num_cached_tokens = seq.num_computed_tokens
    self.grow(seq, num_tokens)


@build_mutant("block_manager", "BlockManager.advance")
def cached_key_moved_to_the_copy(self, seq: EngineSequence, num_new: int) -> None:
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
        # the mistake: was `if block.hash is None and key not in self.cached:`
        if block.hash is None:
            block.hash, block.token_ids = key, tokens
            self.cached[key] = block.block_id
            self.cache_version += 1


# == Written blind (blind_build; rosecourse/exercises/answers.py says how) ===================
# Each one's writer said in one line what is wrong: the `# WRONG:` comment above it.


# WRONG: chain_hash joins the tokens with no separator: (1, 23) and (12, 3) collide
@blind_build("block_manager", "chain_hash")
def hash_no_separator(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    # the mistake: was `data = parent + b"|" + ",".join(map(str, token_ids)).encode()`
    data = parent + b"|" + "".join(map(str, token_ids)).encode()
    return hashlib.sha256(data).digest()


# WRONG: chain_hash ignores the parent key: a block keyed by its own tokens only
@blind_build("block_manager", "chain_hash", known="unchained")
def hash_without_parent(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    # the mistake: was `data = parent + b"|" + ",".join(map(str, token_ids)).encode()`
    data = b"|" + ",".join(map(str, token_ids)).encode()
    return hashlib.sha256(data).digest()


# Each a subclass of the reference's BlockManager, with the method the mistake is in.
_Blind = reference.BlockManager


# WRONG: can_start counts unheld cached blocks it would take as still available to grow into
@blind_build("block_manager", "BlockManager", name="can_start_ignores_unheld")
class CanStartIgnoresUnheld(_Blind):
    def can_start(self, cached_ids, num_tokens):
        needed = -(-num_tokens // self.kv_block_size) - len(cached_ids)
        # the mistake: was `return needed <= self.num_free + len(self.evictable) - unheld`
        return needed <= self.num_free + len(self.evictable)


# WRONG: can_start uses < instead of <=: refuses a sequence that exactly fits the pool
@blind_build("block_manager", "BlockManager", name="can_start_strict")
class CanStartStrict(_Blind):
    def can_start(self, cached_ids, num_tokens):
        unheld = sum(1 for block_id in cached_ids if self.blocks[block_id].ref_count == 0)
        needed = -(-num_tokens // self.kv_block_size) - len(cached_ids)
        # the mistake: was `return needed <= self.num_free + len(self.evictable) - unheld`
        return needed < self.num_free + len(self.evictable) - unheld


# WRONG: can_grow counts only free blocks, not the evictable cached ones
@blind_build(
    "block_manager", "BlockManager", name="can_grow_free_only", known="cached_blocks_unavailable"
)
class CanGrowFreeOnly(_Blind):
    def can_grow(self, seq, num_tokens):
        needed = -(-num_tokens // self.kv_block_size) - len(seq.block_table)
        # the mistake: was `return needed <= self.num_free + len(self.evictable)`
        return needed <= self.num_free


class _BlindStart(_Blind):
    """start, its counters and num_cached_tokens as `queries(seq, num_tokens)` and
    `first_start(seq)` say."""

    def queries(self, seq, num_tokens):
        return self.lookup_blocks(len(seq.all_ids))

    def first_start(self, seq):
        return not seq.output_ids

    def start(self, seq, cached_ids, num_tokens):
        self.prefix_cache_queries += self.queries(seq, num_tokens)
        self.prefix_cache_hits += len(cached_ids)
        for block_id in cached_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.evictable[block_id]
            block.ref_count += 1
        seq.block_table = list(cached_ids)
        seq.block_hashes = [self.blocks[block_id].hash for block_id in cached_ids]
        seq.num_computed_tokens = len(cached_ids) * self.kv_block_size
        if self.first_start(seq):
            seq.num_cached_tokens = seq.num_computed_tokens
        self.grow(seq, num_tokens)


# WRONG: num_cached_tokens overwritten on a restart after preemption too
@blind_build("block_manager", "BlockManager", name="cached_tokens_on_restart")
class CachedTokensOnRestart(_BlindStart):
    def first_start(self, seq):
        return True  # the mistake: was `return not seq.output_ids`


# WRONG: prefix_cache_hits counted per block found but queries counted only on a first start
@blind_build("block_manager", "BlockManager", name="hits_count_on_restart_only_new")
class HitsCountOnRestartOnlyNew(_BlindStart):
    def queries(self, seq, num_tokens):
        # the mistake: was `return self.lookup_blocks(len(seq.all_ids))`
        return 0 if seq.output_ids else self.lookup_blocks(len(seq.all_ids))


# WRONG: prefix_cache_queries counts lookup_blocks(num_tokens) (the tokens to grow to), not
# of the whole sequence
@blind_build("block_manager", "BlockManager", name="queries_count_num_tokens")
class QueriesCountNumTokens(_BlindStart):
    def queries(self, seq, num_tokens):
        return self.lookup_blocks(num_tokens)  # the mistake: was `len(seq.all_ids)`


# WRONG: lookup_blocks ignores enable_prefix_caching (cached_prefix returns [] itself):
# queries counted without prefix caching
@blind_build("block_manager", "BlockManager", name="lookup_ignores_flag")
class LookupIgnoresFlag(_Blind):
    def lookup_blocks(self, num_tokens):
        # the mistake: `if not self.enable_prefix_caching: return 0` moved to cached_prefix
        return (num_tokens - 1) // self.kv_block_size

    def cached_prefix(self, token_ids):
        if not self.enable_prefix_caching:
            return []
        return super().cached_prefix(token_ids)


# WRONG: lookup_blocks = num_tokens // size: a prompt of whole blocks gets its last token's
# block served
@blind_build(
    "block_manager", "BlockManager", name="lookup_serves_last_block", known="serves_the_last_token"
)
class LookupServesLastBlock(_Blind):
    def lookup_blocks(self, num_tokens):
        if not self.enable_prefix_caching:
            return 0
        return num_tokens // self.kv_block_size  # the mistake: was `(num_tokens - 1)`


class _BlindGrow(_Blind):
    """grow, taking a free block when `take_free()` and evicting `evictable.popitem(last=
    self.newest_first)` otherwise."""

    newest_first = False

    def take_free(self):
        return bool(self.free_ids)

    def grow(self, seq, num_tokens):
        while len(seq.block_table) * self.kv_block_size < num_tokens:
            if self.take_free():
                block_id = self.free_ids.pop()
            else:
                block_id, _ = self.evictable.popitem(last=self.newest_first)
                block = self.blocks[block_id]
                del self.cached[block.hash]
                self.cache_version += 1
                block.hash, block.token_ids = None, ()
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)


# WRONG: evicts the most recently given back cached block (LIFO), not the least recent
@blind_build("block_manager", "BlockManager", name="evict_newest", known="evicts_the_newest")
class EvictNewest(_BlindGrow):
    newest_first = True  # the mistake: was `evictable.popitem(last=False)`


# WRONG: grow evicts a cached block first when any exists, before taking a free one
@blind_build("block_manager", "BlockManager", name="grow_prefers_evictable")
class GrowPrefersEvictable(_BlindGrow):
    def take_free(self):
        # the mistake: was `return bool(self.free_ids)`
        return bool(self.free_ids) and not self.evictable


# WRONG: num_used sums ref counts: a block shared by two tables counts twice
@blind_build("block_manager", "BlockManager", name="num_used_sums_refcounts")
class NumUsedSumsRefcounts(_Blind):
    @property
    def num_used(self):
        # the mistake: was `return self.num_blocks - self.num_free - len(self.evictable)`
        return sum(block.ref_count for block in self.blocks)


# WRONG: release gives blocks back first block first (the prefix's start is evicted before
# its end)
@blind_build("block_manager", "BlockManager", name="release_first_block_first")
class ReleaseFirstBlockFirst(_Blind):
    def release(self, seq):
        for block_id in seq.block_table:  # the mistake: was `reversed(seq.block_table)`
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


class _BlindAdvance(_Blind):
    """advance, keying blocks of `ids(seq)` up to `keyed_end(seq)` tokens, a block keyed
    when `free_to_key(block, key)`."""

    def ids(self, seq):
        return seq.all_ids

    def keyed_end(self, seq):
        return seq.num_computed_tokens

    def free_to_key(self, block, key):
        return block.hash is None and key not in self.cached

    def advance(self, seq, num_new):
        seq.num_computed_tokens += num_new
        if not self.enable_prefix_caching:
            return
        size = self.kv_block_size
        ids = self.ids(seq)
        while len(seq.block_hashes) < self.keyed_end(seq) // size:
            i = len(seq.block_hashes)
            tokens = tuple(ids[i * size : (i + 1) * size])
            key = chain_hash(seq.block_hashes[-1] if seq.block_hashes else b"", tokens)
            seq.block_hashes.append(key)
            block = self.blocks[seq.block_table[i]]
            if self.free_to_key(block, key):
                block.hash, block.token_ids = key, tokens
                self.cached[key] = block.block_id
                self.cache_version += 1


# WRONG: advance keys only blocks of the prompt; blocks filled by generated tokens never get
# keyed
@blind_build("block_manager", "BlockManager", name="register_prompt_only")
class RegisterPromptOnly(_BlindAdvance):
    def ids(self, seq):
        return seq.prompt_ids  # the mistake: was `seq.all_ids`

    def keyed_end(self, seq):
        # the mistake: was `return seq.num_computed_tokens`
        return min(seq.num_computed_tokens, len(seq.prompt_ids))


# WRONG: advance keys a block even when its key is cached already (the newer copy replaces
# the older in `cached`)
@blind_build("block_manager", "BlockManager", name="rekey_duplicate")
class RekeyDuplicate(_BlindAdvance):
    def free_to_key(self, block, key):
        return block.hash is None  # the mistake: `and key not in self.cached` left out


# == A whole module written another way (build_alternative's, not one piece: all) ==========
# Every class and function written afresh, as another learner would write the file;
# tests/course/test_builds.py asserts that it passes every part.

ALTERNATIVE_MODULE = """
import collections
import hashlib

from roseinfer.engine.block_manager import Block


def chain_hash(parent, token_ids):
    return hashlib.blake2b(repr((parent, tuple(token_ids))).encode()).digest()


class BlockManager:
    def __init__(self, num_blocks, kv_block_size, enable_prefix_caching):
        self.kv_block_size = kv_block_size
        self.caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids = collections.deque(range(num_blocks))
        self.cached = {}
        self.evictable = collections.OrderedDict()
        self.prefix_cache_queries = self.prefix_cache_hits = self.cache_version = 0

    num_blocks = property(lambda self: len(self.blocks))
    num_free = property(lambda self: len(self.free_ids))
    num_used = property(lambda self: sum(b.ref_count > 0 for b in self.blocks))

    def _full(self, n):
        return (n - 1) // self.kv_block_size if self.caching else 0

    def _blocks(self, n):
        return (n + self.kv_block_size - 1) // self.kv_block_size

    def cached_prefix(self, token_ids):
        out, key = [], b""
        for i in range(self._full(len(token_ids))):
            piece = tuple(token_ids[i * self.kv_block_size : (i + 1) * self.kv_block_size])
            key = chain_hash(key, piece)
            hit = self.cached.get(key)
            if hit is None or self.blocks[hit].token_ids != piece:
                return out
            out.append(hit)
        return out

    def can_start(self, cached_ids, num_tokens):
        room = len(self.free_ids) + len(self.evictable)
        room -= len([b for b in cached_ids if b in self.evictable])
        return self._blocks(num_tokens) - len(cached_ids) <= room

    def start(self, seq, cached_ids, num_tokens):
        self.prefix_cache_queries += self._full(len(seq.all_ids))
        self.prefix_cache_hits += len(cached_ids)
        for b in cached_ids:
            self.evictable.pop(b, None)
            self.blocks[b].ref_count += 1
        seq.block_table = list(cached_ids)
        seq.block_hashes = [self.blocks[b].hash for b in cached_ids]
        seq.num_computed_tokens = len(cached_ids) * self.kv_block_size
        if len(seq.output_ids) == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
        self.grow(seq, num_tokens)

    def can_grow(self, seq, num_tokens):
        missing = self._blocks(num_tokens) - len(seq.block_table)
        return missing <= len(self.free_ids) + len(self.evictable)

    def grow(self, seq, num_tokens):
        for _ in range(self._blocks(num_tokens) - len(seq.block_table)):
            if self.free_ids:
                b = self.free_ids.popleft()
            else:
                b = next(iter(self.evictable))
                del self.evictable[b]
                old = self.blocks[b]
                self.cached.pop(old.hash)
                old.hash, old.token_ids = None, ()
                self.cache_version += 1
            self.blocks[b].ref_count = 1
            seq.block_table.append(b)

    def release(self, seq):
        for b in seq.block_table[::-1]:
            block = self.blocks[b]
            block.ref_count -= 1
            if block.ref_count:
                continue
            if block.hash is None:
                self.free_ids.append(b)
            else:
                self.evictable[b] = None
        seq.block_table, seq.block_hashes, seq.num_computed_tokens = [], [], 0

    def advance(self, seq, num_new):
        seq.num_computed_tokens += num_new
        size = self.kv_block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // size):
            if not self.caching:
                return
            piece = tuple(seq.all_ids[i * size : (i + 1) * size])
            key = chain_hash(seq.block_hashes[i - 1] if i else b"", piece)
            seq.block_hashes.append(key)
            block = self.blocks[seq.block_table[i]]
            if key in self.cached or block.hash is not None:
                continue
            block.hash, block.token_ids = key, piece
            self.cached[key] = block.block_id
            self.cache_version += 1
"""
