"""User-facing errors, and the one place a command line turns them into a message.

Every entry point has one shape, `main(argv: list[str] | None = None) -> int`, and
ends in `run_cli`: a RoseError becomes `[prog] error: ...` on stderr and exit code 2,
and so does a full disk wherever it strikes; Ctrl-C is one `[prog] interrupted: ...`
line and exit code 130. A failed file operation is said by `os_error_line`.
"""

from __future__ import annotations

import argparse
import errno
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

EXIT_USER_ERROR = 2  # what argparse uses too
EXIT_INTERRUPTED = 130  # the shell's code for a program stopped by Ctrl-C (128 + SIGINT)
# A write that failed for want of room: said in one line wherever it was not caught.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


# What a failed file operation means to the user, by errno; anything else: the OS's words.
OS_CAUSES = {
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "the file is larger than this process may write (ulimit -f)",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.EEXIST: "it exists and is not a directory",
    errno.ENOENT: "a part of the path does not exist",
}


def os_cause(err: OSError) -> str:
    """Why a file operation failed, in words: the common causes said plainly, else the OS's."""
    return OS_CAUSES.get(err.errno or 0, err.strerror or type(err).__name__)


def not_a_file(path: Path) -> str | None:
    """Why `path` cannot be read as a file of text, in words ("not found", "is a
    directory", "is not a regular file": a device such as /dev/zero, which never ends);
    None when it can."""
    if path.is_file():
        return None
    if path.is_dir():
        return "is a directory"
    return "is not a regular file" if path.exists() else "not found"


def os_error_line(err: OSError, path: str | Path, doing: str) -> str:
    """One line for a failed file operation: what, where, why, and what to do."""
    cause = os_cause(err)
    return f"cannot {doing} {path}: {cause}; free space, fix the permissions or choose another path"


def one_line(error: BaseException, with_type: bool = True) -> str:
    """An exception in one line, for a message that wraps it: its type and the first line
    of its message (with_type=False: the first line alone); its type alone when the
    message is empty. Libraries' messages can run to pages (a traceback, a source excerpt)."""
    lines = str(error).strip().splitlines()
    if not lines:
        return type(error).__name__
    return f"{type(error).__name__}: {lines[0].strip()}" if with_type else lines[0].strip()


class RoseError(Exception):
    """A mistake in what the user asked for (a path, a flag, a file): said in one line."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one `[prog] error: ...` line like every other mistake."""

    def error(self, message: str) -> NoReturn:
        raise RoseError(f"{message} (see --help)")


def run_cli(run: Callable[[], int | None], prog: str) -> int:
    """Run a command line's body: a RoseError, or a full disk it did not catch itself,
    becomes one line on stderr and exit code 2; Ctrl-C one line and exit code 130."""
    try:
        return run() or 0
    except RoseError as err:
        message = str(err)
    except OSError as err:
        if err.errno not in DISK_FULL:
            raise
        message = os_error_line(err, err.filename or "a file", "write")
    except KeyboardInterrupt:
        print(f"[{prog}] interrupted: stopped by Ctrl-C", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"[{prog}] error: {message}", file=sys.stderr)
    return EXIT_USER_ERROR
