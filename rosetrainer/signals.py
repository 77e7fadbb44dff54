"""Stop between steps, and save, on Ctrl-C (SIGINT) or a polite kill (SIGTERM).

Schedulers, timeouts and `docker stop` end a job with SIGTERM; a user with Ctrl-C. The
first of either asks the loop to finish its step and save; a second one acts at once
(Python's default: KeyboardInterrupt for SIGINT, the end of the process for SIGTERM).
Stopping between steps keeps the saved state consistent.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


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
