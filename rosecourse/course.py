"""The course's lessons and builds: each one's stub, its solution and its check.

A lesson is the piece a chapter is about, with a folder of its own,
`rosecourse/exercises/chNN_name/`: its check (`__init__.py`), its known answers
(`mistakes.py`) and its reference solution (`reference.py`), one function whose
docstring is the contract; the learner's stub is made from that module, with the body cut off after
the docstring, so the stub and the solution never disagree on the signature or the
contract. The how is not in the stub: the module's `HINTS` say it, one at a time, when
the learner asks (`rose-course hint`: the idea first, the near-code last; `hint_next`).
A build (rosecourse/builds/) is one of rose's main pieces written whole: its solution
(`build_name.py`) holds classes and functions, and its stub keeps every one of them
with its body cut off after the docstring, and leaves its HINTS out too. `rose-course`
(rosecourse/cli.py) writes the stubs into a workspace and grades the files there with
the lesson's check, or the build's parts, each in a process of its own
(rosecourse/runner.py). A file that is still the untouched stub is told "not written
yet" from its source (`unwritten`), at once: this module imports neither torch nor any
check until one is asked for.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from rosetrainer.errors import RoseError, one_line
from rosetrainer.files import ensure_writable_dir, write_bytes_atomically

if TYPE_CHECKING:
    from rosecourse.builds.grading import Build
    from rosecourse.exercises.common import CheckResult

# The reference solutions, read as text (a stub is made from one without importing it), each
# in its exercise's folder: a build's in builds/, a chapter exercise's in exercises/.
BUILDS_FOLDER = Path(__file__).parent / "builds"
EXERCISES = Path(__file__).parent / "exercises"


class CourseError(RoseError):
    """A workspace problem a learner can fix, in one line."""


@dataclass(frozen=True)
class Lesson:
    chapter: str  # "02"
    name: str  # the function to write, and the solution module's suffix
    task: str  # one line: what to write

    @property
    def file_name(self) -> str:
        return f"ch{self.chapter}_{self.name}.py"

    @property
    def check(self) -> Callable[[Callable], CheckResult]:
        """The chapter's check, `check_NAME` of rosecourse/exercises/chNN_NAME/ (imported
        here, when first asked for)."""
        module = importlib.import_module(f"rosecourse.exercises.{self.file_name[:-3]}")
        return getattr(module, f"check_{self.name}")

    def solution_module(self) -> ModuleType:
        return importlib.import_module(f"rosecourse.exercises.{self.file_name[:-3]}.reference")

    def solution(self) -> Callable:
        return getattr(self.solution_module(), self.name)


LESSONS = [
    Lesson("00", "causal_attention", "the causal self-attention of a training step"),
    Lesson("01", "greedy_decode", "the uncached greedy loop"),
    Lesson("02", "concat_kv", "keep the past keys/values, add the new"),
    Lesson("03", "causal_mask", "the causal mask of a call with a past"),
    Lesson("04", "position_ids", "the positions of new tokens after a past"),
    Lesson("05", "top_p_filter", "nucleus (top-p) filtering"),
    Lesson("06", "static_update", "the static cache's in-place write"),
    Lesson("07", "padded_position_ids", "per-row positions of a left-padded batch"),
    Lesson("08", "mask_slice", "a chunk's rows of a precomputed mask"),
    Lesson("09", "window_start", "the window policy past the context"),
    Lesson("10", "decode_read_bytes", "the bytes one decode step must read"),
    Lesson("11", "slot_mapping", "each token's slot in the paged pool"),
    Lesson("12", "schedule", "the scheduler's decision for one step"),
    Lesson("13", "cached_prefix", "the prefix cache's lookup by chained block hash"),
    Lesson("14", "held_back", "the stream's stop-string hold-back"),
    Lesson("15", "export_prepare", "the exported graph's positions and mask, shapes kept symbolic"),
    Lesson("16", "stage_forward", "one pipeline stage's share of a model call"),
    Lesson("17", "quantize", "group quantization (keys per channel, values per token)"),
    Lesson(
        "18",
        "rolling_slot",
        "the rolling cache's slot for each position (sinks kept, the window modulo W)",
    ),
    Lesson("20", "choice_mask", "the allowed-token mask of a choice constraint"),
    Lesson("21", "grouped_attention", "one decode query per head, grouped over the cache"),
]


# Rose's main pieces, written whole, in the order the chapters meet them: each is the Build
# NAME.upper() of rosecourse/builds/NAME.py, imported when first asked for (`BUILDS`).
BUILD_NAMES = ("model", "training_step", "cached_loop", "block_manager", "verify")


def build(name: str) -> Build:
    """The build called `name` (one of BUILD_NAMES), imported (with torch) on first use."""
    return getattr(importlib.import_module(f"rosecourse.builds.{name}"), name.upper())


def __getattr__(attribute: str) -> object:
    """`BUILDS`, the Build of each name in BUILD_NAMES, made on first use: importing this
    module loads neither torch nor any build."""
    if attribute == "BUILDS":
        builds = [build(name) for name in BUILD_NAMES]
        globals()["BUILDS"] = builds  # the next lookup finds it as a plain attribute
        return builds
    raise AttributeError(f"module {__name__!r} has no attribute {attribute!r}")


def lesson(chapter: str, or_all: bool = True) -> Lesson:
    """The lesson of chapter `chapter` ("2", "02"); `or_all`: the error offers "all" too."""
    # Only digits are padded: "".zfill(2) is "00", and an empty argument is no chapter.
    number = chapter.zfill(2) if chapter.isascii() and chapter.isdigit() else chapter
    for candidate in LESSONS:
        if candidate.chapter == number:
            return candidate
    chapters = ", ".join(c.chapter for c in LESSONS)
    builds = ", ".join(BUILD_NAMES)
    if or_all:
        choices = f"one of {chapters}, a build ({builds}), or all"
    else:
        choices = f"one of {chapters} or a build ({builds})"
    raise CourseError(f"no exercise for chapter {chapter!r}: choose {choices}")


def key(chosen: Lesson | Build) -> str:
    """What `rose-course check` calls it: a chapter exercise's number, a build's name."""
    return chosen.chapter if isinstance(chosen, Lesson) else chosen.name


def check_name(name: str, or_all: bool = True) -> str:
    """What `rose-course check` calls the build or chapter `name` names ("2" is "02"), or
    a CourseError saying what to choose (`or_all`: "all" among the choices); nothing is
    imported."""
    if name in BUILD_NAMES:
        return name
    if not (name.isascii() and name.isdigit()):
        builds = ", ".join(BUILD_NAMES)
        number = "a chapter's number (as `rose-course list` shows)"
        choices = (
            f"a build ({builds}), {number}, or all" if or_all else f"a build ({builds}) or {number}"
        )
        raise CourseError(f"no build or chapter called {name!r}: choose {choices}")
    return lesson(name, or_all).chapter


def check_names() -> list[str]:
    """Every check `rose-course check all` runs, in its order: the chapters', then the
    builds'."""
    return [*(c.chapter for c in LESSONS), *BUILD_NAMES]


def find(name: str) -> Lesson | Build:
    """A build by its name ("model"), or the lesson of a chapter number ("2", "02")."""
    name = check_name(name)
    return build(name) if name in BUILD_NAMES else lesson(name)


def file_name(name: str) -> str:
    """The workspace file of the check `check_name` calls `name`."""
    return f"build_{name}.py" if name in BUILD_NAMES else lesson(name).file_name


# ---------------------------------------------------------------------------
# Stubs: the solution with its body cut off after the docstring
# ---------------------------------------------------------------------------


def solution_source(chosen: Lesson | Build | str) -> str:
    """The text of the reference solution of `chosen` (or of the workspace file named
    `chosen`), read without importing it, from its folder: a build's
    rosecourse/builds/name/reference.py, a chapter exercise's
    rosecourse/exercises/chNN_name/reference.py."""
    stem = (chosen if isinstance(chosen, str) else chosen.file_name).removesuffix(".py")
    if stem.startswith("build_"):
        folder = BUILDS_FOLDER / stem.removeprefix("build_")
    else:
        folder = EXERCISES / stem
    return (folder / "reference.py").read_text(encoding="utf-8")


def stub_source(chosen: Lesson | Build | str) -> str:
    """The learner's starting file: the solution module with the body of every function
    and method cut off after its docstring (the signature and the contract stay), each
    raising NotImplementedError, without its HINTS (given only when asked for:
    `hint_next`) and without the binding of rose's piece a reference delegates to
    (`binds_rose_piece`); everything else (imports, constants) as it is."""
    name = chosen if isinstance(chosen, str) else chosen.file_name
    source = solution_source(name)
    lines = source.splitlines()
    cuts = []  # (first line, last line, what replaces them) of each body, 1-based
    nodes = [(node, "") for node in ast.parse(source).body]
    while nodes:
        node, owner = nodes.pop()
        if isinstance(node, ast.ClassDef):
            nodes += [(child, f"{node.name}.") for child in node.body]
        elif isinstance(node, ast.FunctionDef):
            contract = node.body[0]
            assert isinstance(contract, ast.Expr) and isinstance(contract.value, ast.Constant), (
                f"{name}: {owner}{node.name} has no contract docstring"
            )
            indent = " " * contract.col_offset
            raises = f'{indent}raise NotImplementedError("write {owner}{node.name}")'
            cuts.append((contract.end_lineno + 1, node.end_lineno, [raises]))
        elif is_hints(node) or binds_rose_piece(node):  # with the comment lines above it
            first = node.lineno
            while first > 1 and lines[first - 2].startswith("#"):
                first -= 1
            cuts.append((first, node.end_lineno, []))
    for first, last, replacement in sorted(cuts, reverse=True):
        lines[first - 1 : last] = replacement
    # (a cut between two blank runs leaves one run of at most two blank lines, as ruff does)
    return re.sub(r"\n{4,}", "\n\n\n", "\n".join(lines)).rstrip() + "\n"


def binds_rose_piece(node: ast.stmt) -> bool:
    """Whether `node` binds rose's own piece, the reference a body delegates to (`from
    rosetrainer.model import causal_mask as rose_causal_mask`, `rose_schedule = ...`):
    like the body, the stub leaves it out."""
    if isinstance(node, ast.ImportFrom):
        return all((alias.asname or "").startswith("rose_") for alias in node.names)
    return isinstance(node, ast.Assign) and all(
        isinstance(target, ast.Name) and target.id.startswith("rose_") for target in node.targets
    )


def is_hints(node: ast.stmt) -> bool:
    """Whether `node` is a solution module's `HINTS = (...)`."""
    return (
        isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and node.targets[0].id == "HINTS"
    )


# ---------------------------------------------------------------------------
# A stub nobody has touched: its verdict, read from its source, without running anything
# ---------------------------------------------------------------------------

# Each build's parts, in order, with the stub function each part meets first (the
# NotImplementedError its untouched stub raises there): what `check_build` prints for the
# stub, said without importing torch. tests/course/test_course.py holds it to those lines.
UNWRITTEN_PARTS: dict[str, tuple[tuple[str, str], ...]] = {
    "model": (
        ("weights", "GPT.__init__"),
        ("attention", "CausalSelfAttention.__init__"),
        ("mlp", "MLP.__init__"),
        ("block", "Block.__init__"),
        ("logits", "GPT.__init__"),
        ("train mode", "GPT.__init__"),
        ("gradients, in train mode", "GPT.__init__"),
    ),
    "training_step": (
        ("AdamW", "AdamW.__init__"),
        ("parameter groups", "parameter_groups"),
        ("learning rate", "learning_rate"),
        ("clipping", "clip_gradients"),
        ("12 steps, one micro-batch each", "make_optimizer"),
        ("12 steps, 3 micro-batches each, clipped", "make_optimizer"),
        ("a step in bfloat16 (autocast), 2 micro-batches", "make_optimizer"),
    ),
    "cached_loop": (
        ("layer update", "StaticLayer.__init__"),
        ("cache, one row", "StaticCache.__init__"),
        ("cache, ragged batch of 3", "StaticCache.__init__"),
        ("cache, prefill in chunks of 3, on another device", "StaticCache.__init__"),
        ("cache, prefill a token a call", "StaticCache.__init__"),
        ("cache, bfloat16 model", "StaticCache.__init__"),
        ("cache memory", "StaticCache.__init__"),
        ("loop, one row", "generate_cached"),
        ("loop, ragged batch of 3", "generate_cached"),
        ("loop, prefill in chunks of 3, on another device", "generate_cached"),
        ("loop, prefill a token a call", "generate_cached"),
        ("loop, prefill_chunk past the prompts", "generate_cached"),
    ),
    "block_manager": (
        ("chain hash", "chain_hash"),
        ("bookkeeping", "BlockManager.__init__"),
        ("engine, shared prefixes", "BlockManager.__init__"),
        ("engine, a short pool", "BlockManager.__init__"),
        ("engine, random schedules", "BlockManager.__init__"),
    ),
    "verify": (
        ("cache, a pass of k + 1 after a past", "RollbackCache.__init__"),
        ("cache, rollback", "RollbackCache.__init__"),
        ("greedy, prompt lookup, k = 1..8", "verify_greedy"),
        ("greedy, self-draft on a static cache, k = 1, 3, 8", "verify_greedy"),
        ("greedy, the cache's length after every call", "verify_greedy"),
        ("greedy, the run past a rejection", "verify_greedy"),
        ("sampled rule", "accept_or_resample"),
        ("sampled rule, its generator", "accept_or_resample"),
        ("sampled verify", "verify_sampled"),
        ("sampled verify, the exact law on a 5-token vocabulary", "verify_sampled"),
    ),
}


# An untouched stub's verdict: not a wrong answer, no answer yet.
UNWRITTEN = "not written yet"


def unwritten(name: str, directory: Path) -> list[str] | None:
    """The "not written yet" lines of check `name` (as `check_name` gives it) when its file in
    `directory` is still the stub `rose-course start` writes, or None when it is anything
    else: the learner's work, a file that is missing or does not parse (the check's to run
    and word). The stub is recognised by its code, whatever its comments, layout and
    docstrings say; nothing is imported or run, so the answer comes at once."""
    path = directory / file_name(name)
    try:
        if not path.is_file() or code_of(path.read_bytes()) != code_of(stub_source(path.name)):
            return None
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if name in BUILD_NAMES:
        return [
            f"{name}/{part}: {UNWRITTEN}: replace the stub's body (write {first})"
            for part, first in UNWRITTEN_PARTS[name]
        ]
    function = lesson(name).name
    return [
        f"{function}: {UNWRITTEN}: replace the stub with your function "
        f"[it raises NotImplementedError: write {function}]"
    ]


def code_of(source: str | bytes) -> str:
    """`source`'s code, compared without its comments, layout and docstrings."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            del body[0]
    return ast.dump(tree)


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
    for name in map(file_name, check_names()):  # every path is checked before anything is written
        path = directory / name
        stub = stub_source(name).encode()
        text = solution_source(name).encode() if solutions else stub
        if path.exists() and not path.is_file():
            raise not_a_file(path, directory)
        old = path.read_bytes() if path.is_file() else b""
        if old == text:
            continue  # there already (and no space needed to write it again)
        if holds_no_work(old, text, {sha256(stub), record.get(name)}):
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
# Hints: the how, one at a time, when the learner asks
# ---------------------------------------------------------------------------

# Where `rose-course hint` notes, per check, which of its hints it has given (how many:
# the first ones; or their indexes, once a build's failing part took one out of turn),
# and `rose-course check`, under FAILING, the part each build's last check failed first.
HINT_RECORD = ".rose-course-hints.json"
FAILING = "failing"


def hints(name: str) -> tuple[str, ...]:
    """The hints of check `name` (as `check_name` gives it), in the order they are given:
    the `HINTS` of its reference solution, read from its source (nothing imported)."""
    source = solution_source(file_name(name))
    for node in ast.parse(source).body:
        if is_hints(node):
            assert isinstance(node, ast.Assign)  # (is_hints says so; this tells the type checker)
            return tuple(ast.literal_eval(node.value))
    return ()


def read_hint_record(directory: Path) -> dict[str, object]:
    """The workspace's record as written (see HINT_RECORD); empty if it is missing or
    damaged (the count then starts again: the hints are no secret, only counted)."""
    path = directory / HINT_RECORD
    if not path.is_file():  # (a pipe or a device in its place would block the read)
        return {}
    try:
        record = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def given_hints(name: str, record: dict[str, object]) -> list[int]:
    """The indexes of check `name`'s hints the record says were given, in order: a count
    (the first ones) or, once a hint was given out of turn, the indexes themselves."""
    total = len(hints(name))
    given = record.get(name, 0)
    if isinstance(given, int) and not isinstance(given, bool):
        return list(range(min(max(given, 0), total)))
    if isinstance(given, list):
        return sorted({i for i in given if isinstance(i, int) and 0 <= i < total})
    return []


def hints_used(name: str, directory: Path) -> tuple[int, int]:
    """(how many of check `name`'s hints the workspace has had, how many it has)."""
    return len(given_hints(name, read_hint_record(directory))), len(hints(name))


def failing_part(name: str, record: dict[str, object]) -> str | None:
    """The part of build `name` its last check failed first, as the record notes it."""
    failing = record.get(FAILING)
    part = failing.get(name) if isinstance(failing, dict) else None
    return part if isinstance(part, str) else None


def about(name: str, part: str | None) -> list[int]:
    """The indexes of build `name`'s hints about its `part`: those that name the class
    (or the function) the part grades first (UNWRITTEN_PARTS)."""
    graded = dict(UNWRITTEN_PARTS.get(name, ())).get(part) if part else None
    if graded is None:
        return []
    owner, _, method = graded.partition(".")
    word = f"{owner}." if method else owner
    return [i for i, text in enumerate(hints(name)) if word in text]


def hint_next(name: str, directory: Path) -> tuple[int, str, str | None] | None:
    """Give the workspace check `name`'s next hint: (its number, from 1, its text, and the
    failing part it is about, if it is), noted in the workspace's HINT_RECORD (written
    atomically, beside the learner's files and never over one of them); None when every
    hint has been given. A build whose last check failed gets that part's hints first."""
    if not (directory / file_name(name)).is_file():  # a workspace holds the exercise's file
        raise CourseError(
            f"no {file_name(name)} in {directory}: run `rose-course start {directory}` "
            "first (or pass --dir)"
        )
    with workspace_lock(directory):
        record = read_hint_record(directory)
        given = given_hints(name, record)
        part = failing_part(name, record)
        firsts = about(name, part)
        order = firsts + [i for i in range(len(hints(name))) if i not in firsts]
        left = [i for i in order if i not in given]
        if not left:
            return None
        index = left[0]
        given = sorted([*given, index])
        record[name] = len(given) if given == list(range(len(given))) else given
        write_bytes_atomically(directory / HINT_RECORD, json.dumps(record, indent=1).encode())
    return index + 1, hints(name)[index], part if index in firsts else None


def note_failing_part(name: str, directory: Path, part: str | None) -> None:
    """Note in the workspace the part build `name`'s check failed first (None: it passed),
    so that `hint` gives that part's hints first. A workspace that cannot be written to
    keeps no note: the check's verdict stands all the same."""
    with contextlib.suppress(OSError), workspace_lock(directory):
        record = read_hint_record(directory)
        failing = record.get(FAILING)
        failing = dict(failing) if isinstance(failing, dict) else {}
        if part is None:
            failing.pop(name, None)
        else:
            failing[name] = part
        if failing:
            record[FAILING] = failing
        else:
            record.pop(FAILING, None)
        write_bytes_atomically(directory / HINT_RECORD, json.dumps(record, indent=1).encode())


@contextlib.contextmanager
def workspace_lock(directory: Path) -> Iterator[None]:
    """One hint at a time per workspace: two `rose-course hint` calls at once would both
    read the record, and one of their counts would be lost. The lock is taken on the
    folder itself (flock on its descriptor), so no file joins the learner's; where the
    system has no flock (Windows), calls are not serialised."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover (not a POSIX system)
        yield
        return
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # (closing it lets the lock go)


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


def is_solution(chosen: Lesson | Build, directory: Path) -> bool:
    """Whether the learner's file for `chosen` is its reference solution, as `start
    --solutions` writes it (whatever its comments, layout and docstrings)."""
    try:
        source = learner_file(chosen, directory).read_bytes()
        return code_of(source) == code_of(solution_source(chosen))
    except (CourseError, OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return False


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
    from rosecourse.builds.grading import Build, check_build
    from rosecourse.exercises.common import CheckResult

    if isinstance(chosen, Build):
        try:
            parts = check_build(chosen, load_module(chosen, directory))
        except CourseError as error:
            result = CheckResult(chosen.name, False, None, str(error))
            print(result)
            return result
        passed = sum(part.passed for part in parts)
        return CheckResult(
            chosen.name, 0 < passed == len(parts), None, f"{passed}/{len(parts)} parts pass"
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
