"""Chapter 11: where each token's keys/values live in the paged pool."""

from __future__ import annotations

import torch

# The reference is rose's own piece (roseinfer/cache/paged.py); the stub leaves this import out,
# with the body below.
from roseinfer.cache.paged import slot_mapping as rose_slot_mapping


def slot_mapping(
    block_tables: torch.Tensor,
    seq_of_token: torch.Tensor,
    positions: torch.Tensor,
    kv_block_size: int,
) -> torch.Tensor:
    """The pool slot of each token: (num_tokens,) long.

    block_tables: (num_seqs, max_blocks) physical block ids, one row per sequence (its
    logical block i is physical block block_tables[seq, i]); seq_of_token and positions:
    (num_tokens,), each token's sequence (a row of block_tables) and its position in
    that sequence. The pool numbers its slots block after block, kv_block_size slots each.
    The engine calls this for the tokens it writes and for the keys it reads.
    """
    return rose_slot_mapping(block_tables, seq_of_token, positions, kv_block_size)


# `rose-course hint 11` gives these one at a time, the idea first and the near-code
# last (`rose-course check 11` counts how many were used); the stub leaves them out.
HINTS = (
    "Token t of a sequence lives in its logical block t // kv_block_size, at offset t % "
    "kv_block_size; the sequence's block table says which physical block that is.",
    "block_tables[seq_of_token, logical_block] picks every token's physical block at once "
    "(one row and one column index per token); its slot is physical_block * kv_block_size + "
    "offset.",
)
