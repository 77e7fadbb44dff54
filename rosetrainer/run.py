"""One run, one owner: the run's files are checked and locked before any work starts.

`open_run` is where a training process claims its run (RunFiles: last.pt, best.pt,
metrics.jsonl, ... or a.pt, a.best.pt, ...):

* the folder must take files (not read-only, not a file, not under /proc), checked now
  and not after an hour of tokenising;
* an exclusive lock (flock on the run's lock file, released by the kernel when the
  process ends, however it ends) keeps a second process from training the same run;
  the run removes the lock file when it ends (finished, failed or stopped by Ctrl-C),
  so a finished run leaves only its own files;
* a new run never touches the files of an earlier one unless --overwrite says so: it
  refuses, naming the run it found and the choices (--resume, --overwrite, another path).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import torch

from rosetrainer.checkpoint import RunFiles
from rosetrainer.config import TrainConfig
from rosetrainer.errors import RoseError
from rosetrainer.files import ensure_writable_dir


@contextlib.contextmanager
def open_run(cfg: TrainConfig, is_main: bool) -> Iterator[RunFiles]:
    """The run's files, locked for as long as the block runs (on rank 0, which writes them)."""
    files = RunFiles.of(cfg.checkpoint_path)
    if not is_main:
        yield files
        return
    if files.folder.exists() and not files.folder.is_dir():
        raise RoseError(
            f"--checkpoint-path {cfg.checkpoint_path}: {files.folder} is a file; pass a run "
            f"directory or a path ending in .pt"
        )
    ensure_writable_dir(files.folder, "--checkpoint-path")
    with run_lock(files.lock) as lock_file:
        if not cfg.resume and not cfg.overwrite and files.existing():
            raise RoseError(
                f"{files.last if files.last.exists() else files.folder} already holds a run "
                f"({describe_run(files)}): continue it with --resume (and a larger --max-steps), "
                f"replace it with --overwrite, or pass another --checkpoint-path"
            )
        sign(lock_file)
        yield files


@contextlib.contextmanager
def run_lock(path: Path) -> Iterator[TextIO]:
    """Hold an exclusive lock on `path`; sign it with this process's id (`sign`) once
    the run is really claimed.

    However the block ends (a finished run, a refused one, no data offline, an error, a
    Ctrl-C), the lock file is removed while still held, before the lock is let go: the
    file at `path` is then the one this process locked (no process removes it without
    holding its lock), so another live run's lock is never removed. A process that
    opened the file just before it went locks a file no longer in the folder: it checks,
    once it holds the lock, that `path` is still the file it locked, and opens it again
    if not (two processes never both hold the run). A process killed outright (SIGKILL)
    leaves its file; the kernel has let its lock go, so the next run takes it over.
    """
    while True:
        lock_file = _open_lock_file(path)
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.seek(0)
            holder = lock_file.read().strip() or "unknown"
            lock_file.close()
            raise RoseError(
                f"another process (pid {holder}) is training in {path.parent} ({path} is "
                "locked: one trainer writes in a folder); wait for it to end, or pass "
                "another --checkpoint-path"
            ) from None
        if _still_at(lock_file, path):
            break
        lock_file.close()  # a failed run removed it after we opened it: open the new one
    try:
        yield lock_file
    finally:
        if _still_at(lock_file, path):  # (it is, unless someone replaced it by hand)
            path.unlink(missing_ok=True)
        fcntl.flock(lock_file, fcntl.LOCK_UN)
        lock_file.close()


def _open_lock_file(path: Path) -> TextIO:
    """The lock file (made if missing) opened for reading and appending."""
    return os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o666), "a+", encoding="utf-8")


def _still_at(lock_file: TextIO, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(lock_file.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


def sign(lock_file: TextIO) -> None:
    lock_file.seek(0)
    lock_file.truncate()
    lock_file.write(f"{os.getpid()}\n")
    lock_file.flush()


def describe_run(files: RunFiles) -> str:
    """The step and best validation loss of the run at `files`, read without loading it all."""
    if not files.last.is_file():
        return "files " + ", ".join(p.name for p in files.existing())
    try:  # mmap: only the few bytes of two numbers are read, not the weights
        ckpt = torch.load(files.last, map_location="cpu", weights_only=True, mmap=True)
        return f"step {ckpt['step']}, best val loss {ckpt['best_val_loss']:.4f}"
    except Exception:  # a damaged file is still a run not to overwrite silently
        return f"{files.last.name} cannot be read"
