"""The course's lessons and builds: each one's stub, its solution and its check.

A lesson is the piece a chapter is about. Its reference solution is a module of
`rosecourse/solutions/` (`chNN_name.py`) holding one function whose docstring is the
contract; the learner's stub is made from that module, with the body cut off after
the docstring, so the stub and the solution never disagree on the signature or the
contract. A build (rosecourse/builds/) is one of rose's main pieces written whole: its
solution (`build_name.py`) holds classes and functions, and its stub keeps every one of
them with its body cut off after the docstring. `rose-course` (rosecourse/cli.py)
writes the stubs into a workspace and grades the files there with the lesson's check,
or the build's parts, each in a process of its own (rosecourse/runner.py).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from rosecourse.builds.block_manager import BLOCK_MANAGER
from rosecourse.builds.cached_loop import CACHED_LOOP
from rosecourse.builds.grading import Build, check_build
from rosecourse.builds.model import MODEL
from rosecourse.builds.training_step import TRAINING_STEP
from rosecourse.builds.verify import VERIFY
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
    ch20_choice_mask,
)
from rosecourse.exercises.common import CheckResult
from rosetrainer.errors import RoseError, one_line
from rosetrainer.files import ensure_writable_dir, write_bytes_atomically


class CourseError(RoseError):
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
    Lesson(
        "20",
        "choice_mask",
        "the allowed-token mask of a choice constraint",
        ch20_choice_mask.check_choice_mask,
    ),
]


# Rose's main pieces, written whole (rosecourse/builds/), in the order the chapters meet them.
BUILDS: list[Build] = [MODEL, TRAINING_STEP, CACHED_LOOP, BLOCK_MANAGER, VERIFY]


def lesson(chapter: str) -> Lesson:
    """The lesson of chapter `chapter` ("2", "02")."""
    # Only digits are padded: "".zfill(2) is "00", and an empty argument is no chapter.
    number = chapter.zfill(2) if chapter.isascii() and chapter.isdigit() else chapter
    for candidate in LESSONS:
        if candidate.chapter == number:
            return candidate
    chapters = ", ".join(c.chapter for c in LESSONS)
    builds = ", ".join(b.name for b in BUILDS)
    raise CourseError(
        f"no exercise for chapter {chapter!r}: choose one of {chapters}, a build ({builds}), or all"
    )


def key(chosen: Lesson | Build) -> str:
    """What `rose-course check` calls it: a chapter exercise's number, a build's name."""
    return chosen.name if isinstance(chosen, Build) else chosen.chapter


def find(name: str) -> Lesson | Build:
    """A build by its name ("model"), or the lesson of a chapter number ("2", "02")."""
    for build in BUILDS:
        if build.name == name:
            return build
    if not (name.isascii() and name.isdigit()):
        builds = ", ".join(b.name for b in BUILDS)
        raise CourseError(
            f"no build or chapter called {name!r}: choose a build ({builds}), a chapter's "
            "number (as `rose-course list` shows), or all"
        )
    return lesson(name)


# ---------------------------------------------------------------------------
# Stubs: the solution with its body cut off after the docstring
# ---------------------------------------------------------------------------


def stub_source(chosen: Lesson | Build) -> str:
    """The learner's starting file: the solution module with the body of every function
    and method cut off after its docstring (the signature and the contract stay), each
    raising NotImplementedError; everything else (imports, constants) as it is."""
    source = inspect.getsource(chosen.solution_module())
    lines = source.splitlines()
    cuts = []  # (first line, last line, indent, name) of each body, 1-based
    nodes = [(node, "") for node in ast.parse(source).body]
    while nodes:
        node, owner = nodes.pop()
        if isinstance(node, ast.ClassDef):
            nodes += [(child, f"{node.name}.") for child in node.body]
        elif isinstance(node, ast.FunctionDef):
            contract = node.body[0]
            assert isinstance(contract, ast.Expr) and isinstance(contract.value, ast.Constant), (
                f"{chosen.file_name}: {owner}{node.name} has no contract docstring"
            )
            indent = " " * contract.col_offset
            cuts.append((contract.end_lineno + 1, node.end_lineno, indent, owner + node.name))
    for first, last, indent, name in sorted(cuts, reverse=True):
        lines[first - 1 : last] = [f'{indent}raise NotImplementedError("write {name}")']
    return "\n".join(lines) + "\n"


# Where `start` notes the sha256 of each stub it wrote, so that a later `start` can tell a
# stub nobody has touched (of this rose or of an earlier one) from a learner's work.
STUB_RECORD = ".rose-course-stubs.json"


def write_workspace(directory: Path, solutions: bool) -> tuple[list[Path], list[Path]]:
    """One file per lesson in `directory`: the stubs, or the reference solutions; returns
    the files written and the learner's files kept (a file that holds the text already is
    neither).

    A learner's work is never overwritten: a file already there is replaced only when it
    holds nothing of theirs (`holds_no_work`). Every file is written atomically (a
    temporary file, fsync, rename), so a full disk leaves no empty or half stub behind,
    only a one-line error naming the file.
    """
    ensure_writable_dir(directory, "workspace")
    record = read_stub_record(directory)
    to_write, kept = [], []
    for chosen in [*LESSONS, *BUILDS]:  # every path is checked before anything is written
        path = directory / chosen.file_name
        stub = stub_source(chosen).encode()
        text = inspect.getsource(chosen.solution_module()).encode() if solutions else stub
        if path.exists() and not path.is_file():
            raise not_a_file(path, directory)
        old = path.read_bytes() if path.is_file() else b""
        if old == text:
            continue  # there already (and no space needed to write it again)
        if holds_no_work(old, text, {sha256(stub), record.get(chosen.file_name)}):
            to_write.append((path, text))
        else:
            kept.append(path)
    for path, text in to_write:
        write_bytes_atomically(path, text)
        if solutions:
            record.pop(path.name, None)
        else:
            record[path.name] = sha256(text)
    if to_write:
        write_bytes_atomically(directory / STUB_RECORD, json.dumps(record, indent=1).encode())
    return [path for path, _ in to_write], kept


def holds_no_work(old: bytes, new: bytes, stubs: set[str | None]) -> bool:
    """Whether a workspace file holds nothing a learner wrote: it is blank, or a beginning of
    the text about to be written (what an interrupted write leaves), or byte for byte a stub
    (`stubs`: the sha256 of this rose's stub and of the one `start` last wrote there)."""
    return not old.strip() or new.startswith(old) or sha256(old) in stubs


def read_stub_record(directory: Path) -> dict[str, str]:
    """The workspace's record of the stubs written there; none if it is missing or damaged
    (it is only a hint: without it, a stub of an earlier rose is kept like a learner's file)."""
    try:
        record = json.loads((directory / STUB_RECORD).read_bytes())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def not_a_file(path: Path, directory: Path) -> CourseError:
    """The one line for a folder (or anything but a file) where a chapter's file belongs."""
    return CourseError(
        f"{path} is not a file (a folder of that name?): move it away, then "
        f"`rose-course start {directory}` writes the chapter's stub there"
    )


# ---------------------------------------------------------------------------
# Grading a workspace file
# ---------------------------------------------------------------------------


def learner_file(chosen: Lesson | Build, directory: Path) -> Path:
    """The path of the learner's file for `chosen`, or a CourseError: it is missing or not
    a file."""
    path = directory / chosen.file_name
    if path.is_file():
        return path
    if path.exists():
        raise not_a_file(path, directory)
    raise CourseError(
        f"{path} does not exist: run `rose-course start {directory}` first (or pass --dir)"
    )


def load_module(chosen: Lesson | Build, directory: Path) -> ModuleType:
    """The learner's module from `directory`, or a CourseError saying what is wrong."""
    path = learner_file(chosen, directory)
    spec = importlib.util.spec_from_file_location(f"rose_course_{chosen.file_name[:-3]}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        raise CourseError(f"{path}:{error.lineno}: syntax error: {error.msg}") from None
    except Exception as error:  # anything the learner's module raises on import
        raise CourseError(f"{path} does not import: {one_line(error)}") from None
    return module


def load_learner(chosen: Lesson, directory: Path) -> Callable:
    """The learner's function from `directory`, or a CourseError saying what is wrong."""
    fn = getattr(load_module(chosen, directory), chosen.name, None)
    if not callable(fn):
        raise CourseError(
            f"{directory / chosen.file_name} has no function {chosen.name}: keep the stub's name"
        )
    return fn


def grade(chosen: Lesson | Build, directory: Path) -> CheckResult:
    """Check the learner's file for `chosen`; a file that cannot be loaded fails in one line.
    A build prints one line per part, and passes when every part does."""
    if isinstance(chosen, Build):
        try:
            parts = check_build(chosen, load_module(chosen, directory))
        except CourseError as error:
            result = CheckResult(chosen.name, False, None, str(error))
            print(result)
            return result
        passed = sum(part.passed for part in parts)
        return CheckResult(
            chosen.name, passed == len(parts), None, f"{passed}/{len(parts)} parts pass"
        )
    try:
        fn = load_learner(chosen, directory)
    except CourseError as error:
        result = CheckResult(chosen.name, False, None, str(error))
    else:
        try:
            return chosen.check(fn)
        except Exception as error:  # the check tripped over the learner's code itself
            why = f"your function broke the check: {one_line(error)}"
            result = CheckResult(chosen.name, False, None, why)
    print(result)
    return result
