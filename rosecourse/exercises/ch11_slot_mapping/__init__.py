"""Chapter 11's exercise: each token's slot in the paged pool.

The learner's function replaces roseinfer.cache.paged.slot_mapping inside the engine.

The contract is the docstring of rosecourse/exercises/ch11_slot_mapping/reference.py.
"""

from __future__ import annotations

from collections.abc import Callable
from unittest import mock

import torch

from rosecourse.exercises.common import (
    CheckResult,
    Exercise,
    KnownWrong,
    Probe,
    check,
    outcome,
)
from rosecourse.exercises.engine import (
    chapter_prompts,
    engine_runs,
    greedy,
)
from roseinfer.cache.paged import slot_mapping
from roseinfer.request.sampling import SamplingParams

# Tokens per KV block: the chapter's 4, one that is not a power of two, the engine's default.
BLOCK_SIZES = (4, 3, 16)


def _slot_probe(fn: Callable) -> Probe:
    """Two sequences' tokens in shuffled blocks: each block's first and last slots, and a
    token of the second sequence between the first's."""
    tables = torch.tensor([[5, 2, 7], [3, 6, 1]])
    seq_of_token = torch.tensor([0, 0, 0, 1, 0, 0, 1, 1])
    probe: Probe = {}
    for size in BLOCK_SIZES:
        positions = torch.tensor([0, 1, size - 1, 0, size, 2 * size + 1, size + 1, 3 * size - 1])
        call = (
            f"slot_mapping({tables.tolist()}, seq_of_token={seq_of_token.tolist()}, "
            f"positions={positions.tolist()}, kv_block_size={size})"
        )
        probe[call] = outcome(lambda p=positions, s=size: fn(tables, seq_of_token, p, s))
    return probe


def _slot_workload() -> list[tuple[list[int], SamplingParams]]:
    return [(list(p), greedy()) for p in chapter_prompts()]


def _position_as_slot(block_tables, seq_of_token, positions, kv_block_size):
    return positions


def _fixed_block_size(block_tables, seq_of_token, positions, kv_block_size):
    return block_tables[seq_of_token, positions // 4] * 4 + positions % 4


def _logical_slots(block_tables, seq_of_token, positions, kv_block_size):
    return seq_of_token * block_tables.size(1) * kv_block_size + positions


def _position_as_offset(block_tables, seq_of_token, positions, kv_block_size):
    return block_tables[seq_of_token, positions // kv_block_size] * kv_block_size + positions


def _first_table(block_tables, seq_of_token, positions, kv_block_size):
    return block_tables[0, positions // kv_block_size] * kv_block_size + positions % kv_block_size


def _swapped_division(block_tables, seq_of_token, positions, kv_block_size):
    return (
        block_tables[seq_of_token, positions % kv_block_size] * kv_block_size
        + positions // kv_block_size
    )


EXERCISE = Exercise(
    name="slot_mapping",
    reference=slot_mapping,
    probe=_slot_probe,
    swapped_in=lambda fn: mock.patch("roseinfer.cache.paged.slot_mapping", fn),
    runs=engine_runs(_slot_workload, None, "", kv_block_size=4, num_kv_blocks=40)
    + engine_runs(_slot_workload, None, "", kv_block_size=3, num_kv_blocks=48)
    + engine_runs(_slot_workload, None, "", kv_block_size=16, num_kv_blocks=12),
    known_wrong=[
        KnownWrong(
            "position_as_slot",
            _position_as_slot,
            "the slot is the position, as in the static cache: every sequence writes slots "
            "0, 1, 2, ... over the others' keys; go through the sequence's block table",
        ),
        KnownWrong(
            "fixed_block_size",
            _fixed_block_size,
            "the block size is a constant (4) in your code: the pool's blocks hold "
            "kv_block_size slots, whatever the engine was given",
        ),
        KnownWrong(
            "logical_slots",
            _logical_slots,
            "you never look at the block table: a logical slot is not a physical one "
            "(the pool hands blocks out in any order)",
        ),
        KnownWrong(
            "position_as_offset",
            _position_as_offset,
            "the offset inside the block is the whole position (no % kv_block_size): every "
            "token past the first block lands in some other block",
        ),
        KnownWrong(
            "first_table",
            _first_table,
            "every token uses the first sequence's block table: pick the row of the "
            "token's own sequence",
        ),
        KnownWrong(
            "swapped_division",
            _swapped_division,
            "// and % are swapped: the block index is position // kv_block_size, the offset "
            "position % kv_block_size",
        ),
    ],
    fallback="some token is written to or read from a slot that is not its own",
)


def check_slot_mapping(fn: Callable) -> CheckResult:
    """Chapter 11: `slot_mapping(block_tables, seq_of_token, positions, kv_block_size) -> slots`."""
    return check(EXERCISE, fn)
