"""Chapter 11's exercise: each token's slot in the paged pool.

The learner's function replaces roseinfer.cache.paged.slot_mapping inside the engine.

The contract is the docstring of rosecourse/exercises/ch11_slot_mapping/reference.py.
"""

from __future__ import annotations

from collections.abc import Callable
from unittest import mock

import torch

from rosecourse.exercises.answers import known_mistakes
from rosecourse.exercises.common import (
    CheckResult,
    Exercise,
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


EXERCISE = Exercise(
    name="slot_mapping",
    reference=slot_mapping,
    probe=_slot_probe,
    swapped_in=lambda fn: mock.patch("roseinfer.cache.paged.slot_mapping", fn),
    runs=engine_runs(_slot_workload, None, "", kv_block_size=4, num_kv_blocks=40)
    + engine_runs(_slot_workload, None, "", kv_block_size=3, num_kv_blocks=48)
    + engine_runs(_slot_workload, None, "", kv_block_size=16, num_kv_blocks=12),
    known_wrong=known_mistakes(__name__),
    fallback="some token is written to or read from a slot that is not its own",
)


def check_slot_mapping(fn: Callable) -> CheckResult:
    """Chapter 11: `slot_mapping(block_tables, seq_of_token, positions, kv_block_size) -> slots`."""
    return check(EXERCISE, fn)
