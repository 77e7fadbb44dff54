"""The chapters' exercise checks: a right answer passes, each known wrong answer is caught
at its first divergent step with its own explanation, an unknown one with the fallback."""

from __future__ import annotations

import importlib

import pytest
import torch

from rosecourse.exercises import (
    ch02_concat_kv,
    ch03_causal_mask,
    ch04_position_ids,
    ch05_top_p_filter,
    ch06_static_update,
    ch07_padded_position_ids,
    ch08_mask_slice,
    ch09_window_start,
    ch18_rolling_slot,
    ch21_grouped_attention,
)
from rosecourse.exercises.ch02_concat_kv import reference as solution02
from rosecourse.exercises.ch03_causal_mask import reference as solution03
from rosecourse.exercises.ch04_position_ids import reference as solution04
from rosecourse.exercises.ch05_top_p_filter import reference as solution05
from rosecourse.exercises.ch06_static_update import reference as solution06
from rosecourse.exercises.ch07_padded_position_ids import reference as solution07
from rosecourse.exercises.ch08_mask_slice import reference as solution08
from rosecourse.exercises.ch09_window_start import reference as solution09
from rosecourse.exercises.ch18_rolling_slot import reference as solution18
from rosecourse.exercises.ch21_grouped_attention import reference as solution21

SOLUTIONS = [
    (ch02_concat_kv.check_concat_kv, solution02.concat_kv),
    (ch03_causal_mask.check_causal_mask, solution03.causal_mask),
    (ch04_position_ids.check_position_ids, solution04.position_ids),
    (ch05_top_p_filter.check_top_p_filter, solution05.top_p_filter),
    (ch06_static_update.check_static_update, solution06.static_update),
    (ch07_padded_position_ids.check_padded_position_ids, solution07.padded_position_ids),
    (ch08_mask_slice.check_mask_slice, solution08.mask_slice),
    (ch09_window_start.check_window_start, solution09.window_start),
    (ch18_rolling_slot.check_rolling_slot, solution18.rolling_slot),
    (ch21_grouped_attention.check_grouped_attention, solution21.grouped_attention),
]

# The first step each known wrong answer parts from the reference on the oracle model
# (None: every step matches, and only the small inputs give it away).
FIRST_DIVERGENT_STEP = {
    # 18: the sinks are overwritten once 6 prompt + 9 new tokens pass the 10 slots; a
    # single slot loses the window at the first decode step.
    "modulo_all_slots": 9,
    "sinks_share_the_window": 9,
    "last_slot_only": 1,
    "lose_past_kv": 1,  # the prefill has no past to lose; the first decode step does
    "new_only": 1,
    "new_first": 1,  # order-free for one decode query, but not for a left-padded row
    "along_heads": 1,
    "top_left": 1,  # the first decode query sees key 0 only
    "square": 0,  # passes one-token steps; the second prefill chunk has a past
    "open": 2,  # a batch prefills under the mask: its earlier queries see later keys
    "strict": 8,
    "from_zero": 1,
    "one_too_far": 0,
    "all_at_past_len": 0,
    "on_the_cpu": None,  # the runs are on the CPU: only the meta-device input tells
    "drops_crossing": 12,  # the first step whose top token alone holds more than p
    "sorted_not_scattered": 0,
    "mass_of_logits": 0,
    "at_slot_zero": 2,
    "into_a_copy": 1,  # the prefill sees its own keys; the next call finds the slots empty
    "never_written": 1,
    "first_row_only": 1,  # the batch's row 1 (row 0 is right)
    "counting_padding": 0,
    "from_one": 0,
    "unclamped": 0,
    "nanogpt": 0,
    "top_rows": 1,
    "every_column": 1,
    # 8 prompt tokens in a 64-token window: the first cut is due at step 57
    "slides": 57,
    "a_step_early": 56,
    "measures_the_sequence": 58,
    "never_cuts": 57,
    # 21: every decode step is the learner's attention; a mask-blind one reads the static
    # cache's empty slots at once, and scores overflow only in the probe's large ones.
    "heads_in_wrong_order": 1,
    "values_tiled": 1,
    "queries_regrouped_wrong": 1,
    "scaled_by_group_width": 1,
    "scaled_by_n_embd": 1,
    "softmax_over_group": 1,
    "group_mean_query": 1,
    "no_max_subtraction": None,
    "mask_ignored": 1,
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Tiny models: one intra-op thread (see conftest)."""


@pytest.mark.slow
@pytest.mark.parametrize(("check", "solution"), SOLUTIONS, ids=lambda x: x.__name__)
def test_reference_solution_passes(check, solution) -> None:
    result = check(solution)
    assert result.passed, str(result)
    assert result.step is None


WRONG = [
    (check, wrong)
    for check, solution in SOLUTIONS
    for wrong in importlib.import_module(check.__module__).EXERCISE.known_wrong
]


def test_every_known_wrong_answer_has_an_expected_step() -> None:
    assert sorted(wrong.name for _, wrong in WRONG) == sorted(FIRST_DIVERGENT_STEP)


@pytest.mark.parametrize(("check", "wrong"), WRONG, ids=[w.name for _, w in WRONG])
def test_known_wrong_answer_is_caught_with_its_step_and_explanation(check, wrong) -> None:
    result = check(wrong.fn)
    assert not result.passed
    assert result.step == FIRST_DIVERGENT_STEP[wrong.name], str(result)
    assert wrong.explanation in result.explanation, str(result)
    if result.step is None:  # caught by the small inputs: it says which and what is right
        assert "every step matches, but on" in result.explanation, str(result)
        assert "is right" in result.explanation, str(result)


def test_a_stub_fails_where_it_is_first_called_and_says_so() -> None:
    def causal_mask(q_len: int, kv_len: int, device=None) -> torch.Tensor:
        raise NotImplementedError("write the mask")

    result = ch03_causal_mask.check_causal_mask(causal_mask)
    # A prefill without a past never asks for the mask; the first decode step does.
    assert not result.passed and result.step == 1
    assert result.explanation.startswith("not written yet")
    assert "raised NotImplementedError: write the mask" in result.explanation


def test_an_unknown_wrong_answer_gets_the_exercise_own_explanation() -> None:
    def off_by_two(past_len: int, q_len: int, device=None) -> torch.Tensor:
        return torch.arange(past_len + 2, past_len + q_len + 2, device=device)

    result = ch04_position_ids.check_position_ids(off_by_two)
    assert not result.passed and result.step == 0
    assert result.explanation.startswith(ch04_position_ids.EXERCISE.fallback)
    assert str(result).startswith("position_ids: FAILED at step 0 (the prefill's token): ")


def test_a_broken_pool_says_which_invariant_and_after_which_step(monkeypatch) -> None:
    from rosecourse.exercises import engine
    from roseinfer.engine.block_manager import BlockManager, check_pool

    # Block 3 evictable under a key the prefix cache maps to block 2: check_pool's reason.
    manager = BlockManager(4, 2)
    manager.free_ids.remove(3)
    manager.blocks[3].hash = b"key"
    manager.evictable[3] = None
    manager.cached[b"key"] = 2
    with pytest.raises(AssertionError, match="maps that key to 2"):
        check_pool(manager, [])

    # An engine exercise's run says it in one sentence: after which step, which invariant.
    def broken(*args: object) -> None:
        raise AssertionError("block 1: ref_count 2, held by 1 table(s)")

    monkeypatch.setattr(engine, "check_pool", broken)
    requests = [(list(engine.chapter_prompts()[0]), engine.greedy(2))]
    with pytest.raises(engine.PoolBroken) as raised:
        engine.drive(engine.make_engine(), requests, lambda *_: None)
    assert str(raised.value) == (
        "after engine step 0, the pool's invariants break: block 1: ref_count 2, held by 1 table(s)"
    )
