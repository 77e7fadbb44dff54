"""User-facing errors, and the one place a command line turns them into a message."""

from __future__ import annotations

import sys
from collections.abc import Callable


class RoseError(Exception):
    """A mistake in what the user asked for (a path, a flag, a file): said in one line."""


def run_cli(main: Callable[[], int | None], prog: str) -> None:
    """Run a CLI entry point; a RoseError becomes one line on stderr and exit code 2."""
    try:
        code = main()
    except RoseError as err:
        print(f"[{prog}] error: {err}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code or 0)
