"""The course's lessons: one exercise per chapter, its stub, its solution and its check.

A lesson is the piece a chapter is about. Its reference solution is a module of
`rosecourse/solutions/` (`chNN_name.py`) holding one function whose docstring is the
contract; the learner's stub is made from that module, with the body cut off after
the docstring, so the stub and the solution never disagree on the signature or the
contract. `rose-course` (rosecourse/cli.py) writes the stubs into a workspace and
grades the files there with the lesson's check.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from rosecourse.exercises import (
    ch00_causal_attention,
    ch01_greedy_decode,
    ch02_concat_kv,
    ch03_causal_mask,
    ch04_position_ids,
    ch05_top_p_filter,
    ch06_static_update,
    ch07_padded_position_ids,
    ch08_mask_slice,
    ch09_window_start,
    ch10_decode_read_bytes,
    ch11_slot_mapping,
    ch12_schedule,
    ch13_cached_prefix,
    ch14_held_back,
    ch15_export_prepare,
    ch16_stage_forward,
    ch17_quantize,
    ch18_rolling_slot,
)
from rosecourse.exercises.common import CheckResult


class CourseError(Exception):
    """A workspace problem a learner can fix, in one line."""


@dataclass(frozen=True)
class Lesson:
    chapter: str  # "02"
    name: str  # the function to write, and the solution module's suffix
    task: str  # one line: what to write
    check: Callable[[Callable], CheckResult]

    @property
    def file_name(self) -> str:
        return f"ch{self.chapter}_{self.name}.py"

    def solution_module(self) -> ModuleType:
        return importlib.import_module(f"rosecourse.solutions.ch{self.chapter}_{self.name}")

    def solution(self) -> Callable:
        return getattr(self.solution_module(), self.name)


LESSONS = [
    Lesson(
        "00",
        "causal_attention",
        "the causal self-attention of a training step",
        ch00_causal_attention.check_causal_attention,
    ),
    Lesson(
        "01", "greedy_decode", "the uncached greedy loop", ch01_greedy_decode.check_greedy_decode
    ),
    Lesson(
        "02", "concat_kv", "keep the past keys/values, add the new", ch02_concat_kv.check_concat_kv
    ),
    Lesson(
        "03",
        "causal_mask",
        "the causal mask of a call with a past",
        ch03_causal_mask.check_causal_mask,
    ),
    Lesson(
        "04",
        "position_ids",
        "the positions of new tokens after a past",
        ch04_position_ids.check_position_ids,
    ),
    Lesson("05", "top_p_filter", "nucleus (top-p) filtering", ch05_top_p_filter.check_top_p_filter),
    Lesson(
        "06",
        "static_update",
        "the static cache's in-place write",
        ch06_static_update.check_static_update,
    ),
    Lesson(
        "07",
        "padded_position_ids",
        "per-row positions of a left-padded batch",
        ch07_padded_position_ids.check_padded_position_ids,
    ),
    Lesson(
        "08", "mask_slice", "a chunk's rows of a precomputed mask", ch08_mask_slice.check_mask_slice
    ),
    Lesson(
        "09",
        "window_start",
        "the window policy past the context",
        ch09_window_start.check_window_start,
    ),
    Lesson(
        "10",
        "decode_read_bytes",
        "the bytes one decode step must read",
        ch10_decode_read_bytes.check_decode_read_bytes,
    ),
    Lesson(
        "11",
        "slot_mapping",
        "each token's slot in the paged pool",
        ch11_slot_mapping.check_slot_mapping,
    ),
    Lesson(
        "12",
        "schedule",
        "the scheduler's decision for one step",
        ch12_schedule.check_schedule,
    ),
    Lesson(
        "13",
        "cached_prefix",
        "the prefix cache's lookup by chained block hash",
        ch13_cached_prefix.check_cached_prefix,
    ),
    Lesson(
        "14",
        "held_back",
        "the stream's stop-string hold-back",
        ch14_held_back.check_held_back,
    ),
    Lesson(
        "15",
        "export_prepare",
        "the exported graph's positions and mask, shapes kept symbolic",
        ch15_export_prepare.check_export_prepare,
    ),
    Lesson(
        "16",
        "stage_forward",
        "one pipeline stage's share of a model call",
        ch16_stage_forward.check_stage_forward,
    ),
    Lesson(
        "17",
        "quantize",
        "group quantization (keys per channel, values per token)",
        ch17_quantize.check_quantize,
    ),
    Lesson(
        "18",
        "rolling_slot",
        "the rolling cache's slot for each position (sinks kept, the window modulo W)",
        ch18_rolling_slot.check_rolling_slot,
    ),
]


def lesson(chapter: str) -> Lesson:
    """The lesson of chapter `chapter` ("2", "02")."""
    number = chapter.zfill(2)
    for candidate in LESSONS:
        if candidate.chapter == number:
            return candidate
    chapters = ", ".join(c.chapter for c in LESSONS)
    raise CourseError(f"no exercise for chapter {chapter!r}: choose one of {chapters}, or all")


# ---------------------------------------------------------------------------
# Stubs: the solution with its body cut off after the docstring
# ---------------------------------------------------------------------------


def stub_source(chosen: Lesson) -> str:
    """The learner's starting file: the solution module as it is up to the function (its
    docstring and imports), then the function's signature and contract, raising
    NotImplementedError."""
    source = inspect.getsource(chosen.solution_module())
    lines = source.splitlines()
    (function,) = (
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef) and node.name == chosen.name
    )
    contract = function.body[0]
    assert isinstance(contract, ast.Expr), f"{chosen.file_name}: no contract docstring"
    indent = " " * contract.col_offset
    stub = [
        *lines[: contract.end_lineno],
        f'{indent}raise NotImplementedError("write {chosen.name}")',
    ]
    return "\n".join(stub) + "\n"


def write_workspace(directory: Path, solutions: bool) -> list[Path]:
    """One file per lesson in `directory`: the stubs, or the reference solutions. Files that
    are there already are kept (a learner's work is never overwritten)."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for chosen in LESSONS:
        path = directory / chosen.file_name
        if path.exists():
            continue
        text = inspect.getsource(chosen.solution_module()) if solutions else stub_source(chosen)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


# ---------------------------------------------------------------------------
# Grading a workspace file
# ---------------------------------------------------------------------------


def load_learner(chosen: Lesson, directory: Path) -> Callable:
    """The learner's function from `directory`, or a CourseError saying what is wrong."""
    path = directory / chosen.file_name
    if not path.is_file():
        raise CourseError(
            f"{path} does not exist: run `rose-course start {directory}` first (or pass --dir)"
        )
    spec = importlib.util.spec_from_file_location(f"rose_course_{chosen.file_name[:-3]}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        raise CourseError(f"{path}:{error.lineno}: syntax error: {error.msg}") from None
    except Exception as error:  # anything the learner's module raises on import
        raise CourseError(f"{path} does not import: {type(error).__name__}: {error}") from None
    fn = getattr(module, chosen.name, None)
    if not callable(fn):
        raise CourseError(f"{path} has no function {chosen.name}: keep the stub's name")
    return fn


def grade(chosen: Lesson, directory: Path) -> CheckResult:
    """Check the learner's file for `chosen`; a file that cannot be loaded fails in one line."""
    try:
        fn = load_learner(chosen, directory)
    except CourseError as error:
        result = CheckResult(chosen.name, False, None, str(error))
    else:
        try:
            return chosen.check(fn)
        except Exception as error:  # the check tripped over the learner's code itself
            message = str(error).splitlines()[0] if str(error) else ""
            why = f"your function broke the check: {type(error).__name__}: {message}"
            result = CheckResult(chosen.name, False, None, why)
    print(result)
    return result
