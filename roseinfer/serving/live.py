"""The live page: the engine's KV pool, queues and steps, drawn in a browser at `/`.

The page itself (roseinfer/serving/page/: HTML, CSS and one script, no build step) is
static and open; what it draws comes from two endpoints behind --api-key:

    GET /live/snapshot   the engine's state now, as JSON
    GET /live/events     the same as server-sent events, at most SNAPSHOTS_PER_S a second

The page's HTML and script name everything by a relative URL (`page/app.js`,
`live/events`, `v1/completions`), so behind a reverse proxy that serves the server
under a path prefix (`/rose/`) the page asks for `/rose/live/events`, not the root.

The engine is not thread-safe, so a snapshot is taken by the engine thread itself,
between two steps (`LiveState.after_step`), from what the engine already holds: the
block manager's free and cached lists, the scheduler's queues, each sequence's counts
and block table, the batch it just ran. It is a handful of list copies, and it happens
only while someone watches (the interest is renewed every tick while a stream is open),
plus once whenever the engine runs out of work, so that the last picture of a burst
is the idle pool. Nobody watching costs one comparison per step.

Watchers cost the event loop too, so they are few and share everything: at most
`max_watchers` event streams at once, `max_watchers_per_client` of them from one client
address (more get 429, in OpenAI's error shape), and one task (`LiveState._feed`) that
renews the engine's interest and wakes every stream once per new snapshot, whose JSON
is made once for all of them.

A block's state in `blocks` is one letter: f (free), u (used: some live sequence holds
it) or c (cached: nobody holds it, but the prefix cache can still hand it out). The
`timeline` holds [step, prefill tokens, decode tokens, preemptions] for each step
since the snapshot before the last one (a speculative verify chunk counts with the
prefill tokens: it is fed the same way). `speculative` holds speculative decoding's
counts, its acceptance rate and mean accepted length, or null without a drafter.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter, deque
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from roseinfer.engine.block_manager import FREED
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.engine.scheduler import ScheduledBatch
from roseinfer.engine.sequence import EngineSequence
from roseinfer.serving.errors import error_response

PAGE_DIR = Path(__file__).parent / "page"
ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
# The page and its assets hold no data and are open: the page asks for the key itself.
OPEN_PATHS = ("/", *(f"/page/{name}" for name in ASSETS))
SNAPSHOTS_PER_S = 10
WATCH_S = 2.0  # snapshots stop this long after the last watcher stopped asking
FRESH_TIMEOUT_S = 5.0  # /live/snapshot waits this long at most for a busy engine's next one
TIMELINE_STEPS = 240  # step records one snapshot carries at most
MAX_WATCHERS = 64  # /live/events streams at once (rose-serve --max-live-watchers)
MAX_WATCHERS_PER_CLIENT = 4  # of them from one client address (a few tabs)


def step_record(step: int, batch: ScheduledBatch) -> tuple[int, int, int, int]:
    """What one step did: (step, tokens fed to prompts (prefill), tokens fed to decoding
    rows, preemptions). A row is decoding when it fed one token and sampled its second or
    later one (token_times counts every sample, an end-of-text included)."""
    decode = sum(
        1
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
        if n == 1 and len(seq.token_times) >= 2
    )
    return step, batch.num_tokens - decode, decode, len(batch.preempted)


def request_view(seq: EngineSequence, running: bool) -> dict:
    if running:
        # Decoding: every token but the newest sampled one is in the cache.
        state = "prefilling" if seq.num_tokens - seq.num_computed_tokens > 1 else "decoding"
    else:  # only preemption sends a sequence with tokens of its own back to waiting
        state = "preempted" if seq.output_ids else "waiting"
    return {
        "id": seq.request_id,
        "state": state,
        "prompt_tokens": len(seq.prompt_ids),
        "generated": len(seq.output_ids),
        "computed": seq.num_computed_tokens,
        "tokens": seq.num_tokens,
        "cached_tokens": seq.num_cached_tokens,
        # The blocks it holds: a windowed request has given back those behind its window.
        "blocks": [block_id for block_id in seq.block_table if block_id != FREED],
    }


def take_snapshot(engine: LLMEngine, step: int, timeline: list[tuple]) -> dict:
    """The engine's state as plain JSON-able data. Call it from the engine's thread."""
    manager, scheduler = engine.block_manager, engine.scheduler
    states = ["u"] * manager.num_blocks
    for block_id in manager.free_ids:
        states[block_id] = "f"
    for block_id in manager.evictable:
        states[block_id] = "c"
    return {
        "t": time.monotonic(),
        "step": step,
        "kv_block_size": manager.kv_block_size,
        "max_num_seqs": engine.config.max_num_seqs,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "blocks": "".join(states),
        "running": [request_view(seq, running=True) for seq in scheduler.running],
        "waiting": [request_view(seq, running=False) for seq in scheduler.waiting],
        "timeline": timeline,
        "generation_tokens": engine.generation_tokens,
        "prompt_tokens": engine.prompt_tokens,
        "num_preemptions": scheduler.num_preemptions,
        "pool_bytes": engine.pool.nbytes,
        "speculative": speculative_view(engine),
    }


def speculative_view(engine: LLMEngine) -> dict | None:
    """Speculative decoding's counts and ratios (None without a drafter; a ratio is None
    before the first draft)."""
    stats = engine.speculative_stats
    if stats is None:
        return None
    drafted = stats.num_draft_tokens > 0
    return {
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "acceptance_rate": stats.acceptance_rate if drafted else None,
        "mean_accepted_length": stats.mean_accepted_length if drafted else None,
    }


class LiveState:
    """Snapshots of one engine, taken by its thread and read by the event loop."""

    def __init__(
        self,
        engine: LLMEngine,
        max_watchers: int = MAX_WATCHERS,
        max_watchers_per_client: int = MAX_WATCHERS_PER_CLIENT,
    ) -> None:
        self.engine = engine
        self.steps = 0
        # Step records since the last snapshot, and those it carried. A snapshot carries
        # both, so a stream that skips one snapshot misses no step.
        self.timeline: deque[tuple] = deque(maxlen=TIMELINE_STEPS)
        self.carried: list[tuple] = []
        self.watch_until = 0.0  # monotonic time; snapshots are taken until then
        self.last_taken = 0.0
        self.idle = True  # nothing to run at the last step boundary
        # (version, snapshot), replaced as one object so a reader never sees a mix.
        # The first is taken here, before the engine thread starts.
        self.latest = (0, take_snapshot(engine, 0, []))
        self._json = (-1, "")  # the event loop's serialized copy of `latest`
        self.closing = False  # set on shutdown: event streams end instead of holding it open
        # The event loop's side of /live/events: who watches, and the one task feeding them.
        self.max_watchers, self.max_watchers_per_client = max_watchers, max_watchers_per_client
        self.watchers: Counter[str] = Counter()  # open streams by client address
        self.feeder: asyncio.Task | None = None
        self.news = asyncio.Event()  # set (then replaced) when a new snapshot is there

    def after_step(self) -> None:
        """The engine thread's hook, after every step."""
        self.steps += 1
        now = time.monotonic()
        watched = now < self.watch_until
        if watched:
            self.timeline.append(step_record(self.steps, self.engine.last_batch))
        self.idle = idle = not self.engine.has_unfinished()
        if idle or (watched and now - self.last_taken >= 1 / SNAPSHOTS_PER_S):
            records = list(self.timeline)
            self.timeline.clear()
            snapshot = take_snapshot(self.engine, self.steps, self.carried + records)
            self.carried = records
            self.latest = (self.latest[0] + 1, snapshot)
            self.last_taken = now

    # -- the event loop's side --

    def watch(self) -> None:
        self.watch_until = time.monotonic() + WATCH_S

    def version(self) -> int:
        return self.latest[0]

    def snapshot_json(self) -> str:
        version, snapshot = self.latest
        if self._json[0] != version:
            self._json = (version, json.dumps(snapshot, separators=(",", ":")))
        return self._json[1]

    async def fresh_json(self, timeout: float = FRESH_TIMEOUT_S) -> str:
        """The state at a step boundary: the latest snapshot when the engine was idle at
        its last step (nothing has moved since), else the next one it takes."""
        seen, deadline = self.version(), time.monotonic() + timeout
        while not self.idle and self.version() == seen and time.monotonic() < deadline:
            self.watch()
            await asyncio.sleep(1 / (2 * SNAPSHOTS_PER_S))
        return self.snapshot_json()

    def refusal(self, client: str) -> str | None:
        """Why one more stream for `client` is refused (None: it is not)."""
        if self.watchers[client] >= self.max_watchers_per_client:
            return (
                f"this client already watches the live page {self.watchers[client]} times "
                f"(at most {self.max_watchers_per_client}): close a tab or stream"
            )
        if self.watchers.total() >= self.max_watchers:
            return f"the live page has {self.max_watchers} watchers already: try again later"
        return None

    async def stream(self) -> AsyncIterator[str]:
        """One watcher's events: the newest snapshot whenever there is a new one. The
        caller has counted it in `watchers` (WatcherStream takes it out at the end)."""
        if self.feeder is None:
            self.feeder = asyncio.create_task(self._feed())
        sent = -1
        while not self.closing:
            news = self.news
            if self.version() != sent:
                sent = self.version()
                yield f"data: {self.snapshot_json()}\n\n"
            await news.wait()

    async def _feed(self) -> None:
        """While anyone watches: keep the engine taking snapshots, and wake every stream
        once per new one (and once more when the server closes)."""
        seen = self.version()
        while self.watchers.total() and not self.closing:
            self.watch()
            if self.version() != seen:
                seen = self.version()
                self._wake()
            await asyncio.sleep(1 / SNAPSHOTS_PER_S)
        self.feeder = None
        self._wake()

    def _wake(self) -> None:
        news, self.news = self.news, asyncio.Event()
        news.set()


class WatcherStream(StreamingResponse):
    """A /live/events response: its watcher is counted while it runs, however it ends
    (the client left, the server closed, an error)."""

    def __init__(self, live: LiveState, client: str) -> None:
        super().__init__(live.stream(), media_type="text/event-stream")
        self.live, self.client = live, client
        live.watchers[client] += 1

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.live.watchers[self.client] -= 1
            if self.live.watchers[self.client] <= 0:
                del self.live.watchers[self.client]


def end_streams(app: FastAPI) -> None:
    """The server is shutting down: end the page's event streams now (they never end by
    themselves, so a graceful shutdown would wait its whole timeout for them)."""
    live = getattr(app.state, "live", None)
    if live is not None:
        live.closing = True  # the feeder sees it within a tick and wakes every stream


def live_router(live: LiveState) -> APIRouter:
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse((PAGE_DIR / "index.html").read_text(encoding="utf-8"))

    @router.get("/page/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            return Response(status_code=404)
        return Response((PAGE_DIR / name).read_bytes(), media_type=ASSETS[name])

    @router.get("/live/snapshot")
    async def snapshot() -> Response:
        return Response(await live.fresh_json(), media_type="application/json")

    @router.get("/live/events")
    async def events(request: Request) -> Response:
        client = request.client.host if request.client else ""
        refused = live.refusal(client)
        if refused is not None:
            return error_response(
                429, refused, type="requests", code="rate_limit_exceeded",
                headers={"Retry-After": str(int(WATCH_S))},
            )  # fmt: skip
        return WatcherStream(live, client)

    return router
