"""Files that survive crashes: the one atomic writer, writable folders.

Every file rose writes for keeps (checkpoints, the token cache's meta.json, metrics
rewritten on resume, a downloaded text) goes through `write_atomically`: the bytes go
to a temporary file beside the target, reach the disk (fsync), and only then does
`os.replace` give them the target's name. A crash, a kill -9 or a full disk at any
moment leaves either the old file or the new one, never half of one. A folder written
as a whole (an exported model) goes through `new_directory`, the same idea for folders.

A temporary file carries the writing process's id in its name
(`.<target>.<pid>.<random>.tmp`), so the next save can tell a leftover of a killed
save (its process is gone) from one being written right now, and remove it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from rosetrainer.errors import RoseError, os_error_line


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


def _default_mode(requested: int = 0o666) -> int:
    """The permissions a plain open() (0o666) or mkdir (0o777) would give: less the umask."""
    umask = os.umask(0)  # the only way to read the umask is to set it, then put it back
    os.umask(umask)
    return requested & ~umask


def _remove_stale_temp_files(path: Path) -> None:
    """Delete temporary files of earlier saves of `path` whose process no longer runs."""
    for temp in path.parent.glob(f".{path.name}.*.tmp"):
        pid = temp.name[len(path.name) + 2 :].split(".", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            if temp.is_dir():  # a folder being written by `new_directory`
                shutil.rmtree(temp, ignore_errors=True)
            else:
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


@contextlib.contextmanager
def new_directory(
    path: str | Path, overwrite: bool = False, source: str | Path | None = None
) -> Iterator[Path]:
    """A folder to fill that appears at `path` only once complete: write_atomically for folders.

    Yields an empty temporary folder beside `path`; when the block ends without an error
    it is renamed to `path`, otherwise removed. An existing non-empty `path` is refused
    unless `overwrite`, and then replaced only after the new folder is complete. A
    mistake about `path` (a file, not writable, the `source` the folder is made from,
    or a folder holding it or inside it) is reported before the block runs, so no work
    is done for a folder that cannot be written and nothing is deleted.
    """
    path = Path(path)
    if source is not None:
        refuse_overlap(path, Path(source))
    if path.is_symlink():
        # A link to a folder: the folder it leads to is the one filled (or replaced), and
        # the link stays a link (renaming the link itself aside would turn it into a folder).
        path = path.resolve()
    if path.exists() and not path.is_dir():
        raise RoseError(f"{path} is a file, not a directory; pass a directory path")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise RoseError(f"{path} already exists and is not empty; pass --overwrite to replace it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temp_files(path)
        temp = Path(
            tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
        )
    except OSError as err:
        raise RoseError(os_error_line(err, path, "write")) from None
    try:
        temp.chmod(_default_mode(0o777))  # mkdtemp makes 0700; follow the umask
        yield temp
        for file in temp.iterdir():  # every file's bytes on disk before the folder is renamed
            file.chmod(_default_mode())  # whatever wrote it (safetensors makes 0600 files)
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        _replace_directory(temp, path)
        _sync_directory(path.parent)
    except OSError as err:
        shutil.rmtree(temp, ignore_errors=True)
        raise RoseError(os_error_line(err, path, "write")) from None
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def refuse_overlap(path: Path, source: Path) -> None:
    """`path` is to be replaced as a whole: it must not be `source`, hold it, or lie
    inside it (symbolic links followed: another name for the same place is the place).
    A source that is a link counts twice, as the link (replacing the folder that holds
    the link deletes whatever else that folder holds) and as what it leads to."""
    out = _resolved(path)
    as_named = _resolved(source.absolute().parent) / source.absolute().name
    for keep in dict.fromkeys([as_named, _resolved(source)]):
        if out == keep or out in keep.parents:
            what = "is" if out == keep else "holds"
            raise RoseError(
                f"{path} {what} {source}, which it is made from: replacing it would delete "
                "that; write to another folder"
            )
        if keep in out.parents:
            raise RoseError(f"{path} is inside {source}, which it is made from; write elsewhere")


def _resolved(path: Path) -> Path:
    """`path` with every symbolic link followed; a chain of links that comes back to
    itself is a RoseError naming the path (Python raises RuntimeError or, from 3.13,
    OSError)."""
    try:
        return path.resolve()
    except (RuntimeError, OSError) as err:
        if isinstance(err, OSError) and err.errno != errno.ELOOP:
            raise RoseError(os_error_line(err, path, "read")) from None
        raise RoseError(
            f"{path}: its symbolic links lead back to themselves (a loop): "
            "point it at a real file or folder"
        ) from None


def _replace_directory(new: Path, path: Path) -> None:
    """Rename `new` to `path`; a non-empty `path` is first moved aside, then removed."""
    if not path.is_dir() or not any(path.iterdir()):
        os.replace(new, path)  # rename(2) replaces an empty directory in one step
        return
    old = path.parent / f".{path.name}.{os.getpid()}.old.tmp"
    os.replace(path, old)
    try:
        os.replace(new, path)
    except OSError:
        os.replace(old, path)  # put the old folder back: the caller's error says why
        raise
    shutil.rmtree(old, ignore_errors=True)
