"""User-facing errors, and the one place a command line turns them into a message.

Every entry point has one shape, `main(argv: list[str] | None = None) -> int`, and
ends in `run_cli`: a RoseError becomes `[prog] error: ...` on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

EXIT_USER_ERROR = 2  # what argparse uses too
EXIT_INTERRUPTED = 130  # the shell's code for a program stopped by Ctrl-C (128 + SIGINT)


class RoseError(Exception):
    """A mistake in what the user asked for (a path, a flag, a file): said in one line."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one `[prog] error: ...` line like every other mistake."""

    def error(self, message: str) -> NoReturn:
        raise RoseError(f"{message} (see --help)")


def run_cli(run: Callable[[], int | None], prog: str) -> int:
    """Run a command line's body; a RoseError becomes one line on stderr and exit code 2."""
    try:
        return run() or 0
    except RoseError as err:
        print(f"[{prog}] error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
