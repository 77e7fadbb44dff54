"""Chapter 13's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

from collections.abc import Callable

from rosecourse.exercises.answers import alternative, blind, known, mutant
from rosecourse.exercises.ch13_cached_prefix import cached_prefix
from roseinfer.engine.block_manager import BlockManager, chain_hash

# -- the known mistakes: the check names each one it meets (answers.known) ----------


@known(
    "13",
    "your key is the block's tokens alone: the pool keys a block by its tokens and "
    "every token before it (chain the parent's hash), so only the first block is found",
)
def _unchained(manager, token_ids):
    from roseinfer.engine.block_manager import chain_hash

    found = []
    for i in range(manager.lookup_blocks(len(token_ids))):
        tokens = tuple(token_ids[i * manager.kv_block_size : (i + 1) * manager.kv_block_size])
        block_id = manager.cached.get(chain_hash(b"", tokens))
        if block_id is None:
            break
        found.append(block_id)
    return found


@known(
    "13",
    "you serve a prompt's last block even when it holds the last token: that token "
    "must be computed, its logits choose the first new token",
)
def _serves_the_last_token(manager, token_ids):
    # One more block than lookup_blocks allows when the prompt fills its blocks exactly.
    return cached_prefix(manager, [*token_ids, 0])


@known(
    "13",
    "you take a block on its key alone: a block found must also hold the prompt's "
    "tokens (manager.blocks[block_id].token_ids == tokens), as two blocks' keys can "
    "collide",
)
def _key_alone(manager, token_ids):
    found, parent = [], b""
    for i in range(manager.lookup_blocks(len(token_ids))):
        tokens = tuple(token_ids[i * manager.kv_block_size : (i + 1) * manager.kv_block_size])
        parent = chain_hash(parent, tokens)
        block_id = manager.cached.get(parent)
        if block_id is None:  # the mistake: the block's token_ids never compared
            break
        found.append(block_id)
    return found


# -- 13: cached_prefix(manager, token_ids) --------------------------------------------------


def _lookup(manager, token_ids, blocks: int, key: Callable, size: int | None = None):
    from roseinfer.engine.block_manager import chain_hash

    size = size or manager.kv_block_size
    found, parent = [], b""
    for i in range(blocks):
        tokens = tuple(token_ids[i * size : (i + 1) * size])
        parent = key(chain_hash, parent, tokens, token_ids[: (i + 1) * size])
        block_id = manager.cached.get(parent)
        if block_id is None or manager.blocks[block_id].token_ids != tokens:
            break
        found.append(block_id)
    return found


def _chained(chain_hash, parent, tokens, prefix):
    return chain_hash(parent, tokens)


@mutant("13")
def one_block_fewer(manager, token_ids):
    return _lookup(manager, token_ids, manager.lookup_blocks(len(token_ids)) - 1, _chained)


@mutant("13")
def blocks_of_four(manager, token_ids):
    blocks = (len(token_ids) - 1) // 4
    return _lookup(manager, token_ids, blocks, _chained, size=4)


@mutant("13")
def keyed_by_the_whole_prefix(manager, token_ids):
    blocks = manager.lookup_blocks(len(token_ids))
    return _lookup(manager, token_ids, blocks, lambda h, parent, t, prefix: h(b"", tuple(prefix)))


@mutant("13")
def parent_never_moves(manager, token_ids):
    from roseinfer.engine.block_manager import chain_hash

    found = []
    for i in range(manager.lookup_blocks(len(token_ids))):
        size = manager.kv_block_size
        tokens = tuple(token_ids[i * size : (i + 1) * size])
        block_id = manager.cached.get(chain_hash(chain_hash(b"", tuple(token_ids[:size])), tokens))
        if i and block_id is None:
            break
        found.append(manager.cached.get(chain_hash(b"", tokens)) if i == 0 else block_id)
    return [block for block in found if block is not None]


@mutant("13")
def last_block_dropped(manager, token_ids):
    return _lookup(manager, token_ids, manager.lookup_blocks(len(token_ids)), _chained)[:-1]


@mutant("13")
def first_block_only(manager, token_ids):
    return _lookup(manager, token_ids, min(manager.lookup_blocks(len(token_ids)), 1), _chained)


@mutant("13")
def skips_a_missing_block(manager, token_ids):
    # A block not found is skipped and the run goes on: a later block still cached after
    # its block 0 was evicted is served without the blocks before it.
    from roseinfer.engine.block_manager import chain_hash

    size, found, parent = manager.kv_block_size, [], b""
    for i in range(manager.lookup_blocks(len(token_ids))):
        tokens = tuple(token_ids[i * size : (i + 1) * size])
        parent = chain_hash(parent, tokens)
        block_id = manager.cached.get(parent)
        if block_id is not None and manager.blocks[block_id].token_ids == tokens:
            found.append(block_id)
    return found


@alternative("13")
def while_loop(manager, token_ids):
    from roseinfer.engine.block_manager import chain_hash

    size, key, found = manager.kv_block_size, b"", []
    while len(found) < manager.lookup_blocks(len(token_ids)):
        tokens = tuple(token_ids[len(found) * size : (len(found) + 1) * size])
        key = chain_hash(key, tokens)
        if key not in manager.cached or manager.blocks[manager.cached[key]].token_ids != tokens:
            return found
        found.append(manager.cached[key])
    return found


# -- Written blind (issue 45) --


def _blind_13(
    manager: BlockManager, token_ids, blocks: int, check_tokens=True, on_miss="stop"
) -> list[int]:
    size = manager.kv_block_size
    found: list[int] = []
    parent = b""
    for i in range(blocks):
        tokens = tuple(token_ids[i * size : (i + 1) * size])
        parent = chain_hash(parent, tokens)
        bid = manager.cached.get(parent)
        if bid is None or (check_tokens and manager.blocks[bid].token_ids != tokens):
            if on_miss == "skip":
                continue
            break
        found.append(bid)
    return found


# WRONG: looks up every full block (len // size), the last token's block included
@blind("13", known="serves_the_last_token")
def all_full_blocks(manager, token_ids):
    return _blind_13(manager, token_ids, len(token_ids) // manager.kv_block_size)


# WRONG: trusts the key alone: the block's token_ids never compared
@blind("13", known="key_alone")
def no_token_check(manager, token_ids):
    blocks = manager.lookup_blocks(len(token_ids))
    return _blind_13(manager, token_ids, blocks, check_tokens=False)


# WRONG: a block not found is skipped and the run goes on (no stop at the first miss)
@blind("13")
def skips_missing(manager, token_ids):
    return _blind_13(manager, token_ids, manager.lookup_blocks(len(token_ids)), on_miss="skip")
