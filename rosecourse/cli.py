"""rose-course: write each chapter's piece in a workspace, and let the oracle grade it.

    rose-course list                    one line per exercise, then one per build
    rose-course start DIR               a workspace of stubs, one file per chapter and build
    rose-course start DIR --solutions   the reference solutions instead (CI; a stuck learner)
    rose-course check NN [--dir DIR]    grade chapter NN's file (exit 0 passed, 1 failed)
    rose-course check BUILD [--dir DIR] grade a build's file, one line per part (model, ...)
    rose-course check all [--dir DIR]   grade every chapter's and build's file, then a table
    rose-course hint NAME [--dir DIR]   the next hint for chapter NAME or a build (the idea
                                        first, the near-code last); --seen: the ones given

A file that is still the untouched stub is "not written yet" at once: read, not run, and
no torch loaded. A check swaps the learner's function in for the real piece, runs the
real system on a small seeded model and compares it with the oracle
(rosecourse/exercises/). Its verdict is one line: the first step that differs and, for a
known mistake, which one.
A build (rosecourse/builds/) is one of rose's main pieces written whole; its check runs
each part of it beside rose's own and prints a line per part.
A stub states the contract, not the how: that comes from `hint`, one hint a call, noted
in the workspace; `check` says how many of them were used ("hints used: 2 of 6").
Each check runs in a process of its own, with a time limit (rosecourse/runner.py): code
that exits, loops, floods the output or changes torch's defaults fails in one line, and
no chapter's code reaches another's check.

Mistakes (a chapter that is not one, a workspace that cannot be written, a full disk)
are one `rose-course: error: ...` line and exit code 2; Ctrl-C stops the checks and
exits 130.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import textwrap
from pathlib import Path
from typing import NoReturn

from rosetrainer.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, RoseError, os_cause

PROG = "rose-course"
# Seconds one chapter's check may take, from its process's start to its verdict. The
# slowest reference solution's takes about 4 s on one busy CPU core; this is far above.
DEFAULT_TIMEOUT = 60.0


# The longest --timeout: a week, within what the runner's waits take (select(2) and
# the like refuse a timeout past about 24.8 days: an OverflowError).
MAX_TIMEOUT = 7 * 24 * 3600.0


def seconds(text: str) -> float:
    """argparse type: a positive number of seconds, at most MAX_TIMEOUT."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT):
        raise argparse.ArgumentTypeError(
            f"not a positive number of seconds up to {MAX_TIMEOUT:.0f} (a week): {text!r}"
        )
    return value


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one `rose-course: error: ...` line (exit code 2) like
    every other mistake, not a usage line and then the error."""

    def error(self, message: str) -> NoReturn:
        print(f"{PROG}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog=PROG,
        description="rose's course: write each chapter's piece, and check it against the oracle.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="one line per exercise and per build")
    start = commands.add_parser("start", help="write a workspace of stub files")
    start.add_argument("dir", type=Path, help="the workspace folder (created if missing)")
    start.add_argument(
        "--solutions", action="store_true", help="write the reference solutions instead"
    )
    check = commands.add_parser("check", help="grade one chapter's or build's file, or all")
    check.add_argument(
        "chapter", help="a chapter number or a build's name (as `rose-course list` shows), or all"
    )
    check.add_argument("--dir", type=Path, default=Path("."), help="the workspace (default: .)")
    check.add_argument(
        "--timeout",
        type=seconds,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"how long one chapter's check may take (default: {DEFAULT_TIMEOUT:g})",
    )
    hint = commands.add_parser("hint", help="the next hint for one chapter's exercise or build")
    hint.add_argument(
        "chapter", help="a chapter number or a build's name (as `rose-course list` shows)"
    )
    hint.add_argument("--dir", type=Path, default=Path("."), help="the workspace (default: .)")
    hint.add_argument(
        "--seen", action="store_true", help="show the hints given so far again, and no new one"
    )
    return parser


def run(args: argparse.Namespace) -> int:
    # Imported here: `rose-course --help` and bad arguments answer without loading torch;
    # so do `start` and a check of an untouched stub (rosecourse.course loads no check).
    from rosecourse import course
    from rosecourse.course import BUILD_NAMES, LESSONS, CourseError

    if args.command == "list":
        for chosen in LESSONS:
            print(f"{chosen.chapter}  {chosen.file_name:<30} {chosen.task}")
        print(f"\nbuilds: rose's main pieces, written whole ({PROG} check NAME)")
        for build in map(course.build, BUILD_NAMES):
            where = f"chapter{'s' * ('-' in build.chapters)} {build.chapters}"
            print(f"{build.name:<15} {build.file_name:<26} {where:<15} {build.task}")
        return 0
    if args.command == "start":
        written, kept = course.write_workspace(args.dir, args.solutions)
        kind = "reference solutions" if args.solutions else "stubs"
        there = len(LESSONS) + len(BUILD_NAMES) - len(written) - len(kept)
        print(
            f"wrote {len(written)} {kind} in {args.dir}"
            + (f", {there} there already" if there else "")
        )
        if kept:
            print(f"kept your work: {' '.join(path.name for path in kept)}")
        if not args.solutions:
            print(f"next: write one, then `{PROG} check NN (or a build) --dir {args.dir}`")
            print(f"stuck? `{PROG} hint NN --dir {args.dir}` gives one hint at a time")
        return 0
    if args.command == "hint":
        return hint(args.chapter, args.dir, args.seen)
    names = course.check_names() if args.chapter == "all" else [course.check_name(args.chapter)]
    if not args.dir.is_dir():
        raise CourseError(f"no workspace at {args.dir}: run `{PROG} start DIR`")
    verdicts = check(names, args.dir, args.timeout)
    hints = {name: course.hints_used(name, args.dir) for name in names}
    if len(names) == 1:
        (name,) = names
        used, total = hints[name]
        stuck = verdicts[name] != "passed" and used < total
        where = "" if args.dir == Path(".") else f" --dir {args.dir}"
        print(
            f"hints used: {used} of {total}"
            + (f" (stuck? `{PROG} hint {name}{where}` gives the next)" if stuck else "")
        )
    else:
        files = {name: course.file_name(name) for name in names}
        width = max(map(len, files.values()))
        print(f"\n{'check':<13}  {'file':<{width}}  {'hints':<5}  verdict")
        for name in names:
            used, total = hints[name]
            print(f"{name:<13}  {files[name]:<{width}}  {f'{used}/{total}':<5}  {verdicts[name]}")
        summary = [f"{list(verdicts.values()).count('passed')}/{len(names)} passed"]
        for verdict, said in ((course.UNWRITTEN, course.UNWRITTEN), ("FAILED", "failing")):
            these = [name for name in names if verdicts[name] == verdict]
            summary += [f"{said}: {' '.join(these)}"] if these else []
        print("; ".join(summary))
    return 0 if all(verdict == "passed" for verdict in verdicts.values()) else 1


def hint(name: str, directory: Path, seen: bool) -> int:
    """Print the next hint of check `name` (and note it in the workspace), or with `seen`
    the hints given so far; say so when none is left. No torch: hints are read from the
    solutions' source."""
    from rosecourse import course
    from rosecourse.course import CourseError

    if name == "all":
        raise CourseError("hint takes one exercise: a chapter's number or a build's name")
    name = course.check_name(name, or_all=False)
    if not (directory / course.file_name(name)).is_file():  # a workspace holds its file
        raise CourseError(
            f"no {course.file_name(name)} in {directory}: run `{PROG} start {directory}` "
            "first (or pass --dir)"
        )
    texts = course.hints(name)
    given = course.given_hints(name, course.read_hint_record(directory))
    total = len(texts)
    if seen:
        for index in given:
            print(hint_text(name, index + 1, total, texts[index]))
        if not given:
            print(f"no hints given for {name} yet: `{PROG} hint {name}` gives the first")
        return 0
    following = course.hint_next(name, directory)
    if following is None:
        print(
            f"no more hints for {name}: all {total} given (--seen shows them again; the "
            f"reference solution: `{PROG} start answers/ --solutions`)"
        )
        return 0
    number, text, part = following
    print(hint_text(name, number, total, text, part))
    return 0


def hint_text(name: str, number: int, total: int, text: str, part: str | None = None) -> str:
    """A hint as printed: numbered (and, for a build, the failing part it is about), its
    prose wrapped to the terminal's usual width, its code lines (indented by four spaces
    in the solution's HINTS) as they are."""
    about = f" (about {name}/{part}, which failed)" if part else ""
    lines = [f"hint {number} of {total} for {name}{about}:"]
    for line in text.splitlines():
        if line.startswith("    "):
            lines.append(line)
        else:
            lines += textwrap.wrap(line, 88, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(lines)


def check(names: list[str], directory: Path, timeout: float) -> dict[str, str]:
    """Grade each check's file in `directory`, in order; each one's verdict ("passed",
    "FAILED", or course.UNWRITTEN). An untouched
    stub is answered at once, from its source (`course.unwritten`: no torch, no process);
    anything else in processes of its own, one check after the other, so that one
    chapter's code cannot stop, stall or change the grading of the next, nor reach this
    process's memory (rosecourse/runner.py)."""
    from rosecourse import course

    unwritten = {name: course.unwritten(name, directory) for name in names}
    written = [name for name in names if unwritten[name] is None]
    grading: contextlib.AbstractContextManager = contextlib.nullcontext()
    if written:
        from rosecourse.runner import Grader

        grading = Grader(written, directory, timeout)  # every check loaded before any runs
    verdicts = {}
    with grading as grader:  # (this process is given back as it was)
        for name in names:
            lines = unwritten[name]
            if lines is not None:
                print("\n".join(lines))
                verdicts[name] = course.UNWRITTEN
            else:
                verdicts[name] = "passed" if grader.grade(name) else "FAILED"
    return verdicts


def os_error_line(error: OSError) -> str:
    """One line for a failed file operation nothing nearer explained (a full disk under
    the output, say)."""
    cause = os_cause(error)
    return f"{error.filename}: {cause}" if error.filename else cause


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = run(args)
        sys.stdout.flush()  # an output that cannot be written fails here, in one line
        return code
    except RoseError as error:
        message = str(error)
    except BrokenPipeError:  # stdout was closed early (piped into `head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as error:
        message = os_error_line(error)
    except KeyboardInterrupt:  # the checks' processes are killed already (runner.stop)
        print(f"{PROG}: interrupted: stopped by Ctrl-C", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
