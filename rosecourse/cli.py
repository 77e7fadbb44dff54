"""rose-course: write each chapter's piece in a workspace, and let the oracle grade it.

    rose-course list                    one line per exercise, then one per build
    rose-course start DIR               a workspace of stubs, one file per chapter and build
    rose-course start DIR --solutions   the reference solutions instead (CI; a stuck learner)
    rose-course check NN [--dir DIR]    grade chapter NN's file (exit 0 passed, 1 failed)
    rose-course check BUILD [--dir DIR] grade a build's file, one line per part (model, ...)
    rose-course check all [--dir DIR]   grade every chapter's and every build's file

A check swaps the learner's function in for the real piece, runs the real system on a
small seeded model and compares it with the oracle (rosecourse/exercises.py). Its
verdict is one line: the first step that differs and, for a known mistake, which one.
A build (rosecourse/builds/) is one of rose's main pieces written whole; its check runs
each part of it beside rose's own and prints a line per part.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

PROG = "rose-course"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    check.add_argument("chapter", help="a chapter number (00 .. 18), a build's name, or all")
    check.add_argument("--dir", type=Path, default=Path("."), help="the workspace (default: .)")
    return parser


def run(args: argparse.Namespace) -> int:
    # Imported here: `rose-course --help` and bad arguments answer without loading torch.
    import torch

    from rosecourse.builds.grading import Build
    from rosecourse.course import BUILDS, LESSONS, CourseError, find, grade, write_workspace

    if args.command == "list":
        for chosen in LESSONS:
            print(f"{chosen.chapter}  {chosen.file_name:<30} {chosen.task}")
        print("\nbuilds: rose's main pieces, written whole (rose-course check NAME)")
        for build in BUILDS:
            where = f"chapter{'s' * ('-' in build.chapters)} {build.chapters}"
            print(f"{build.name:<15} {build.file_name:<26} {where:<15} {build.task}")
        return 0
    if args.command == "start":
        written = write_workspace(args.dir, args.solutions)
        kind = "reference solutions" if args.solutions else "stubs"
        kept = len(LESSONS) + len(BUILDS) - len(written)
        print(f"wrote {len(written)} {kind} in {args.dir}" + (f" (kept {kept})" if kept else ""))
        if not args.solutions:
            print(f"next: write one, then `rose-course check NN (or a build) --dir {args.dir}`")
        return 0
    try:
        chosen = [*LESSONS, *BUILDS] if args.chapter == "all" else [find(args.chapter)]
    except CourseError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    if not args.dir.is_dir():
        print(f"{PROG}: error: no workspace at {args.dir}: run `{PROG} start DIR`", file=sys.stderr)
        return 2
    torch.set_num_threads(int(os.environ.get("ROSE_COURSE_THREADS", "1")))  # tiny models
    # A chapter's exercise is named by its number, a build by its name.
    names = [c.name if isinstance(c, Build) else c.chapter for c in chosen]
    failed = [name for c, name in zip(chosen, names, strict=True) if not grade(c, args.dir).passed]
    if len(chosen) > 1:
        passed = len(chosen) - len(failed)
        print(
            f"{passed}/{len(chosen)} passed" + (f"; failing: {' '.join(failed)}" if failed else "")
        )
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
