"""Run one command, and end every process it started when it ends.

`python -m rosecourse.reaper LIFELINE [FD ...] -- COMMAND...` runs COMMAND (with the file
descriptors FD open in it) and waits. When COMMAND ends, when the other end of the
LIFELINE socket closes or is shut down for writing (the grader stopping the check, or
ending however it ends: Ctrl-C, kill -9), or when this process is sent SIGTERM, it kills
every process COMMAND started, down to the last grandchild, and exits. Before that, when
COMMAND ended by itself, it sends COMMAND's exit status (subprocess's returncode: minus
the signal that killed it) as one line on LIFELINE.

On Linux this process is a child subreaper (prctl PR_SET_CHILD_SUBREAPER): a process
that leaves its parent behind (a double fork, `setsid`, a daemon) is re-parented here,
not to init, so "every process COMMAND started" is exactly this process's descendants
whatever process group or session they moved to. Ending them is a loop: SIGKILL every
child, reap what died, until waitpid says there is no child left. A pid read from /proc
cannot be reused while its zombie is unreaped, and only this process reaps its
children, so nothing outside is ever signalled. Elsewhere (macOS) COMMAND runs in a
process group of its own and that group is killed: a process that left it is not found.

This module imports nothing but the standard library (no torch), so that it starts in
a few tens of milliseconds, and runs none of the learner's code.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import NoReturn

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def become_subreaper() -> bool:
    """Make orphaned descendants this process's children (Linux); whether it worked."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def children(parent: int) -> list[int]:
    """The pids whose parent is `parent` (zombies included), read from /proc."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as stat:
                    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
                    fields = stat.read().rpartition(b")")[2].split()
            except OSError:  # it ended while we looked
                continue
            if len(fields) > 1 and int(fields[1]) == parent:
                found.append(int(entry.name))
    return found


def end_all(group: int | None) -> None:
    """SIGKILL every descendant and reap it, until this process has no child at all.

    `group`: without a subreaper, the process group to kill instead of searching."""
    if group is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    me = os.getpid()
    while True:
        for pid in children(me):  # each is ours and unreaped: its pid is not reused
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            while os.waitpid(-1, os.WNOHANG)[0] != 0:
                pass  # a grandchild whose parent died is ours now: the next round kills it
        except ChildProcessError:
            return  # no child left: every process COMMAND started has ended
        time.sleep(0.002)


def main(argv: list[str]) -> NoReturn:
    split = argv.index("--")
    lifeline_fd, *pass_fds = (int(fd) for fd in argv[:split])
    command = argv[split + 1 :]
    lifeline = socket.socket(fileno=lifeline_fd)
    subreaper = become_subreaper()
    ending = threading.RLock()  # a SIGTERM may arrive while the main thread ends all
    child: subprocess.Popen | None = None

    def finish(code: int) -> NoReturn:
        with ending:  # one thread ends everything; another that gets here waits for the exit
            end_all(None if subreaper or child is None else child.pid)
            os._exit(code)

    def watch_lifeline() -> None:
        with contextlib.suppress(OSError):
            lifeline.recv(1)  # the grader never sends: this returns when it stops or ends
        finish(1)

    signal.signal(signal.SIGTERM, lambda *_: finish(1))
    threading.Thread(target=watch_lifeline, daemon=True).start()
    child = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        pass_fds=pass_fds,
        process_group=None if subreaper else 0,
    )
    for fd in pass_fds:  # the command holds them alone: they close when it ends
        os.close(fd)
    status = child.wait()
    with contextlib.suppress(OSError):
        lifeline.sendall(f"{status}\n".encode())
    finish(0)


if __name__ == "__main__":
    main(sys.argv[1:])
