"""Files that survive crashes: the one atomic writer, writable folders, OS errors in one line.

Every file rose writes for keeps (checkpoints, the token cache's meta.json, metrics
rewritten on resume, a downloaded text) goes through `write_atomically`: the bytes go
to a temporary file beside the target, reach the disk (fsync), and only then does
`os.replace` give them the target's name. A crash, a kill -9 or a full disk at any
moment leaves either the old file or the new one, never half of one.

A temporary file carries the writing process's id in its name
(`.<target>.<pid>.<random>.tmp`), so the next save can tell a leftover of a killed
save (its process is gone) from one being written right now, and remove it.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from rosetrainer.errors import RoseError

# What a failed file operation means to the user, by errno; anything else: the OS's words.
OS_CAUSES = {
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.EEXIST: "it exists and is not a directory",
    errno.ENOENT: "a part of the path does not exist",
}


def os_error_line(err: OSError, path: str | Path, doing: str) -> str:
    """One line for a failed file operation: what, where, why, and what to do."""
    cause = OS_CAUSES.get(err.errno or 0, err.strerror or type(err).__name__)
    return f"cannot {doing} {path}: {cause}; free space, fix the permissions or choose another path"


def ensure_writable_dir(path: str | Path, what: str) -> Path:
    """Create `path` if needed and prove a file can be written there, before any work starts."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise RoseError(f"{what} {path} is a file, not a directory; pass a directory path")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):  # write, then delete: the folder takes files
            pass
    except OSError as err:
        raise RoseError(f"{what}: {os_error_line(err, path, 'write to')}") from None
    return path


def _default_mode() -> int:
    """The permissions a plain open() would give a new file: 0o666 less the umask."""
    umask = os.umask(0)  # the only way to read the umask is to set it, then put it back
    os.umask(umask)
    return 0o666 & ~umask


def _remove_stale_temp_files(path: Path) -> None:
    """Delete temporary files of earlier saves of `path` whose process no longer runs."""
    for temp in path.parent.glob(f".{path.name}.*.tmp"):
        pid = temp.name[len(path.name) + 2 :].split(".", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            temp.unlink(missing_ok=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: no signal, only the check that the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def write_atomically(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Call write(file) on a temporary file, sync it, and rename it to `path`.

    The old `path`, if any, stays as it was unless the new one is complete on disk.
    OS errors (read-only, no space left, ...) become one RoseError line naming `path`.
    """
    path = Path(path)
    try:
        _remove_stale_temp_files(path)
        # Beside the target: os.replace is atomic only within one file system. The ".tmp"
        # suffix keeps it out of any "*.pt" search for checkpoints.
        fd, temp_name = tempfile.mkstemp(
            dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp"
        )
    except OSError as err:
        raise RoseError(os_error_line(err, path, "write")) from None
    try:
        os.fchmod(fd, _default_mode())  # mkstemp makes 0600 files; saves follow the umask
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(temp_name, path)
        _sync_directory(path.parent)  # and the rename itself survives a power cut
    except OSError as err:
        Path(temp_name).unlink(missing_ok=True)
        raise RoseError(os_error_line(err, path, "write")) from None
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise


def write_bytes_atomically(path: str | Path, payload: bytes) -> None:
    write_atomically(path, lambda f: f.write(payload))


def _sync_directory(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
