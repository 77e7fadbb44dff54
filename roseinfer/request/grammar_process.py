"""Compiling a constraint first where a crash or a runaway costs only that constraint: a
worker process, killed when it runs past its time bound.

The grammar library is native code, and a request chooses its input. A $ref chain or a
rule chain thousands deep overflows the compiler's stack (a segmentation fault: the
whole server gone, every request in flight with it), and a schema of ten thousand
optional properties compiles for many seconds, on a thread nothing can stop: it kept a
compile thread busy long after its request had been refused, and the process could not
exit until it was done. So every constraint is compiled here first, with the checks
`structured.first_steps` makes, in a worker process of its own:

* it crashes: the worker dies alone, and the constraint is refused (InvalidParam) with
  the signal that ended it; the next compile starts a new worker;
* it runs past its bound: the worker is killed (SIGKILL), so nothing of it runs on, and
  the constraint is refused;
* it compiles: the caller compiles it again in its own process (`structured._compile`),
  now known to finish in about the same time and not to crash. The worker compiles on a
  thread of the default stack size, the size of the threads that compile and mask in
  the server (a request handler's, the engine's), so what passed there passes here.

The second compile doubles the cost of a new constraint, paid once (compiled grammars
are cached), for a process boundary around the one that could fail. A refusal is
remembered (a bounded LRU; a refusal for time, for a minute only), so a client sending
the same crashing or runaway constraint again is answered at once instead of costing a
worker each time.

The worker's side is roseinfer/request/grammar_worker.py. At most WORKERS compile at once; a caller waits for a free one. Workers start on first
use and stay, each holding the tokenizers' tries it has built; `Workers.stop` (at exit, and
when a server stops) kills them, so neither waits on a compile. A worker whose parent
has gone exits by itself.

The protocol: on the worker's stdin, messages of a 4-byte big-endian length and UTF-8
JSON `{"tokenizer": name, "grammar": text}`; on its stdout, `{"error": null}` (it
compiled) or `{"error": reason}` (the library refused it). The worker's stderr is
dropped: the library's and Python's complaints are not the caller's output.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

from roseinfer.request.sampling_params import STRUCTURED as PARAM
from roseinfer.request.sampling_params import InvalidParam
from rosetrainer.errors import RoseError

WORKERS = 2  # constraints compiled at once
START_TIMEOUT_S = 120.0  # a worker's start (Python, the library): not the constraint's time
REFUSALS_KEPT = 256  # refused constraints remembered (the LRU)
# A constraint refused as too slow is refused again at once for this long (a client
# resending it would keep a worker busy for every try); a crash or the library's
# refusal stands as long as it is remembered.
SLOW_REMEMBERED_S = 60.0
PARENT_POLL_S = 1.0  # how often a worker looks whether its parent is still there
WORKER_MODULE = "roseinfer.request.grammar_worker"  # what a worker runs (python -m)
STACK_MARGIN = 1 << 20  # bytes of stack the worker's compile has less than the caller's
ABANDONED_POLL_S = 0.1  # how soon a compile waiting for a worker sees it was abandoned
STOPPED = "the grammar compiler was stopped (the server or program is exiting)"


class Worker:
    """One worker process and its pipes."""

    def __init__(self) -> None:
        # The folder that holds roseinfer, first on the worker's path: the parent may
        # have found it by a path of its own (a notebook's, a test runner's).
        root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
        self.process = subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": path},
            # its own process group: a terminal's Ctrl-C reaches the parent, which
            # stops it, instead of killing it in the middle of a message
            start_new_session=True,
        )
        self.started = False  # its ready message read
        self.stopped = False  # killed by Workers.stop, not by what it compiled

    @property
    def pid(self) -> int:
        return self.process.pid

    def ask(self, tokenizer: str, text: str, timeout_s: float) -> str | None:
        """Compile `text` there: None when it compiled, the library's reason when it
        refused; raises Died or TimedOut."""
        self.wait_ready()
        message = json.dumps({"tokenizer": tokenizer, "grammar": text}).encode()
        try:
            self.process.stdin.write(len(message).to_bytes(4, "big") + message)
            self.process.stdin.flush()
        except OSError:  # (a broken pipe: it died)
            raise Died(self.exit_status()) from None
        return json.loads(self._read(time.monotonic() + timeout_s))["error"]

    def wait_ready(self) -> None:
        """Read its ready message, once (it has imported the library by then)."""
        if self.started:
            return
        try:
            self._read(time.monotonic() + START_TIMEOUT_S, starting=True)
        except Died as died:
            raise RoseError(
                f"the grammar compiler's process did not start ({ending(died.status)})"
            ) from None
        self.started = True

    def _read(self, deadline: float, starting: bool = False) -> bytes:
        head = self._read_exactly(4, deadline, starting)
        return self._read_exactly(int.from_bytes(head, "big"), deadline, starting)

    def _read_exactly(self, size: int, deadline: float, starting: bool) -> bytes:
        fd, chunks, left = self.process.stdout.fileno(), [], size
        while left:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                self.kill()
                if starting:
                    raise RoseError(
                        f"the grammar compiler's process did not start in {START_TIMEOUT_S:g} s"
                    )
                raise TimedOut
            chunk = os.read(fd, left)
            if not chunk:
                raise Died(self.exit_status())
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def exit_status(self) -> int | None:
        """How it ended (a negative number: the signal), once it has."""
        try:
            return self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


class CompilerStopped(RoseError):
    """The workers were stopped (`Workers.stop`) while this compile waited for one."""


class Abandoned(Exception):
    """Nobody waits for this compile any more, and it had no worker yet: not run."""


class Died(Exception):
    def __init__(self, status: int | None) -> None:
        super().__init__(status)
        self.status = status


class TimedOut(Exception):
    pass


class Workers:
    """At most WORKERS workers, each lent to one compile at a time."""

    def __init__(self, size: int = WORKERS) -> None:
        self.size = size
        self.idle: list[Worker] = []
        self.busy: set[Worker] = set()
        self.closed = False
        self.free = threading.Condition()
        # refused constraints: the reason, and until when it stands (monotonic seconds)
        self.refused: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()

    def check(
        self,
        tokenizer: str,
        text: str,
        kind: str,
        timeout_s: float,
        abandoned: threading.Event | None = None,
    ) -> None:
        """Raise InvalidParam if `text` does not compile cleanly in a worker within
        `timeout_s` (refused by the library, crashed, or too slow); Abandoned if
        `abandoned` is set while it waits for a worker (its requests left: a worker
        busy for nobody would hold up the compiles still awaited)."""
        key = (tokenizer, text)
        with self.free:
            if key in self.refused:
                error, until = self.refused[key]
                if time.monotonic() < until:
                    self.refused.move_to_end(key)
                    raise InvalidParam(PARAM, error)
                del self.refused[key]
        worker = self._lend(abandoned)
        answered = False  # the exchange ended: the worker is idle, or gone
        remember = float("inf")  # how long a refusal is remembered
        try:
            error = worker.ask(tokenizer, text, timeout_s)
            answered = True
        except TimedOut:
            answered, remember = True, SLOW_REMEMBERED_S  # (the machine may be busier now)
            error = (
                f"the {kind} constraint took longer than {timeout_s:g} s to compile: simplify it"
            )
        except Died as died:
            answered = True
            if worker.stopped:
                raise CompilerStopped(STOPPED) from None
            error = (
                f"the {kind} constraint crashed the grammar compiler ({ending(died.status)}): "
                "simplify it (rules or $refs nested thousands deep overflow its stack)"
            )
        finally:
            if not answered:  # (Ctrl-C mid-compile, say): its answer would go to the next
                worker.kill()
            self._give_back(worker)
        if error is not None:
            with self.free:
                self.refused[key] = (error, time.monotonic() + remember)
                while len(self.refused) > REFUSALS_KEPT:
                    self.refused.popitem(last=False)
            raise InvalidParam(PARAM, error)

    def _lend(self, abandoned: threading.Event | None = None) -> Worker:
        with self.free:
            while True:
                if self.closed:
                    raise CompilerStopped(STOPPED)
                if abandoned is not None and abandoned.is_set():
                    raise Abandoned
                if self.idle:
                    worker = self.idle.pop()
                    break
                if len(self.busy) < self.size:
                    worker = Worker()
                    break
                self.free.wait(None if abandoned is None else ABANDONED_POLL_S)
            self.busy.add(worker)
            return worker

    def _give_back(self, worker: Worker) -> None:
        with self.free:
            self.busy.discard(worker)
            if worker.alive and not self.closed:
                self.idle.append(worker)
            else:
                worker.kill()
            self.free.notify()

    def warm(self) -> None:
        """Start every worker not started yet, and wait until each is ready (a server
        that wants its first constraints compiled without a worker's start)."""
        with self.free:
            starting = [Worker() for _ in range(self.size - len(self.idle) - len(self.busy))]
            self.busy.update(starting)
        for worker in starting:
            try:
                worker.wait_ready()
            finally:
                self._give_back(worker)

    @property
    def pids(self) -> list[int]:
        """The workers' process ids (idle or busy)."""
        with self.free:
            return [w.pid for w in (*self.idle, *self.busy)]

    def stop(self, close: bool = False) -> None:
        """Kill every worker now: a compile in progress is answered STOPPED, and nothing
        waits for it (a server stopping). A later compile starts a new worker, unless
        `close` (the process exiting)."""
        with self.free:
            self.closed = self.closed or close
            workers = [*self.idle, *self.busy]
            self.idle = []
            self.free.notify_all()
        for worker in workers:
            worker.stopped = True
            if worker.process.poll() is None:
                worker.process.kill()


def ending(status: int | None) -> str:
    if status is not None and status < 0:
        try:
            return signal.Signals(-status).name
        except ValueError:
            return f"signal {-status}"
    return "it ended" if status is None else f"exit status {status}"


pool = Workers()
atexit.register(pool.stop, close=True)
