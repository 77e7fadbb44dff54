"""Each check in processes of its own, with a time limit and a bounded output; its verdict
decided where the learner's code never runs.

A check runs the learner's code, and whatever that code does to its process it does to
whatever else runs there: `sys.exit(0)` ends it, `while True: pass` never returns,
`torch.set_default_dtype(torch.float64)` changes the numbers of everything computed
after it, a print in a loop floods the terminal, and nothing it computes there can be
believed: it can write the grader's verdict itself, or patch the class that holds it.
So `rose-course check` (`grade_in_child`) starts each check's processes fresh:

    grader (rose-course: the check's logic, the reference, the verdict)
      '- reaper (python -m rosecourse.reaper: standard library only)
           '- the check's process (python -m rosecourse.runner: the learner's code)
                '- whatever the learner's code starts

- A chapter's exercise is judged in the grader. Its check (rosecourse.exercises.common.
  check) is run there with its two learner-facing steps, the probe (the function's
  outcomes on small inputs) and each run (the real system with the function swapped in),
  answered by the check's process: the grader asks for them one at a time over a socket,
  and takes the answers as plain data only (tensors as their bytes, numbers, strings and
  containers of them; an object of any other class arrives as its type's name; no class
  of the learner's is ever built here). The reference, the comparisons, the diagnosis and
  the verdict are computed and printed in the grader, so no message and no patch of the
  learner's can make them say "passed": only answers equal to the reference's can.
- A build's parts (rosecourse/builds/) run in the check's process on the learner's module
  only to note, on a tape, the values its code made that each part compares (`grading.
  seen`): the grader asks for one part's tape at a time, runs the part again on the
  reference with the tape's values in place of the reference's, and prints each part's
  line itself. What the check's process says is believed only when it is a failure; a
  part with nothing on its tape fails.
- The reaper ends every process the check started when the check ends (its verdict is in,
  it timed out, it printed too much, or the grader ended however it ended: its lifeline
  closes), including those that left its process group or session: on Linux the reaper
  is a child subreaper, so they are re-parented to it, and it kills and reaps its
  children until it has none.
- The time: a check still running after the limit is stopped; the output: the check's
  prints reach the terminal, up to a limit; past it the check is stopped (a learner's
  debugging print fits easily, a flood does not).
- The grading code: every check's code is loaded in the grader, and the files of rose and
  the course fingerprinted, before any learner code runs (`Grader`); a check after which
  they changed on disk fails, and no later one runs. A check that compares no run, or
  whose reaper died while the learner's code ran, fails.

Inside the check's process, a learner's code that raises what stops a program
(SystemExit from `sys.exit`, KeyboardInterrupt) or leaves one of torch's process-wide
defaults changed is one FAILED line too. Every failure is one line in the check's own
form.

What this does not stop: the learner's code runs as the same user as the grader, so it can signal the grader or the
reaper (a killed reaper leaves the processes that left its group to init; the check
fails all the same, and the grader kills what is left in the reaper's first process
group), or write to the terminal's device directly. The grader makes
itself undumpable (`protect_grader`), so that such code cannot ptrace it or read its
memory through /proc. A learner who wants "passed" without writing the answer can
always import the reference solution: the grader's promise is that its verdict is the
verdict on the answers the learner's code gave, not that those answers are the
learner's own.
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import importlib
import io
import os
import pickle
import selectors
import signal
import socket
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch

from rosecourse.builds.grading import Build, diagnosis, observe, probed, verdict
from rosecourse.course import (
    CourseError,
    Lesson,
    find,
    key,
    learner_file,
    load_learner,
    load_module,
    note_failing_part,
)
from rosecourse.exercises import CheckResult
from rosecourse.exercises.common import Exercise, check
from rosecourse.plain import Foreign, PlainData, decode, encode  # noqa: F401 (Foreign: tests)
from rosetrainer.errors import one_line

# Bytes of a check's output shown on the terminal; more fails the check.
OUTPUT_LIMIT = 64 * 1024
# Tiny models: one intra-op thread is fastest (and kind to a shared machine).
THREADS = int(os.environ.get("ROSE_COURSE_THREADS", "1"))
# The largest message a check's process may send (a probe's tensors are small).
MESSAGE_LIMIT = 256 * 1024 * 1024
# How long the grader waits for the reaper to end a check's processes once asked to.
REAP_TIMEOUT = 30.0

# torch's process-wide defaults: a function that changes one and leaves it so changes every
# later computation in the process, the real system's too.
GLOBAL_DEFAULTS: dict[str, Callable[[], object]] = {
    "default dtype": torch.get_default_dtype,
    "default device": torch.get_default_device,
    "number of threads": torch.get_num_threads,
    "grad mode": torch.is_grad_enabled,
    "deterministic algorithms setting": torch.are_deterministic_algorithms_enabled,
    "float32 matmul precision": torch.get_float32_matmul_precision,
}


class Stopped(BaseException):
    """The check had to stop; why, as its FAILED line says. A BaseException: it passes
    through a check's `except Exception`, which takes what a learner's function raises as
    one of its findings."""


# ---------------------------------------------------------------------------
# Messages between the grader and the check's process: plain data only
# ---------------------------------------------------------------------------


def send(channel: socket.socket, message: object) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    channel.sendall(len(data).to_bytes(8, "big") + data)


def unframe(buffer: bytearray) -> bytes | None:
    """The first whole message in `buffer`, taken out of it; None while it is incomplete."""
    if len(buffer) < 8:
        return None
    size = int.from_bytes(buffer[:8], "big")
    if size > MESSAGE_LIMIT:
        raise ValueError(f"a message of {size} bytes (at most {MESSAGE_LIMIT})")
    if len(buffer) < 8 + size:
        return None
    data = bytes(buffer[8 : 8 + size])
    del buffer[: 8 + size]
    return data


def receive(channel: socket.socket) -> object | None:
    """The next message (in the check's process: the grader's requests); None at the end."""
    buffer = bytearray()
    while (data := unframe(buffer)) is None:
        chunk = channel.recv(65536)
        if not chunk:
            return None
        buffer += chunk
    return PlainData(io.BytesIO(data)).load()


# ---------------------------------------------------------------------------
# The grader's side
# ---------------------------------------------------------------------------


def protect_grader() -> None:
    """Make this process undumpable (Linux): a process of the same user, the learner's code
    included, can no longer ptrace it or read its memory and file descriptors in /proc."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0


# Where the code that grades lives: the course's checks and the rose they run. The
# learner's code runs as the same user and could rewrite any of it.
GRADING_PACKAGES = ("rosecourse", "rosetrainer", "roseinfer")


def grading_fingerprint() -> str:
    """A digest of every Python file of GRADING_PACKAGES: it changes when one does."""
    digest = hashlib.sha256()
    for package in GRADING_PACKAGES:
        root = Path(importlib.import_module(package).__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root.parent)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


class Grader:
    """Grades the learner's files for some checks, one after the other.

    Every check's code is loaded here, and the grading code's files fingerprinted, before
    any learner code runs: what one check's learner code does to the files on disk (a
    chapter 00 answer that rewrites chapter 05's check, say) cannot change how a later
    check is judged here, and is found when the fingerprint changes: that check fails,
    and no later one runs."""

    def __init__(self, names: list[str], directory: Path, timeout: float) -> None:
        protect_grader()
        self.directory, self.timeout = directory, timeout
        self.checks = {name: find(name) for name in names}
        for chosen in self.checks.values():
            exercise_of(chosen)  # imports the chapter's check module now
        self.fingerprint = grading_fingerprint()
        self.tampered = False

    def grade(self, name: str) -> bool:
        chosen = self.checks[name]
        if self.tampered:
            print(CheckResult(chosen.name, False, None, f"not run: {TAMPERED}"))
            return False
        return grade_in_child(chosen, self.directory, self.timeout, self.require_intact)

    def require_intact(self) -> None:
        """Stopped when the grading code's files changed since they were loaded."""
        if grading_fingerprint() != self.fingerprint:
            self.tampered = True
            raise Stopped(f"your code changed rose's or the course's files: {TAMPERED}")


TAMPERED = (
    "the grading code on disk is not what this check loaded (reinstall rose, or `git "
    "checkout rosecourse rosetrainer roseinfer`, then check again)"
)


def grade_in_child(
    chosen: Lesson | Build,
    directory: Path,
    timeout: float,
    intact: Callable[[], None] = lambda: None,
    output_limit: int = OUTPUT_LIMIT,
) -> bool:
    """Grade the learner's file for `chosen` in fresh processes: print what they print (at
    most `output_limit` bytes) and the verdict, or one FAILED line for how the check ended
    if it did not finish within `timeout` seconds or ended without a verdict, or if
    `intact()` raises Stopped before the verdict; whether it passed."""
    try:
        learner_file(chosen, directory)  # no file, no process: its line at once
    except CourseError as error:
        print(CheckResult(chosen.name, False, None, str(error)))
        return False
    exercise = exercise_of(chosen)
    child = CheckProcess(chosen, directory, timeout, output_limit)
    failing = None
    try:
        if exercise is not None:
            return judge(chosen.name, exercise, child, intact)
        passed, failing = judge_build(chosen, child, intact)
        return passed
    except Stopped as stopped:
        child.end_line()
        print(CheckResult(chosen.name, False, None, str(stopped)))
        return False
    finally:
        child.stop()
        if exercise is None:  # a build: `hint` gives its first failing part's hints first
            note_failing_part(chosen.name, directory, failing)


def judge_build(
    build: Build, child: CheckProcess, intact: Callable[[], None]
) -> tuple[bool, str | None]:
    """Each of the build's parts run in the check's process on the learner's module, and
    judged here from what it sent (grading.verdict); print one line a part; whether every
    part passed, and the first that did not."""
    outcomes = None

    def named() -> str:
        nonlocal outcomes
        if outcomes is None:
            outcomes = child.ask(("probe",))
        return diagnosis(build, outcomes) or ""

    results = []
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)  # the reference's numbers as the check's process gets them
    try:
        for index, part in enumerate(build.parts):
            entries, failure = child.ask(("part", index))
            result = verdict(build, part, entries, failure, named)
            child.require_guard()
            intact()
            print(result)
            results.append(result)
    finally:
        torch.set_num_threads(threads)
    first = next((r.part for r in results if not r.passed), None)
    return bool(results) and first is None, first


def exercise_of(chosen: Lesson | Build) -> Exercise | None:
    """The Exercise whose `check` is `chosen`'s (every chapter's check is
    `check(EXERCISE, fn)` in its module); None for a build."""
    if not isinstance(chosen, Lesson):
        return None
    exercise = getattr(sys.modules.get(chosen.check.__module__), "EXERCISE", None)
    return exercise if isinstance(exercise, Exercise) else None


def learners_function(*args: object, **kwargs: object) -> NoReturn:
    """What the grader's check holds for the learner's function: it runs in the check's
    process, never here."""
    raise AssertionError("the learner's function runs in the check's process only")


def judge(
    name: str, exercise: Exercise, child: CheckProcess, intact: Callable[[], None] = lambda: None
) -> bool:
    """The exercise's own check, run here, with its probe of the learner's function and its
    runs answered by the check's process; print its verdict; whether it passed."""

    def probe(fn: Callable) -> object:
        if getattr(fn, "fn", fn) is not learners_function:  # the reference's, a known wrong's
            return exercise.probe(fn)
        return child.ask(("probe",))  # (watched there: contract.Watcher)

    def run(index: int, on_token: Callable[[int, int], None]) -> object:
        made, rows, raised = child.ask(("run", index))
        if sum(made.values()) > 1_000_000:
            raise ValueError("more than a million steps in one run")
        for row, count in made.items():  # the steps it made, as compare_run counts them
            for _ in range(count):
                on_token(row, 0)
        if raised is not None:
            raise replayed(*raised)
        return rows

    replay = dataclasses.replace(
        exercise,
        probe=probe,
        swapped_in=lambda fn: contextlib.nullcontext(),
        runs=[
            (label, expected, functools.partial(run, index))
            for index, (label, expected, _) in enumerate(exercise.runs)
        ],
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)  # the reference's numbers as the check's process gets them
    try:
        result = check(replay, learners_function, show=False)
    except Exception as error:  # what the check tripped over in the learner's answers
        result = broke_the_check(name, error)
    finally:
        torch.set_num_threads(threads)
    # Said only now: a reaper killed, or grading code changed on disk, is the verdict instead.
    child.require_guard()
    intact()
    print(result)
    return result.passed


def broke_the_check(name: str, error: Exception) -> CheckResult:
    """The FAILED verdict of a check that tripped over the learner's answers (as `grade`
    words it)."""
    return CheckResult(name, False, None, f"your function broke the check: {one_line(error)}")


def replayed(type_name: str, message: str) -> Exception:
    """An exception of the name and message the learner's code raised, to show as it."""
    name = type_name if isinstance(type_name, str) and type_name.isidentifier() else "Exception"
    return type(name, (Exception,), {"__module__": "learner"})(str(message)[:2000])


def read_answer(data: bytes) -> object:
    """An answer of the check's process, read as plain data: a probe's outcomes, or a run's
    (steps made by row, rows, what it raised). Stopped when it stopped or failed to load."""
    try:
        kind, *content = PlainData(io.BytesIO(data)).load()
        if kind == "probe":
            return decode(content[0])
        if kind == "part":  # a build's part: its tape, and why it failed there
            entries, failure = content
            tape = [(str(what), value) for what, value in entries]
            return tape, None if failure is None else (str(failure[0]), str(failure[1]))
        if kind == "run":
            made, rows, raised = content
            made = {int(row): int(count) for row, count in made.items()}
            return made, decode(rows), None if raised is None else tuple(map(str, raised))
        if kind in ("stopped", "failed", "broke"):
            said = [" ".join(str(part).split())[:2000] for part in content]
        else:
            raise ValueError(f"an answer of kind {kind!r}")
    except Exception as error:  # not what a check's process sends
        raise Stopped(unreadable(error)) from None
    if kind == "broke":  # its probe raised out of the probe itself: as the check saw it
        raise replayed(*said)
    raise Stopped(said[0])  # it stopped (SystemExit, ...), or its file does not load


class CheckProcess:
    """One check's processes as the grader sees them: the reaper, and under it the check's
    process, with its output (forwarded here, up to a limit) and its channel (requests
    out, answers in) and the time left."""

    def __init__(
        self, chosen: Lesson | Build, directory: Path, timeout: float, output_limit: int
    ) -> None:
        self.timeout, self.output_limit = timeout, output_limit
        self.deadline = time.monotonic() + timeout
        self.answered_at: float | None = None  # when its last answer came
        self.channel, channel_theirs = socket.socketpair()
        self.lifeline, lifeline_theirs = socket.socketpair()
        with channel_theirs, lifeline_theirs:
            fds = [lifeline_theirs.fileno(), channel_theirs.fileno()]
            self.reaper = subprocess.Popen(
                [sys.executable, "-m", "rosecourse.reaper", *map(str, fds), "--"]
                + [sys.executable, "-m", __name__, key(chosen), str(directory), str(fds[1])],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=fds,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},  # prints arrive as they are made
                # A session of its own: Ctrl-C reaches the grader only, which then stops it.
                start_new_session=True,
            )
        assert self.reaper.stdout is not None
        self.output = self.reaper.stdout.fileno()
        os.set_blocking(self.output, False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.output, selectors.EVENT_READ)
        self.selector.register(self.channel, selectors.EVENT_READ)
        self.output_open = self.channel_open = True
        self.received = bytearray()
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.shown = 0
        self.transcript = ""
        self.ends_a_line = True

    # -- what the grader asks

    def ask(self, request: tuple) -> object:
        """Send `request`; the check's process's answer, decoded. A "stopped" or "failed"
        answer, a process that ended instead, or one that ran out of time or printed too
        much: Stopped."""
        self.require_guard()
        if self.answered_at is not None:  # the grader's own time judging is not the check's
            self.deadline += time.monotonic() - self.answered_at
        with contextlib.suppress(OSError):  # a process that ended: found below
            send(self.channel, request)
        data = None
        while data is None:
            data = self.message()
            if data is None and not self.channel_open:
                self.wait_end()
                raise Stopped(ended_without_verdict(self.status()))
            if data is None:
                self.pump()
        self.drain()  # what it printed before it answered, before anything the grader prints
        self.end_line()
        self.answered_at = time.monotonic()
        return read_answer(data)

    def require_guard(self) -> None:
        """Stopped when the reaper has ended while the check's process still runs: killed
        (by the learner's code: it runs as the same user), it can no longer end every
        process the check started, and a check whose guard died does not pass."""
        if self.reaper.poll() is not None and self.reaper.returncode < 0:
            raise Stopped(
                "the check's reaper was killed while your code ran: does your code signal "
                "its parent processes? (what it started may still run)"
            )

    def wait_end(self) -> None:
        """Forward the output until it closes: the reaper has ended everything and exited."""
        while self.output_open:
            self.pump()

    def last_message(self) -> tuple | None:
        """The check's last message, if it sent one that reads as plain data."""
        message = None
        with contextlib.suppress(Exception):
            while (data := self.message()) is not None:
                message = PlainData(io.BytesIO(data)).load()
        return message

    def status(self) -> int | None:
        """How the check's process ended (a returncode), as the reaper tells; None if it
        did not (the reaper itself was killed)."""
        self.reaper.wait()
        self.lifeline.settimeout(1.0)  # the reaper has exited: what it sent is there
        line = b""
        with contextlib.suppress(OSError):
            while chunk := self.lifeline.recv(64):
                line += chunk
        try:
            return int(line)
        except ValueError:
            return None

    def stop(self) -> None:
        """Have the reaper end every process of the check, and wait for it."""
        with contextlib.suppress(OSError):
            self.lifeline.shutdown(socket.SHUT_WR)  # the reaper reads its end: it ends all
        try:
            self.reaper.wait(timeout=REAP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pass
        if self.reaper.returncode is None or self.reaper.returncode < 0:
            # Stuck or killed: what is left of the check in the reaper's session's first
            # group (the check's process, unless it left it) ends here.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.reaper.pid, signal.SIGKILL)
            self.reaper.wait()
        self.selector.close()
        for held in (self.reaper.stdout, self.channel, self.lifeline):
            if held is not None:
                held.close()

    # -- the output and the channel

    def message(self) -> bytes | None:
        try:
            return unframe(self.received)
        except ValueError as error:
            raise Stopped(unreadable(error)) from None

    def pump(self) -> None:
        """Wait for output or a message, and take it (up to the time limit)."""
        left = self.deadline - time.monotonic()
        ready = self.selector.select(timeout=left) if left > 0 else []
        if not ready:
            raise Stopped(stopped_at(self.timeout))
        for selected, _ in ready:
            if selected.fileobj == self.output:
                self.read_output()
            else:
                chunk = b""
                with contextlib.suppress(OSError):
                    chunk = self.channel.recv(1 << 20)
                if not chunk:
                    self.channel_open = False
                    self.selector.unregister(self.channel)
                self.received += chunk

    def drain(self) -> None:
        while self.output_open and self.read_output():
            pass

    def read_output(self) -> bool:
        """Forward what the check printed, if anything is there; whether something was."""
        try:
            chunk = os.read(self.output, 65536)
        except BlockingIOError:
            return False
        if not chunk:  # the reaper, and so every process of the check, has ended
            self.output_open = False
            self.selector.unregister(self.output)
            return False
        kept = chunk[: self.output_limit - self.shown]
        self.shown += len(kept)
        text = self.decoder.decode(kept, final=len(kept) < len(chunk))
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
            self.transcript += text
            self.ends_a_line = text.endswith("\n")
        if len(kept) < len(chunk):
            raise Stopped(
                f"printed too much (output cut at {self.output_limit} bytes): print less, "
                "or not in a loop"
            )
        return True

    def end_line(self) -> None:
        """What the grader prints next starts a line of its own."""
        if not self.ends_a_line:
            print()
            self.ends_a_line = True


def stopped_at(timeout: float) -> str:
    """Why a check still running at the time limit was stopped."""
    return f"did not finish in {timeout:g} s (--timeout): does your code loop forever?"


def unreadable(error: Exception) -> str:
    return (
        f"the check's process sent what the grader cannot read ({type(error).__name__}: "
        f"{str(error)[:200]}): does your code write to the grader's channel?"
    )


def ended_without_verdict(code: int | None) -> str:
    if code is None:
        how = "ended (its reaper was killed)"
    elif code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    return f"the check's process {how} before its verdict: does your code call os._exit?"


# ---------------------------------------------------------------------------
# The check's process: python -m rosecourse.runner CHAPTER DIR FD
# ---------------------------------------------------------------------------


class ChangedDefault(BaseException):
    """The learner's code changed one of torch's process-wide defaults and left it so.

    A BaseException, like SystemExit: a check's `except Exception`, which takes what the
    learner's function raises as one of its findings, lets it through.
    """


def child_main(name: str, directory: Path, channel_fd: int) -> NoReturn:
    """Answer the grader's requests for one chapter's exercise or build (`name`: as
    `rose-course check` takes it) until the grader closes the channel; then exit."""
    channel = socket.socket(fileno=channel_fd)
    channel.set_inheritable(False)  # nothing the learner's code starts holds it open
    torch.set_num_threads(THREADS)
    serve(find(name), directory, channel)
    # At once: no exit handler or thread of the learner's code runs after the last answer.
    os._exit(0)


def serve(chosen: Lesson | Build, directory: Path, channel: socket.socket) -> None:
    """Load the learner's function (a build: module), then answer the grader's requests
    with it: ("probe",) with the probe of it, ("run", i) with what run i made with it
    swapped in, ("part", i) with the tape of a build's part i."""

    def send_answer(*message: object) -> None:
        sys.stdout.flush()  # its prints first
        sys.stderr.flush()
        send(channel, message)

    try:
        before_import = global_defaults()
        exercise = exercise_of(chosen)
        try:
            fn = load_learner(chosen, directory) if exercise else load_module(chosen, directory)
        except CourseError as error:
            send_answer("failed", str(error))
            return
        require_unchanged(before_import)
        while (request := receive(channel)) is not None:
            if exercise is None:
                send_answer(*build_answer(chosen, fn, request))
            else:
                send_answer(*answer(exercise, guarded(fn), request))
    except BaseException as stopping:  # the learner's code raised what stops a program
        send_answer("stopped", stopping_line(stopping))


def build_answer(build: Build, module: types.ModuleType, request: tuple) -> tuple:
    """The answer to one of the grader's requests about a build: ("probe",), the build's
    probe of the learner's module; ("part", i): part i's tape, and why it failed here."""
    before = global_defaults()
    if request[0] == "probe":
        answer = ("probe", encode(probed(build, module)))
    else:
        answer = ("part", *observe(build, build.parts[request[1]], module))
    require_unchanged(before)
    return answer


def answer(exercise: Exercise, fn: Callable, request: tuple) -> tuple:
    """The answer to one of the grader's requests: ("probe",), the exercise's probe of `fn`;
    ("run", i): what run i made with `fn` swapped in (the steps each row made, the rows,
    what it raised)."""
    if request[0] == "probe":
        try:
            return ("probe", encode(exercise.observe(fn)))  # every outcome, made here
        except Exception as error:  # it broke the probe itself
            return ("broke", type(error).__name__, one_line(error, with_type=False))
    _, _, run = exercise.runs[request[1]]
    made: dict[int, int] = {}

    def on_token(row: int, _token: int) -> None:
        made[row] = made.get(row, 0) + 1

    rows, raised = None, None
    try:
        with exercise.swapped_in(fn):
            rows = encode(run(on_token))
    except Exception as error:  # anything the learner's code raises is a finding
        raised = (type(error).__name__, one_line(error, with_type=False))
    return ("run", made, rows, raised)


def guarded(fn: Callable) -> Callable:
    """`fn`, failing with ChangedDefault when a call of it leaves one of torch's global
    defaults changed (a build's parts run the learner's classes in many places, so a
    build is checked once, after its parts have run)."""

    @functools.wraps(fn)
    def call(*args: object, **kwargs: object) -> object:
        before = global_defaults()
        try:
            return fn(*args, **kwargs)
        finally:  # even when it raised: the change outlives the call all the same
            require_unchanged(before)

    return call


def global_defaults() -> dict[str, object]:
    return {name: get() for name, get in GLOBAL_DEFAULTS.items()}


def require_unchanged(before: dict[str, object]) -> None:
    for name, now in global_defaults().items():
        if now != before[name]:
            raise ChangedDefault(
                f"your code changed torch's {name} from {before[name]} to {now} and left it "
                "so: a process-wide default is every caller's; leave it as you found it "
                "(pass dtype=, device= to the calls that need another)"
            )


def stopping_line(stopping: BaseException) -> str:
    """The FAILED explanation for what the learner's code raised that stops a program."""
    if isinstance(stopping, ChangedDefault):
        return str(stopping)
    if isinstance(stopping, SystemExit):
        return (
            f"your code raised SystemExit({stopping.code!r}) (what sys.exit does), which "
            "would end the grader itself: return your answer instead"
        )
    return (
        f"your code raised {type(stopping).__name__}, which stops a program, not a "
        "check: raise an Exception, or return"
    )


if __name__ == "__main__":
    name_arg, directory_arg, fd_arg = sys.argv[1:]
    child_main(name_arg, Path(directory_arg), int(fd_arg))
