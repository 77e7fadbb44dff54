"""Each check in a fresh process of its own, with a time limit and a bounded output.

A check runs the learner's code inside the grader, so whatever that code does to its
process it does to the grader: `sys.exit(0)` ends it (and exit code 0 reads as a
pass), `while True: pass` never returns, `torch.set_default_dtype(torch.float64)`
changes the numbers of every chapter graded after it, a print in a loop floods the
terminal. So `rose-course check` grades each chapter in a child process
(`python -m rosecourse.runner`, started by `grade_in_child`) and believes only what
comes back from it:

- the verdict: the child sends {"passed": ...} over a socket as its very last act. A
  child that ends any other way (an exit code, a signal) failed, whatever its code;
- the time: a child still running after the limit is killed, with all it started;
- the output: the child's prints reach the terminal, up to a limit; past it the child
  is killed (a learner's debugging print fits easily, a flood does not).

Inside the child, a learner's code that raises what stops a program (SystemExit from
`sys.exit`, KeyboardInterrupt) or leaves one of torch's process-wide defaults changed
is one FAILED line too. Every failure is one line in the check's own form.

The socket is also the child's lifeline: when the grader ends, however it ends (Ctrl-C,
kill -9), the child reads the end of it and exits, so no loop outlives the grader.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import functools
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch

from rosecourse.builds.grading import Build
from rosecourse.course import CourseError, Lesson, find, grade, key, learner_file
from rosecourse.exercises import CheckResult

# Bytes of a check's output shown on the terminal; more fails the check.
OUTPUT_LIMIT = 64 * 1024
# Tiny models: one intra-op thread is fastest (and kind to a shared machine).
THREADS = int(os.environ.get("ROSE_COURSE_THREADS", "1"))

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


# ---------------------------------------------------------------------------
# The grader's side
# ---------------------------------------------------------------------------


def grade_in_child(
    chosen: Lesson | Build,
    directory: Path,
    timeout: float,
    output_limit: int = OUTPUT_LIMIT,
) -> bool:
    """`grade(chosen, directory)` in a fresh process: print what it prints (at most
    `output_limit` bytes), or one FAILED line for how it ended, if it did not finish
    within `timeout` seconds or ended without a verdict; whether it passed."""
    try:
        learner_file(chosen, directory)  # no file, no process: its line at once
    except CourseError as error:
        print(CheckResult(chosen.name, False, None, str(error)))
        return False
    ours, theirs = socket.socketpair()
    with ours:
        with theirs:
            child = subprocess.Popen(
                [sys.executable, "-m", __name__, key(chosen), str(directory)]
                + [str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=[theirs.fileno()],
                env={**os.environ, "PYTHONUNBUFFERED": "1"},  # prints arrive as they are made
                # Its own process group: Ctrl-C reaches the grader only, which then kills
                # the group (the child and anything it started).
                start_new_session=True,
            )
        try:
            stopped = forward_output(child, timeout, output_limit)
        finally:
            stop(child)
        verdict = None if stopped else read_verdict(ours)
    if verdict is not None:
        return verdict
    print(CheckResult(chosen.name, False, None, stopped or ended_without_verdict(child)))
    return False


def forward_output(child: subprocess.Popen, timeout: float, output_limit: int) -> str | None:
    """Copy the child's output to ours until it ends; why it had to be stopped, if it did."""
    assert child.stdout is not None
    deadline = time.monotonic() + timeout
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    shown = 0
    ends_a_line = True
    with selectors.DefaultSelector() as selector:
        selector.register(child.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(timeout=left):
                stopped = stopped_at(timeout)
                break
            chunk = os.read(child.stdout.fileno(), 65536)
            if not chunk:  # the child closed its output: it has ended
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=max(0.0, deadline - time.monotonic()))
                stopped = None if child.returncode is not None else stopped_at(timeout)
                break
            kept = chunk[: output_limit - shown]
            shown += len(kept)
            text = decoder.decode(kept, final=len(kept) < len(chunk))
            if text:
                sys.stdout.write(text)
                sys.stdout.flush()
                ends_a_line = text.endswith("\n")
            if len(kept) < len(chunk):
                stopped = (
                    f"printed too much (output cut at {output_limit} bytes): print less, "
                    "or not in a loop"
                )
                break
    if not ends_a_line:
        print()  # the verdict on a line of its own
    return stopped


def stopped_at(timeout: float) -> str:
    """Why a child still running at the time limit was stopped."""
    return f"did not finish in {timeout:g} s (--timeout): does your code loop forever?"


def stop(child: subprocess.Popen) -> None:
    """Kill the child's process group (it, and whatever it started), then reap the child."""
    # ProcessLookupError: the group has ended already (PermissionError, on macOS).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    if child.stdout is not None:
        child.stdout.close()


def read_verdict(channel: socket.socket) -> bool | None:
    """What the ended child sent as its last act: whether the check passed; None if nothing."""
    channel.settimeout(1.0)  # its end is closed: what it sent is there already
    message = b""
    with contextlib.suppress(OSError):
        while chunk := channel.recv(4096):
            message += chunk
    try:
        return bool(json.loads(message)["passed"])
    except (ValueError, KeyError, TypeError):
        return None


def ended_without_verdict(child: subprocess.Popen) -> str:
    code = child.returncode
    if code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    return f"the check's process {how} before its verdict: does your code call os._exit?"


# ---------------------------------------------------------------------------
# The child's side: python -m rosecourse.runner CHAPTER DIR FD
# ---------------------------------------------------------------------------


class ChangedDefault(BaseException):
    """The learner's code changed one of torch's process-wide defaults and left it so.

    A BaseException, like SystemExit: a check's `except Exception`, which takes what the
    learner's function raises as one of its findings, lets it through.
    """


def child_main(name: str, directory: Path, channel_fd: int) -> NoReturn:
    """Grade one chapter's exercise or one build (`name`: as `rose-course check` takes it),
    print its lines, send the verdict over `channel_fd`, and exit."""
    channel = socket.socket(fileno=channel_fd)
    channel.set_inheritable(False)  # nothing the learner's code starts holds it open
    threading.Thread(target=exit_with_grader, args=(channel,), daemon=True).start()
    torch.set_num_threads(THREADS)
    chosen = find(name)
    try:
        before = global_defaults()
        passed = grade(guarded(chosen), directory).passed
        if isinstance(chosen, Build):  # an exercise's check did this call by call
            require_unchanged(before)
    except BaseException as stopping:  # the learner's code raised what stops a program
        print(CheckResult(chosen.name, False, None, stopping_line(stopping)))
        passed = False
    sys.stdout.flush()
    sys.stderr.flush()
    channel.sendall(json.dumps({"passed": passed}).encode())
    # At once: no exit handler or thread of the learner's code runs after the verdict.
    os._exit(0)


def exit_with_grader(channel: socket.socket) -> None:
    """Block until the grader's end of the channel closes, then end this process."""
    with contextlib.suppress(OSError):
        channel.recv(1)  # the grader never sends: this returns when its end closes
    os._exit(1)


def guarded(chosen: Lesson | Build) -> Lesson | Build:
    """`chosen` with a check that fails the learner's function, with ChangedDefault, when
    its module's import or any call of it leaves one of torch's global defaults changed.
    A build's parts run the learner's classes in many places, so a build is checked once,
    after its parts have run (`graded`)."""
    if isinstance(chosen, Build):
        return chosen
    before_import = global_defaults()

    def check(fn: Callable) -> CheckResult:
        require_unchanged(before_import)

        @functools.wraps(fn)
        def call(*args: object, **kwargs: object) -> object:
            before = global_defaults()
            try:
                return fn(*args, **kwargs)
            finally:  # even when it raised: the change outlives the call all the same
                require_unchanged(before)

        return chosen.check(call)

    return dataclasses.replace(chosen, check=check)


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
