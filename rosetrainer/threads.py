"""How many threads PyTorch computes with on a CPU that other programs share.

PyTorch runs each CPU operation on a team of OpenMP threads, one per core by default,
and the team's threads wait for each other at the end of every operation by spinning.
On an idle machine that is the fastest choice. Beside other busy programs it collapses:
once there are more runnable threads than cores, the kernel takes a core from one team
thread for a whole time slice, and the others spin at the barrier until it gets the
core back. The shorter each operation, the larger the share of waiting, so the small
models a learner trains suffer most (docs/benchmarks.md, "A busy machine", has the
figures beside two busy programs of equal priority: `python -m benchmarks.contention`).

So rose's default, "auto", starts with torch's own count (one thread per core) and,
between steps, looks at how many *other* threads are ready to run on the machine; while
they keep cores busy it computes on the cores they leave (at least one), and takes the
cores back once they are free again. A core counts as taken only when other programs are
runnable on it nearly all the time: one busy part of the time (a load generator beside a
server) leaves gaps that are worth a thread. The team then never holds more threads than there
are cores for it, so its spinning waits stay short, and OpenMP's waiting policy can stay
its default (spin, then sleep), which is the fast one on free cores. A count the user
gives (`--num-threads N`, or OMP_NUM_THREADS in the environment) is kept as given.

How "ready to run" is read: on Linux, the kernel's count of runnable threads
(`procs_running` in /proc/stat) less this process's own runnable threads (its spinning
team included), smoothed; elsewhere the one-minute load average less this process's
threads, which follows a change in about a minute. The samples are taken by a thread of
their own, at moments that have nothing to do with the steps. Between steps would be the
worst moment: it is when a server's clients wake to read the tokens it has just sent, so
a client runnable a few percent of the time was runnable in most samples taken there, and
held the server to one thread (docs/benchmarks.md, "A busy machine", has the figures).
"""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from pathlib import Path

import torch

from rosetrainer.errors import RoseError

# A sample of the other runnable threads this often, by the sampling thread (each reads
# /proc/stat and a stat file per thread of this process: a server's few dozen threads
# take a fraction of a millisecond) ...
SAMPLE_EVERY_S = 0.05
# ... and a new thread count at most this often, between steps, from the samples' moving
# average (weight of the newest sample: SMOOTHING). A busy program shows as runnable in
# almost every sample; a program that wakes up for a moment, in few.
DECIDE_EVERY_S = 0.2
SMOOTHING = 0.2
# The sampling thread ends once no step has asked for a count for this long (an `LLM`
# between two generate calls), and the next step starts it again.
SAMPLE_UNTIL_IDLE_S = 1.0
# The smoothed share of samples in which other programs keep a core runnable for rose to
# leave it to them (`_for_load`).
BUSY_SHARE = 0.95


# --num-threads at most this many per core this process may run on: more threads than
# cores only wait for each other, and a count in the tens of thousands crashes OpenMP
# (too many threads to start).
MAX_THREADS_PER_CORE = 4


def omp_count(value: str) -> int | None:
    """The thread count OMP_NUM_THREADS sets ("4", or a list per nesting level, "4,1"), or
    None where OpenMP ignores it ("abc", "0", "-3")."""
    first = value.split(",")[0].strip()
    # (ASCII digits only: "²" is a digit to str.isdigit, but not to int nor to OpenMP)
    return int(first) if first.isascii() and first.isdigit() and int(first) > 0 else None


def usable_cores() -> int:
    """The cores this process may run on (its affinity), not the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def own_runnable_threads() -> int:
    """This process's threads that are running or ready to run (Linux; 0 elsewhere)."""
    count = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended between the listing and the read
            continue
        # "pid (name) S ...": the state follows the name, which may hold spaces or ")"
        if stat[stat.rindex(")") + 2] == "R":
            count += 1
    return count


def other_runnable_threads() -> float | None:
    """Threads of other programs that are running or ready to run now; None where the
    machine does not tell."""
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"procs_running"):
                    running = int(line.split()[1])  # (the reading thread is one of them)
                    return 0 if running <= 1 else max(0, running - own_runnable_threads())
    except (OSError, ValueError, IndexError):
        pass
    try:
        return max(0.0, os.getloadavg()[0] - torch.get_num_threads())
    except (AttributeError, OSError):  # (no load average on Windows)
        return None


class Threads:
    """The torch thread count of this process's compute thread: fixed, or "auto" (the
    module's docstring). Made once by a front door (rose-generate, rose-serve, `LLM`, the
    trainer), told what it chose (`describe`), and asked between steps to follow the
    machine's load (`adapt`) by the thread that computes: each thread has its own OpenMP
    count, so the first `adapt` of a new compute thread sets it there."""

    def __init__(self, num_threads: int | None = None, follow_load: bool = True) -> None:
        """num_threads: a fixed count (--num-threads); None: OMP_NUM_THREADS if the
        environment sets it, else auto. follow_load=False: auto picks a count for the
        load at the start and keeps it (compiled kernels keep the count they were built
        for: torch.compile's CPU code names it in every parallel loop)."""
        most = MAX_THREADS_PER_CORE * usable_cores()  # (under taskset: the cores it may use)
        if num_threads is not None and (
            not isinstance(num_threads, int)
            or isinstance(num_threads, bool)
            or not 1 <= num_threads <= most
        ):
            raise RoseError(
                f"--num-threads must be an integer in [1, {most}] ({MAX_THREADS_PER_CORE} per "
                f"core at most: more only wait for each other), got {num_threads!r}"
            )
        self.ignored_env = None  # an OMP_NUM_THREADS that is not a count (OpenMP ignores it)
        env = os.environ.get("OMP_NUM_THREADS", "").strip()
        if env and not omp_count(env):
            self.ignored_env, env = env, ""
        self.fixed_by = (
            "--num-threads" if num_threads is not None else "OMP_NUM_THREADS" if env else None
        )
        # The environment's count as given (torch may have started with another: a build
        # can hold it to the cores whatever OMP_NUM_THREADS says), within the bound
        # --num-threads has, said in `describe` when it bounds it.
        self.bounded_env = env if env and omp_count(env) > most else None
        given = num_threads or (min(omp_count(env), most) if env else None)
        self.most = given or torch.get_num_threads()  # auto: torch's, one per core
        self.cores = usable_cores()
        # The smoothed count of other runnable threads (None: the machine does not tell).
        self.others: float | None = None
        self.decided = self.adapted = -math.inf
        self.count = self.most
        if self.fixed_by is None:
            self.sample()
            self.count = self._for_load()
        self.follow_load = follow_load and self.fixed_by is None
        self.thread: int | None = None  # the compute thread whose OpenMP count is set
        self.sampler: threading.Thread | None = None

    def describe(self) -> str:
        """One line: the count chosen, why, and how to change it."""
        if self.ignored_env is not None:
            return f"OMP_NUM_THREADS={self.ignored_env!r} is not a count, so auto: " + (
                self._describe()
            )
        return self._describe()

    def _describe(self) -> str:
        if self.bounded_env is not None:
            return (
                f"{self.count}, fixed by OMP_NUM_THREADS={self.bounded_env!r} at its bound "
                f"({MAX_THREADS_PER_CORE} per core: more only wait for each other)"
            )
        if self.fixed_by:
            return f"{self.count}, fixed by {self.fixed_by} (OpenMP spins while it waits)"
        if not self.follow_load:
            return (
                f"{self.count} of {self.most} (auto, for the load at the start: compiled code "
                f"keeps its count); --num-threads N or OMP_NUM_THREADS=N fixes it"
            )
        return (
            f"{self.most} on free cores, fewer while other programs keep them busy ({self.count} "
            f"now; OpenMP spins while it waits, so a team larger than the free cores "
            f"collapses); --num-threads N or OMP_NUM_THREADS=N fixes the count"
        )

    def adapt(self) -> None:
        """Between steps, in the compute thread: set its count the first time; then, in
        auto, follow the other programs' load (at least one thread, at most `most`)."""
        if self.thread != threading.get_ident():
            self.thread = threading.get_ident()
            torch.set_num_threads(self.count)
        if not self.follow_load:
            return
        now = self.adapted = time.monotonic()
        if self.sampler is None or not self.sampler.is_alive():
            self.sampler = start_sampling(self)
        if now - self.decided < DECIDE_EVERY_S:
            return
        self.decided = now
        count = self._for_load()
        if count != self.count:
            torch.set_num_threads(count)
            self.count = count

    def sample(self) -> None:
        """Take one sample of the other programs' runnable threads into the moving
        average (the first sample is the average)."""
        others = other_runnable_threads()
        if others is None or self.others is None:
            self.others = others
        else:
            self.others += SMOOTHING * (others - self.others)

    def _for_load(self) -> int:
        """The count for the smoothed load (all of `most` where the machine does not
        tell its load)."""
        if self.others is None:
            return self.most
        # A core counts as taken only while other programs keep it runnable nearly all the
        # time (BUSY_SHARE): one busy most but not all of the time leaves gaps a second
        # thread fills.
        taken = math.floor(self.others + 1 - BUSY_SHARE)
        return max(1, min(self.most, self.cores - taken))


def start_sampling(threads: Threads) -> threading.Thread:
    """A daemon thread that samples the load into `threads` every SAMPLE_EVERY_S until no
    step has adapted it for SAMPLE_UNTIL_IDLE_S (it holds `threads` weakly: it ends with
    it too)."""

    def sample_while_adapted(owner_ref: weakref.ref[Threads]) -> None:
        while (owner := owner_ref()) is not None:
            if time.monotonic() - owner.adapted > SAMPLE_UNTIL_IDLE_S:
                return
            owner.sample()
            del owner  # (asleep, the thread keeps no Threads alive)
            time.sleep(SAMPLE_EVERY_S)

    sampler = threading.Thread(
        target=sample_while_adapted, args=(weakref.ref(threads),), name="rose-load", daemon=True
    )
    sampler.start()
    return sampler
