"""The engine's own thread, and how the asyncio side talks to it.

The engine is not thread-safe and a model step takes milliseconds to seconds, so it
must not run on the event loop (every HTTP request would wait for it). One thread owns
it: it takes commands (add, abort, stop) from a thread-safe queue, runs `step()` while
anything is unfinished, and hands each output back to the event loop with
`loop.call_soon_threadsafe`, into the asyncio queue of the HTTP request that asked.

    HTTP handler --add/abort--> queue.Queue --> engine thread: add_request / abort / step
    HTTP handler <--outputs---- asyncio.Queue <-- loop.call_soon_threadsafe(put_nowait)

On a CPU the engine's thread should be the only one that runs tensor operations on
several threads (the server's main thread keeps to one: roseinfer/cli/serve.py). With
OpenMP, each thread that starts parallel work gets a team of worker threads of its own;
once a process holds more of them than there are cores, the OpenMP runtime makes idle
workers sleep almost at once instead of spinning, and a decode step, hundreds of short
parallel regions, then waits for its worker to wake at every one (measured: the
benchmarks page's "rose against transformers serve").
`threads` (rosetrainer/threads.py) sets this thread's count, and follows the machine's load
between steps.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.engine.outputs import RequestOutput, RequestOutputKind
from roseinfer.request.sampling_params import SamplingParams
from rosetrainer.errors import RoseError
from rosetrainer.threads import Threads

log = logging.getLogger("roseinfer.cli.serve")

# What the engine thread sends back for one request: an output, or the error that ended it.
Sink = Callable[[RequestOutput | Exception], None]


@dataclass
class Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Sink


@dataclass
class Abort:
    request_id: str


class AbortAll:
    """Abort every request in flight (each is reported finished, "abort")."""


class Stop(AbortAll):
    """Abort whatever is left and end the thread."""


class EngineThread:
    def __init__(
        self,
        engine: LLMEngine,
        on_finished: Callable[[RequestOutput], None] | None = None,
        threads: Threads | None = None,
    ) -> None:
        self.engine = engine
        self.threads = threads  # this thread's torch threads (None: as it finds them)
        self.on_finished = on_finished  # e.g. record latencies in the metrics
        self.on_step: Callable[[], None] | None = None  # e.g. the live page's snapshots
        self.commands: queue.Queue[Add | Abort | AbortAll] = queue.Queue()
        self.sinks: dict[str, Sink] = {}  # touched by the engine thread only
        self.stats = engine.stats()  # a fresh snapshot after every step, for /metrics
        self.thread = threading.Thread(target=self._run, name="rose-engine", daemon=True)

    # -- called from any thread --

    def start(self) -> None:
        self.thread.start()

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink: Sink):
        self.commands.put(Add(request_id, prompt_ids, params, sink))

    def abort(self, request_id: str) -> None:
        self.commands.put(Abort(request_id))

    def abort_all(self) -> None:
        self.commands.put(AbortAll())

    def stop(self, timeout: float = 30.0) -> None:
        if self.thread.is_alive():
            self.commands.put(Stop())
            self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    # -- the engine thread --

    def _run(self) -> None:
        stopping = False
        while not stopping or self.engine.has_unfinished():
            # Idle: sleep until a command comes. Busy: take what has come, then step.
            idle = not self.engine.has_unfinished() and not stopping
            for command in self._take_commands(block=idle):
                stopping |= self._apply(command)
            if not self.engine.has_unfinished():
                continue
            if self.threads is not None:  # (its first call sets this thread's count)
                self.threads.adapt()
            try:
                outputs = self.engine.step()
            except Exception as err:  # a bug, not a user mistake: fail what is in flight
                log.exception("engine step failed; aborting every request in flight")
                self._fail_all(err)
                continue
            # Stats first: a client that has seen its request finish must not then read
            # /metrics from before the step (its blocks still counted as used).
            self.stats = self.engine.stats()
            if self.on_step is not None:
                self.on_step()
            for output in outputs:
                self._deliver(output)

    def _take_commands(self, block: bool) -> list[Add | Abort | AbortAll]:
        commands = [self.commands.get()] if block else []
        while True:
            try:
                commands.append(self.commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: Add | Abort | AbortAll) -> bool:
        """Run one command on the engine; True when it asks the thread to stop."""
        if isinstance(command, Add):
            try:
                # DELTA: each step's output carries only what is new (a stream sends
                # just that), the finished one the whole request (a JSON answer's).
                self.engine.add_request(
                    command.prompt_ids,
                    command.params,
                    command.request_id,
                    output_kind=RequestOutputKind.DELTA,
                )
            except RoseError as err:
                command.sink(err)
            else:
                self.sinks[command.request_id] = command.sink
        elif isinstance(command, Abort):
            self.engine.abort(command.request_id)
        else:
            for request_id in list(self.sinks):
                self.engine.abort(request_id)
        self.stats = self.engine.stats()
        return isinstance(command, Stop)

    def _deliver(self, output: RequestOutput) -> None:
        sink = self.sinks.pop(output.request_id, None) if output.finished else None
        sink = sink or self.sinks.get(output.request_id)
        if output.finished and self.on_finished is not None:
            self.on_finished(output)
        if sink is not None:
            sink(output)

    def _fail_all(self, err: Exception) -> None:
        for request_id, sink in self.sinks.items():
            self.engine.abort(request_id)
            sink(err)
        self.sinks.clear()
        try:  # let the engine report (and free) what was aborted
            while self.engine.has_unfinished():
                self.engine.step()
        except Exception:
            log.exception("the engine could not recover; it stays as it is")
        self.stats = self.engine.stats()


class QueueFull(Exception):
    """More requests wait for their first token than the server accepts (-> 503)."""


class EngineClient:
    """The event loop's side: submit prompts, iterate their outputs, abort on the way out.

    The queue --max-waiting bounds is shared: one client (its address, as
    `connections.client_of` names it) may hold at most `max_waiting_per_client` of it, so
    that a client sending many requests of many choices cannot turn every other away.
    """

    def __init__(
        self, engine_thread: EngineThread, max_waiting: int, max_waiting_per_client: int
    ) -> None:
        self.engine_thread = engine_thread
        self.max_waiting, self.max_waiting_per_client = max_waiting, max_waiting_per_client
        # Choices admitted that have not produced a first token yet: the queue that
        # --max-waiting bounds, in all and by client. Only the event loop touches them,
        # so no lock is needed.
        self.num_waiting = 0
        self.waiting_by_client: Counter[str] = Counter()

    async def generate(
        self,
        request_id: str,
        prompts: list[tuple[list[int], SamplingParams]],
        client: str | None = None,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run every (prompt ids, params) as its own engine request; yield (index, output)
        as they come, until all have finished. Leaving early (a client that went away, an
        error) aborts every one still running, so its blocks are freed. client: whose
        share of the queue they take (None: no one's, see `connections.client_of`)."""
        if self.num_waiting + len(prompts) > self.max_waiting:
            raise QueueFull(f"{self.num_waiting} requests are waiting (at most {self.max_waiting})")
        held = self.waiting_by_client[client] if client is not None else 0
        if client is not None and held + len(prompts) > self.max_waiting_per_client:
            raise QueueFull(
                f"this client has {held} requests waiting (at most "
                f"{self.max_waiting_per_client} per client, --max-waiting-per-client)"
            )
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()

        def sink(item: RequestOutput | Exception) -> None:  # runs in the engine thread
            loop.call_soon_threadsafe(outputs.put_nowait, item)

        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        index = {rid: i for i, rid in enumerate(ids)}
        waiting, running = set(ids), set(ids)
        self._count_waiting(client, len(ids))
        try:
            for rid, (prompt_ids, params) in zip(ids, prompts, strict=True):
                self.engine_thread.add(rid, prompt_ids, params, sink)
            while running:
                item = await outputs.get()
                if isinstance(item, Exception):
                    raise item
                if item.request_id in waiting:
                    waiting.discard(item.request_id)
                    self._count_waiting(client, -1)
                if item.finished:
                    running.discard(item.request_id)
                yield index[item.request_id], item
        finally:
            self._count_waiting(client, -len(waiting))
            for rid in running:
                self.engine_thread.abort(rid)

    def _count_waiting(self, client: str | None, change: int) -> None:
        self.num_waiting += change
        if client is not None:
            self.waiting_by_client[client] += change
            if not self.waiting_by_client[client]:
                del self.waiting_by_client[client]
