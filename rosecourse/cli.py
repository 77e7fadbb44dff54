"""rose-course: write each chapter's piece in a workspace, and let the oracle grade it.

    rose-course list                   one line per exercise: chapter, name, what to write
    rose-course start DIR              a workspace of stubs, one file per chapter
    rose-course start DIR --solutions  the reference solutions instead (CI; a stuck learner)
    rose-course check NN [--dir DIR]   grade chapter NN's file (exit 0 passed, 1 failed)
    rose-course check all [--dir DIR]  grade every chapter's file

A check swaps the learner's function in for the real piece, runs the real system on a
small seeded model and compares it with the oracle (rosecourse/exercises/). Its
verdict is one line: the first step that differs and, for a known mistake, which one.
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
    commands.add_parser("list", help="one line per exercise")
    start = commands.add_parser("start", help="write a workspace of stub files")
    start.add_argument("dir", type=Path, help="the workspace folder (created if missing)")
    start.add_argument(
        "--solutions", action="store_true", help="write the reference solutions instead"
    )
    check = commands.add_parser("check", help="grade one chapter's file, or all")
    check.add_argument("chapter", help="a chapter number (00 .. 17), or all")
    check.add_argument("--dir", type=Path, default=Path("."), help="the workspace (default: .)")
    return parser


def run(args: argparse.Namespace) -> int:
    # Imported here: `rose-course --help` and bad arguments answer without loading torch.
    import torch

    from rosecourse.course import LESSONS, CourseError, grade, lesson, write_workspace

    if args.command == "list":
        for chosen in LESSONS:
            print(f"{chosen.chapter}  {chosen.file_name:<30} {chosen.task}")
        return 0
    if args.command == "start":
        written = write_workspace(args.dir, args.solutions)
        kind = "reference solutions" if args.solutions else "stubs"
        kept = len(LESSONS) - len(written)
        print(f"wrote {len(written)} {kind} in {args.dir}" + (f" (kept {kept})" if kept else ""))
        if not args.solutions:
            print(f"next: write one, then `rose-course check NN --dir {args.dir}`")
        return 0
    try:
        chosen = LESSONS if args.chapter == "all" else [lesson(args.chapter)]
    except CourseError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    if not args.dir.is_dir():
        print(f"{PROG}: error: no workspace at {args.dir}: run `{PROG} start DIR`", file=sys.stderr)
        return 2
    torch.set_num_threads(int(os.environ.get("ROSE_COURSE_THREADS", "1")))  # tiny models
    failed = [c.chapter for c in chosen if not grade(c, args.dir).passed]
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
