"""Chapter 13: find a prompt's blocks in the prefix cache, by chained block hashes."""

from __future__ import annotations

from roseinfer.engine.block_manager import BlockManager, chain_hash


def cached_prefix(manager: BlockManager, token_ids: list[int]) -> list[int]:
    """Physical blocks that already hold the longest run of `token_ids`' first full blocks.

    The pool keys each full block it registered by `chain_hash(parent_key, block_tokens)`,
    where parent_key is the key of the block before it (b"" for the first), in
    `manager.cached` (key -> block id); `manager.blocks[id].token_ids` holds the tokens
    the block had when registered. A block is found when its key is there and its
    tokens are the prompt's; the run stops at the first block that is not found. The
    prompt's last token is never served (`manager.lookup_blocks(len(token_ids))` says how
    many blocks may be looked up). Nothing is taken here; `manager.kv_block_size` tokens a
    block.
    """
    found, parent = [], b""
    for i in range(manager.lookup_blocks(len(token_ids))):
        tokens = tuple(token_ids[i * manager.kv_block_size : (i + 1) * manager.kv_block_size])
        parent = chain_hash(parent, tokens)  # this block's key covers every token before it
        block_id = manager.cached.get(parent)
        if block_id is None or manager.blocks[block_id].token_ids != tokens:
            break
        found.append(block_id)
    return found


# `rose-course hint 13` gives these one at a time, the idea first and the near-code
# last (`rose-course check 13` counts how many were used); the stub leaves them out.
HINTS = (
    "A block's key covers its tokens and every token before it: block i's key is "
    "chain_hash(block i - 1's key, block i's tokens), b'' before block 0. Look the blocks "
    "up in order and stop at the first that is not there.",
    "Only manager.lookup_blocks(len(token_ids)) blocks may be looked up (never the block of "
    "the last token). A key that is found must also hold these tokens: "
    "manager.blocks[block_id].token_ids == tokens, a tuple.",
)
