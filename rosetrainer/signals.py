"""Stop between steps, and save, on Ctrl-C (SIGINT) or a polite kill (SIGTERM).

Schedulers, timeouts and `docker stop` end a job with SIGTERM; a user with Ctrl-C. The
first of either asks the loop to finish its step and save; a second one acts at once
(KeyboardInterrupt for SIGINT, Terminated for SIGTERM: the run unwinds without saving).
Stopping between steps keeps the saved state consistent.

Before the loop (the run's lock taken, the data and model being set up) there is no step
to finish: Ctrl-C raises KeyboardInterrupt, and SIGTERM (`setup_interrupts`) raises
Terminated, one of them, so that the run unwinds alike, its lock file removed, nothing
saved. (Python's default for SIGTERM ends the process at once and left the lock file.)
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM where no step is running: the run unwinds as from Ctrl-C."""

    exit_code = 128 + signal.SIGTERM


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated


@contextlib.contextmanager
def setup_interrupts() -> Iterator[None]:
    """SIGTERM raises Terminated while the block runs (outside StopSignals' loop)."""
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class StopSignals:
    """`signum` is the signal that asked the run to stop, or None while none has."""

    def __init__(self, prog: str) -> None:
        self.prog = prog
        self.signum: int | None = None

    def __enter__(self) -> StopSignals:
        self.previous = {s: signal.signal(s, self.handle) for s in STOP_SIGNALS}
        return self

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
        signal.signal(signum, self.previous[signum])  # the second one acts at once
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"\n[{self.prog}] {name}: saving after this step (again to quit at once)",
              file=sys.stderr)  # fmt: skip

    def __exit__(self, *exc_info: Any) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by this signal: 128 + its number."""
        return 128 + (self.signum or signal.SIGINT)
