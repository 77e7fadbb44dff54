"""Chapter 11's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

import torch

from rosecourse.exercises.answers import alternative, blind, known, mutant

# -- the known mistakes: the check names each one it meets (answers.known) ----------


@known(
    "11",
    "the slot is the position, as in the static cache: every sequence writes slots "
    "0, 1, 2, ... over the others' keys; go through the sequence's block table",
)
def _position_as_slot(block_tables, seq_of_token, positions, kv_block_size):
    return positions


@known(
    "11",
    "the block size is a constant (4) in your code: the pool's blocks hold "
    "kv_block_size slots, whatever the engine was given",
)
def _fixed_block_size(block_tables, seq_of_token, positions, kv_block_size):
    return block_tables[seq_of_token, positions // 4] * 4 + positions % 4


@known(
    "11",
    "you never look at the block table: a logical slot is not a physical one "
    "(the pool hands blocks out in any order)",
)
def _logical_slots(block_tables, seq_of_token, positions, kv_block_size):
    return seq_of_token * block_tables.size(1) * kv_block_size + positions


@known(
    "11",
    "the offset inside the block is the whole position (no % kv_block_size): every "
    "token past the first block lands in some other block",
)
def _position_as_offset(block_tables, seq_of_token, positions, kv_block_size):
    return block_tables[seq_of_token, positions // kv_block_size] * kv_block_size + positions


@known(
    "11",
    "every token uses the first sequence's block table: pick the row of the token's own sequence",
)
def _first_table(block_tables, seq_of_token, positions, kv_block_size):
    return block_tables[0, positions // kv_block_size] * kv_block_size + positions % kv_block_size


@known(
    "11",
    "// and % are swapped: the block index is position // kv_block_size, the offset "
    "position % kv_block_size",
)
def _swapped_division(block_tables, seq_of_token, positions, kv_block_size):
    return (
        block_tables[seq_of_token, positions % kv_block_size] * kv_block_size
        + positions // kv_block_size
    )


# -- 11: slot_mapping(block_tables, seq_of_token, positions, kv_block_size) -----------------


@mutant("11")
def offset_one_late(block_tables, seq_of_token, positions, kv_block_size):
    block = block_tables[seq_of_token, positions // kv_block_size]
    return block * kv_block_size + (positions + 1) % kv_block_size


@mutant("11")
def next_logical_block(block_tables, seq_of_token, positions, kv_block_size):
    logical = (positions // kv_block_size + 1).clamp(max=block_tables.size(1) - 1)
    return block_tables[seq_of_token, logical] * kv_block_size + positions % kv_block_size


@mutant("11")
def blocks_as_wide_as_the_table(block_tables, seq_of_token, positions, kv_block_size):
    block = block_tables[seq_of_token, positions // kv_block_size]
    return block * block_tables.size(1) + positions % kv_block_size


@mutant("11")
def block_rounded_up(block_tables, seq_of_token, positions, kv_block_size):
    logical = torch.ceil(positions / kv_block_size).long().clamp(max=block_tables.size(1) - 1)
    return block_tables[seq_of_token, logical] * kv_block_size + positions % kv_block_size


@mutant("11")
def first_block_then_contiguous(block_tables, seq_of_token, positions, kv_block_size):
    return block_tables[seq_of_token, 0] * kv_block_size + positions


@mutant("11")
def block_size_from_the_table(block_tables, seq_of_token, positions, kv_block_size):
    size = block_tables.size(1)
    return block_tables[seq_of_token, positions // size] * size + positions % size


@alternative("11")
def table_indexed_block_first(block_tables, seq_of_token, positions, kv_block_size):
    block = block_tables.T[positions // kv_block_size, seq_of_token]
    return block * kv_block_size + positions % kv_block_size


@alternative("11")
def divmod_then_gather(block_tables, seq_of_token, positions, kv_block_size):
    logical, offset = (
        torch.div(positions, kv_block_size, rounding_mode="floor"),
        positions.remainder(kv_block_size),
    )
    rows = block_tables.index_select(0, seq_of_token)
    return rows.gather(1, logical[:, None])[:, 0] * kv_block_size + offset


# -- Written blind (issue 45) --


# WRONG: assumes a sequence's blocks are contiguous: its first block plus the position
@blind("11")
def contiguous_blocks(block_tables, seq_of_token, positions, kv_block_size):
    first = block_tables[seq_of_token, 0]
    return first.long() * kv_block_size + positions


# WRONG: offset by the block index and block by the offset (// and % swapped)
@blind("11", known="swapped_division")
def div_mod_swapped(block_tables, seq_of_token, positions, kv_block_size):
    blocks = block_tables[seq_of_token, positions % kv_block_size]
    return blocks.long() * kv_block_size + positions // kv_block_size
