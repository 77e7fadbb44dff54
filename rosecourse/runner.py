"""Each check with the learner's code in a process of its own, with a time limit, and its
verdict decided in the grader, a process the learner's code never runs in.

    grader (rose-course check: the check's code, the reference, the verdict)
      '- the check's process (a fork of the grader: the learner's code)

A chapter's check (rosecourse.exercises.common.check) runs in the grader. Its two steps
that need the learner's function, the probe (the function's outcomes on small inputs) and
each run (the real system with the function swapped in), are asked of the check's process
over a pipe, one at a time, and answered as plain data (rosecourse.plain). A build's parts
run in the check's process only to note on a tape what the learner's code made that each
part compares (grading.seen); the grader runs each part again on the reference with the
tape's values. The references, the comparisons and the verdict are the grader's, so no
print, message or patch of the learner's can make it say "passed": only answers equal to
the reference's can.

The check's process is forked from the grader once every check's code, torch and rose
are loaded, so that a check pays for one Python and one torch, not two. It starts in a
session of its own, holding only its end of the pipe (no other descriptor of the
grader's but the standard ones, stdin being /dev/null), and dies with the grader.

The check fails, in one line that says why, when the learner's code
- raises what stops a program (SystemExit, KeyboardInterrupt), or leaves one of torch's
  process-wide defaults changed;
- ends its process before its last answer, or does not finish within the time limit;
- prints more than OUTPUT_LIMIT characters (its prints come to the grader as messages,
  and are shown as they come);
- leaves a process running: on Linux the grader is a child subreaper, so what the check's
  process started is re-parented to the grader when that process ends, and killed;
- changes the grading code on disk: every check's code is loaded, and rose's and the
  course's files fingerprinted, before any learner code runs (`Grader`); a check after
  which they changed fails, and no later one runs.

An answer that is rose's own code fails. In the check's process, before the learner's
file is loaded, the piece of rose that is a chapter's answer (its exercise's reference,
what its reference solution delegates to) has its code swapped for a stand-in that stops
the check when it runs inside the learner's function, "your top_p_filter runs rose's own
roseinfer.request.sampling.top_p_filter: the exercise is to write it"
(`refuse_roses_pieces`): re-exported, called, or captured before the check swaps it, it
fails alike, even when the learner's code catches what it raised; rose's own code never
calls it there, the check having swapped the learner's function in wherever rose does.
A build's class that is, or subclasses, one of rose's, or a build's function that is
rose's, fails as soon as the file is loaded (`require_own_classes`). The reference solution as
`rose-course start --solutions` writes it is the one answer that may be rose's.

What this does not stop: the learner's code runs as the same user as the grader. It can
kill the grader (then there is no verdict: nothing passes; the check's process dies with
it) or write to the terminal directly. The grader is undumpable, so that such code cannot
ptrace it or read its memory. A learner who wants "passed" without writing the answer can
copy the reference solution, or rose's code (its file read, its module loaded again, the
refusal undone: it is made in the learner's own process), and a build's method may call
rose's own (rose's pieces run beside the learner's in a build's check, so they cannot be
swapped out there): the grader's promise is that its verdict is the verdict on the
answers the learner's code gave, not that those answers are the learner's own.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import importlib
import inspect
import io
import os
import signal
import sys
import types
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any, NoReturn

import torch

from rosecourse import course
from rosecourse.builds import grading
from rosecourse.builds.grading import Build, PartResult
from rosecourse.course import CourseError, Lesson
from rosecourse.exercises import CheckResult
from rosecourse.exercises.common import Exercise, check
from rosecourse.plain import dumps, loads
from rosetrainer.errors import one_line

# Characters of a check's prints shown on the terminal; more fails the check.
OUTPUT_LIMIT = 64 * 1024
# One intra-op thread, the grader's and the check's process's: the models are tiny (one is
# fastest, and kind to a shared machine), and a fork whose parent ran a team of OpenMP
# threads hangs in its own first one (GNU OpenMP's pool does not survive a fork).
THREADS = 1
# The largest message a check's process may send (a probe's tensors are small).
MESSAGE_LIMIT = 256 * 1024 * 1024
# <linux/prctl.h>
PR_SET_PDEATHSIG, PR_GET_DUMPABLE, PR_SET_DUMPABLE = 1, 3, 4
PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37
TAMPERED = "reinstall rose, or `git checkout rosecourse rosetrainer roseinfer`, then check again"

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


def prctl(option: int, value: int = 0) -> int:
    """Linux's prctl(2) (elsewhere nothing, and 0)."""
    if not sys.platform.startswith("linux"):
        return 0
    return ctypes.CDLL(None).prctl(option, ctypes.c_ulong(value), 0, 0, 0)


def process_settings() -> tuple[int, int, int]:
    """What the grader changes of its process: (dumpable, child subreaper, torch threads)."""
    subreaper = ctypes.c_int()
    prctl(PR_GET_CHILD_SUBREAPER, ctypes.addressof(subreaper))
    return prctl(PR_GET_DUMPABLE), subreaper.value, torch.get_num_threads()


def set_process_settings(dumpable: int, subreaper: int, threads: int) -> None:
    prctl(PR_SET_DUMPABLE, dumpable)
    prctl(PR_SET_CHILD_SUBREAPER, subreaper)
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------
# The grader's side
# ---------------------------------------------------------------------------


def grading_fingerprint() -> str:
    """A digest of every Python file of the code that grades (the course's checks and the
    rose they run): it changes when one does."""
    digest = hashlib.sha256()
    for package in ("rosecourse", "rosetrainer", "roseinfer"):
        root = Path(importlib.import_module(package).__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root.parent)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


class Grader(contextlib.AbstractContextManager):
    """Grades the learner's files for some checks, one after the other, while it is
    entered (`with`): the process is the grader then, and is given back as it was after.

    Every check's code (a chapter's check module, a build's and its reference) is loaded
    here, and the grading code's files fingerprinted, before any learner code runs: what
    one check's learner code does to the files on disk (a chapter 00 answer that rewrites
    chapter 05's check, say) cannot change how a later check is judged here, and is found
    when the fingerprint changes: that check fails, and no later one runs."""

    def __init__(self, names: list[str], directory: Path, timeout: float) -> None:
        self.directory, self.timeout = directory, timeout
        self.checks = {name: course.find(name) for name in names}
        for chosen in self.checks.values():  # a chapter's check module, a build's reference
            exercise_of(chosen) if isinstance(chosen, Lesson) else grading.solution_source(chosen)
        self.fingerprint = grading_fingerprint()
        self.tampered = False

    def __enter__(self) -> Grader:
        # Undumpable: no process can ptrace this one, or read its memory. A child subreaper:
        # what a check's process leaves is re-parented here. One torch thread: the
        # reference's numbers as the check's process gets them, and no OpenMP thread busy
        # beside the one that forks it (a fork holds only that one).
        self.callers = process_settings()
        set_process_settings(0, 1, THREADS)
        return self

    def __exit__(self, *_: object) -> None:
        set_process_settings(*self.callers)

    def grade(self, name: str) -> bool:
        """Print the check's lines; whether it passed."""
        chosen = self.checks[name]
        if self.tampered:
            results = [
                CheckResult(
                    chosen.name,
                    False,
                    None,
                    f"not run: the grading code on disk changed ({TAMPERED})",
                )
            ]
        else:
            results = grade_in_child(chosen, self.directory, self.timeout)
            if grading_fingerprint() != self.fingerprint:
                self.tampered = True
                why = f"your code changed rose's or the course's files ({TAMPERED})"
                results = [CheckResult(chosen.name, False, None, why)]
        for result in results:
            print(result)
        failing = [r for r in results if not r.passed]
        if isinstance(chosen, Build):  # `hint` gives its first failing part's hints first
            parts = [r.part for r in failing if isinstance(r, PartResult)]
            course.note_failing_part(chosen.name, self.directory, parts[0] if parts else None)
        return bool(results) and not failing


def grade_in_child(
    chosen: Lesson | Build, directory: Path, timeout: float
) -> list[CheckResult | PartResult]:
    """The check's results on the learner's file for `chosen`, judged here from the
    answers of a check's process that ran at most `timeout` seconds."""
    try:
        course.learner_file(chosen, directory)  # no file, no process: its line at once
        exercise = exercise_of(chosen)
        exercise = reference_first(exercise) if exercise is not None else None
        with CheckProcess(chosen, directory) as child, time_limit(timeout):
            if exercise is not None:
                return [judge(chosen.name, exercise, child)]
            named = functools.cache(lambda: grading.diagnosis(chosen, child.ask("probe")[0]) or "")
            return [
                grading.verdict(chosen, part, *child.ask("part", index), named)
                for index, part in enumerate(chosen.parts)
            ]
    except (CourseError, Stopped) as error:
        return [CheckResult(chosen.name, False, None, str(error))]
    except Exception as error:  # what the check tripped over in the learner's answers
        why = f"your function broke the check: {one_line(error)}"
        return [CheckResult(chosen.name, False, None, why)]


def reference_first(exercise: Exercise) -> Exercise:
    """`exercise` with its reference's side made now: its probe's outcomes (which the
    exercise keeps) and each run's expected tokens. Made before the check's process is
    forked, they are made once, and that process starts with everything they loaded (the
    oracle model, the tokenizer, torch.export's machinery)."""
    exercise.observed_reference()
    made = [(label, expected(), run) for label, expected, run in exercise.runs]
    runs = [(label, functools.partial(list, want), run) for label, want, run in made]
    return dataclasses.replace(exercise, runs=runs)


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Stopped (in this, the main thread) once `seconds` have passed."""

    def stop(*_: object) -> NoReturn:
        raise Stopped(f"did not finish in {seconds:g} s (--timeout): does your code loop forever?")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def exercise_of(chosen: Lesson | Build) -> Exercise | None:
    """The Exercise whose `check` is `chosen`'s (every chapter's check is
    `check(EXERCISE, fn)` in its module); None for a build."""
    return sys.modules[chosen.check.__module__].EXERCISE if isinstance(chosen, Lesson) else None


def learners_function(*args: object, **kwargs: object) -> NoReturn:
    """What the grader's check holds for the learner's function: it runs in the check's
    process, never here."""
    raise AssertionError("the learner's function runs in the check's process only")


def judge(name: str, exercise: Exercise, child: CheckProcess) -> CheckResult:
    """The exercise's own check, run here, with its probe of the learner's function and its
    runs answered by the check's process."""

    def probe(fn: Callable) -> object:
        if getattr(fn, "fn", fn) is not learners_function:  # the reference's, a known wrong's
            return exercise.probe(fn)
        return child.ask("probe")[0]  # (watched there: contract.Watcher)

    def run(index: int, on_token: Callable[[int, int], None]) -> object:
        made, rows, raised = child.ask("run", index)
        for row in collections.Counter(made).elements():  # the steps it made, row by row
            on_token(row, 0)
        if raised is not None:  # as the learner's code raised it, to show as it
            raise type(str(raised[0]), (Exception,), {})(raised[1])
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
    return check(replay, learners_function, show=False)


class CheckProcess(contextlib.AbstractContextManager):
    """The check's process, as the grader sees it: `ask` a request and get the answer, and
    what it printed meanwhile shown. Leaving it (`with`) ends it and every process it left
    (a check that left one running fails)."""

    def __init__(self, chosen: Lesson | Build, directory: Path) -> None:
        self.channel, theirs = Pipe()
        self.before = children()  # this process's own, not the check's
        self.code: int | None = None  # its exit code, once it ended and was reaped
        grader = os.getpid()
        for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
            stream.flush()
        self.pid = os.fork()
        if self.pid == 0:  # the check's process: it never returns to the grader's code
            code = 1
            try:
                self.channel.close()
                check_process(chosen, directory, theirs, grader)
                code = 0
            finally:
                # At once: no exit handler or thread of the learner's (or the grader's) code
                # runs after the last answer.
                os._exit(code)
        theirs.close()
        self.shown, self.ends_a_line = 0, True

    def wait(self) -> int:
        """Its exit code once it ended (negative: the signal that killed it)."""
        if self.code is None:
            self.code = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.code

    def __exit__(self, kind: type | None, *_: object) -> None:
        self.channel.close()
        if self.code is None:  # (once reaped, its pid may be another process's)
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):  # what it started in its group
            os.killpg(self.pid, signal.SIGKILL)
        self.wait()
        left = end_leftovers(self.before)
        if not self.ends_a_line:  # what the grader prints next starts a line of its own
            print()
        if left and kind is None:
            raise Stopped(
                f"your code left processes running ({left}, ended now): end what it starts"
            )

    def ask(self, *request: object) -> list:
        """The check's process's answer to `request`, as plain data, once what it printed
        first is shown. Stopped when it stopped instead, or ended, or sent no plain data."""
        with contextlib.suppress(OSError):  # it ended: its last words are read below
            self.channel.send_bytes(dumps(request))
        while True:
            try:
                kind, *content = loads(self.channel.recv_bytes(MESSAGE_LIMIT))
            except EOFError:  # no process holds the pipe's other end: it ended
                raise Stopped(ended(self.wait())) from None
            except Exception as error:  # not plain data, or longer than MESSAGE_LIMIT
                raise Stopped(
                    f"the check's process sent what the grader cannot read ({one_line(error)[:200]}): "
                    "does your code write to the grader's pipe?"
                ) from None
            if kind != "printed":
                break
            self.show(str(content[0]))
        if kind == "stopped":
            raise Stopped(" ".join(str(content[0]).split())[:2000])
        return content

    def show(self, text: str) -> None:
        """Print what the check's process printed, up to OUTPUT_LIMIT characters in all."""
        kept = text[: OUTPUT_LIMIT - self.shown]
        self.shown += len(kept)
        sys.stdout.write(kept)
        sys.stdout.flush()
        self.ends_a_line = kept.endswith("\n") if kept else self.ends_a_line
        if len(kept) < len(text):
            raise Stopped(
                f"printed too much (output cut at {OUTPUT_LIMIT} characters): print less, "
                "or not in a loop"
            )


def children() -> set[int]:
    """The pids whose parent is this process (zombies included), read from /proc (none
    where there is no /proc)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):  # it ended while we looked
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            if int(stat.read_bytes().rpartition(b")")[2].split()[1]) == os.getpid():
                found.add(int(stat.parent.name))
    return found


def end_leftovers(before: set[int]) -> int:
    """SIGKILL and reap every child of this process not in `before` (what a check's process
    left: re-parented here), until none is left; how many were still running."""
    running = 0
    while left := children() - before:
        for pid in left:  # ours and unreaped: no other process can have its pid
            os.kill(pid, signal.SIGKILL)
            status = os.waitpid(pid, 0)[1]
            running += os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    return running


def ended(code: int) -> str:
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return f"the check's process {how} before its verdict: does your code call os._exit?"


# ---------------------------------------------------------------------------
# The check's process: a fork of the grader
# ---------------------------------------------------------------------------


class Printed(io.TextIOBase):
    """The check's process's stdout and stderr: what it prints goes to the grader, in order
    with its answers."""

    def __init__(self, channel: Connection) -> None:
        self.channel = channel

    def write(self, text: str) -> int:
        self.channel.send_bytes(dumps(("printed", text)))
        return len(text)


def check_process(
    chosen: Lesson | Build, directory: Path, channel: Connection, grader: int
) -> None:
    """Answer the grader's requests for one chapter's exercise or build until the grader
    closes the pipe (in the process forked from `grader`, the grader's pid)."""
    os.setsid()  # Ctrl-C reaches the grader only, which then ends this process
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a grader that dies takes this process along
    if os.getppid() != grader:  # it died before that was asked
        return
    prctl(PR_SET_DUMPABLE, 1)  # an ordinary process, as the learner's code expects
    fd = channel.fileno()
    os.closerange(3, fd)  # the grader's descriptors are none of the learner's business
    os.closerange(fd + 1, os.sysconf("SC_OPEN_MAX"))
    os.set_inheritable(fd, False)  # no program the learner's code starts holds the pipe
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout = sys.stderr = Printed(channel)
    torch.set_num_threads(THREADS)
    serve(chosen, directory, channel)


def serve(chosen: Lesson | Build, directory: Path, channel: Connection) -> None:
    """Load the learner's function (a build: module), then answer the grader's requests
    with it until the grader closes the pipe."""
    try:
        defaults = global_defaults()
        exercise = exercise_of(chosen)
        # The reference solution (`start --solutions`) is the one answer that may be rose's.
        answer_only = not course.is_solution(chosen, directory)
        if exercise is not None and answer_only:
            refuse_roses_pieces(chosen)  # (for good: this process ends with the check)
        # (A CourseError when the file does not load.)
        learners = (course.load_learner if exercise else course.load_module)(chosen, directory)
        learners = answering(learners) if exercise is not None else learners
        if exercise is None and answer_only:
            require_own_classes(chosen, learners)
        while True:
            try:
                request = loads(channel.recv_bytes())
            except EOFError:  # the grader closed the pipe: the check is over
                return
            reply = answer(chosen, exercise, learners, request)
            require_unchanged(defaults)
            if REFUSED:  # (even when the learner's code caught what rose's piece raised)
                raise Stopped(REFUSED[0])
            channel.send_bytes(dumps(reply))
    except BaseException as stopping:  # the learner's code raised what stops a program
        channel.send_bytes(dumps(("stopped", stopping_line(stopping))))


# ---------------------------------------------------------------------------
# Rose's own piece is no answer
# ---------------------------------------------------------------------------

# How many calls of the learner's function are running (`answering`); rose's refused
# pieces, as they were, by where they are (`refuse_roses_pieces`); and why the check
# stops: one of them ran inside such a call.
ANSWERING = [0]
ORIGINALS: dict[str, types.FunctionType] = {}
REFUSED: list[str] = []


def is_roses(value: object) -> bool:
    """Whether `value` (a function, a class) is rose's own code, not the course's."""
    return getattr(value, "__module__", "").partition(".")[0] in ("rosetrainer", "roseinfer")


def roses_pieces(chosen: Lesson) -> list[types.FunctionType]:
    """The functions of rose's own that are chapter `chosen`'s answer: its exercise's
    reference, when that is rose's, and what its reference solution delegates to (bound
    to a `rose_` name: course.binds_rose_piece)."""
    solution = vars(chosen.solution_module())
    found = [exercise_of(chosen).reference]
    found += [value for name, value in solution.items() if name.startswith("rose_")]
    found = [inspect.unwrap(fn) for fn in found if is_roses(fn)]  # (its decorators call it)
    return list({id(fn): fn for fn in found if isinstance(fn, types.FunctionType)}.values())


def answering(fn: Callable) -> Callable:
    """`fn`, the learner's function, counting the calls of it that are running (ANSWERING)."""

    @functools.wraps(fn)
    def answer(*args: object, **kwargs: object) -> object:
        ANSWERING[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            ANSWERING[0] -= 1

    return answer


def refuse_roses_pieces(chosen: Lesson) -> Callable[[], None]:
    """Make rose's pieces that are chapter `chosen`'s answer (roses_pieces) stop the check
    when they run inside the learner's function (`answering`), in this process, under
    whatever name they are reached by (imported under another, captured before the check
    swaps them, looked up at run time): their code is swapped for a stand-in that says
    so, and runs them as they were for the check's own code (a probe that compares with
    them). Rose's code never calls them inside the learner's: the check swaps the
    learner's function in wherever rose calls it. Returns what gives them back (the tests
    call it)."""
    kept = []
    for piece in roses_pieces(chosen):
        kept.append((piece, piece.__code__, piece.__defaults__, piece.__kwdefaults__))
        where = f"{piece.__module__}.{piece.__qualname__}"
        original = types.FunctionType(
            piece.__code__, piece.__globals__, piece.__name__, piece.__defaults__
        )
        original.__kwdefaults__ = piece.__kwdefaults__
        ORIGINALS[where] = original
        source = (
            "def refused(*args, **kwargs):\n"
            f"    return __import__('rosecourse.runner').runner.refused({where!r}, "
            f"{chosen.name!r}, args, kwargs)\n"
        )
        stand_in: dict[str, Any] = {}
        exec(compile(source, f"<rose's {where}, refused in the check>", "exec"), stand_in)
        piece.__code__ = stand_in["refused"].__code__
        piece.__defaults__ = piece.__kwdefaults__ = None  # (the stand-in takes any arguments)

    def give_back() -> None:
        for piece, *was in kept:
            piece.__code__, piece.__defaults__, piece.__kwdefaults__ = was
        ORIGINALS.clear()
        REFUSED.clear()

    return give_back


def refused(where: str, answer: str, args: tuple, kwargs: dict) -> object:
    """What rose's refused piece `where` does when called (`refuse_roses_pieces`): inside
    the learner's function, stop the check, even when the learner's code catches this
    (`serve` looks again); elsewhere, run as it was."""
    if not ANSWERING[0]:
        return ORIGINALS[where](*args, **kwargs)
    REFUSED.append(f"your {answer} runs rose's own {where}: the exercise is to write it")
    raise Stopped(REFUSED[-1])


def require_own_classes(chosen: Build, module: types.ModuleType) -> None:
    """Stopped when a class of the build's in the learner's `module` is rose's own, or
    subclasses one of rose's classes (a protocol aside), or a function of the build's is
    rose's own."""
    solution = chosen.solution_module()
    for name, value in vars(solution).items():
        if getattr(value, "__module__", None) != solution.__name__:
            continue  # what the solution imports
        mine = getattr(module, name, None)
        owned = mine.__mro__ if isinstance(mine, type) else [inspect.unwrap(mine)]
        for roses in owned:
            if is_roses(roses) and not getattr(roses, "_is_protocol", False):
                how = "is" if roses is owned[0] else "subclasses"
                raise Stopped(
                    f"your {name} {how} rose's own {roses.__module__}.{roses.__qualname__}: "
                    "the exercise is to write it"
                )


def global_defaults() -> dict[str, object]:
    return {name: get() for name, get in GLOBAL_DEFAULTS.items()}


def require_unchanged(before: dict[str, object]) -> None:
    for name, now in global_defaults().items():
        if now != before[name]:
            raise Stopped(
                f"your code changed torch's {name} from {before[name]} to {now} and left it "
                "so: a process-wide default is every caller's; leave it as you found it "
                "(pass dtype=, device= to the calls that need another)"
            )


def answer(chosen: Lesson | Build, exercise: Exercise | None, mine: Any, request: tuple) -> tuple:
    """The answer to one of the grader's requests, with `mine`, the learner's function (a
    build's: module): ("probe",), its probe; ("run", i): what run i made with the function
    swapped in (the steps each row made, the rows, what it raised); ("part", i): build
    part i's tape, and why it failed here."""
    if request[0] == "probe" and exercise is None:
        return ("probe", grading.probed(chosen, mine))
    if request[0] == "probe":
        return ("probe", exercise.observe(mine))
    if request[0] == "part":
        return ("part", *grading.observe(chosen, chosen.parts[request[1]], mine))
    _, _, run = exercise.runs[request[1]]
    made: collections.Counter[int] = collections.Counter()
    rows, raised = None, None
    try:
        with exercise.swapped_in(mine):
            rows = run(lambda row, _token: made.update([row]))
    except Exception as error:  # anything the learner's code raises is a finding
        raised = (type(error).__name__, one_line(error, with_type=False))
    return ("run", dict(made), rows, raised)


def stopping_line(stopping: BaseException) -> str:
    """The FAILED explanation for what stopped the check's process."""
    if isinstance(stopping, (Stopped, CourseError)):
        return str(stopping)
    if isinstance(stopping, Exception):  # out of the check's own steps (its probe, say)
        return f"your function broke the check: {one_line(stopping)}"
    return (  # SystemExit (what sys.exit raises), KeyboardInterrupt, ...
        f"your code raised {stopping!r}, which stops a program, not a check: return your "
        "answer, or raise an Exception"
    )
