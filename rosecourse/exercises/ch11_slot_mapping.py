"""Chapter 11's exercise: each token's slot in the paged pool. The learner's function replaces
roseinfer.cache.paged.slot_mapping inside the engine.

The contract is the docstring of rosecourse/solutions/ch11_slot_mapping.py.
"""

from __future__ import annotations

from collections.abc import Callable
from unittest import mock

import torch

from rosecourse.exercises.common import (
    CheckResult,
    Exercise,
    KnownWrong,
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


def _slot_probe(fn: Callable) -> list[object]:
    tables = torch.tensor([[5, 2, 7], [3, 0, 0]])
    seq_of_token = torch.tensor([0, 0, 0, 0, 1, 1])
    positions = torch.tensor([0, 3, 4, 9, 0, 2])
    return [outcome(lambda: fn(tables, seq_of_token, positions, 4))]


def _slot_workload() -> list[tuple[list[int], SamplingParams]]:
    return [(list(p), greedy()) for p in chapter_prompts()]


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
    runs=engine_runs(_slot_workload, None, "", num_kv_blocks=40),
    known_wrong=[
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
