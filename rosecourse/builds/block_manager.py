"""Build (chapters 11-13): the block manager, run inside rose's engine.

Contract: rosecourse/solutions/build_block_manager.py. The parts:

* the chained key: equal for equal blocks behind equal parents, different otherwise;
* the bookkeeping alone: scripted lives of a few sequences (shared prefixes, a block
  repeated inside one prompt, a release, an eviction; one prompt computed side by side
  by two sequences, whose first block is then evicted while its second stays cached;
  blocks filled by generated tokens; a start that holds a chunk of its prompt; a pool
  without prefix caching), every answer and count beside rose's BlockManager doing the
  same, the pool's invariants checked after every call (`check_pool`, and the prefix
  cache's map: every key names a block keyed by it, nothing keyed without prefix
  caching, every evictable block keyed); block *ids* may differ from rose's, nothing
  else may;
* rose's engine with the learner's BlockManager in place of rose's (LLMEngine builds it):
  a workload of shared prefixes with room to spare, the same in a pool so small that
  requests are preempted and cached blocks evicted, and random schedules drawn by
  hypothesis (block sizes that are not powers of two, pool sizes, token budgets that
  chunk the prefill, arrivals, aborts, now and then no prefix caching). After every engine step the pool's invariants
  hold; every request's tokens are its solo uncached run's (an aborted one's, the start
  of it); and each request's prompt tokens served by the prefix cache are what rose's
  own manager serves on the same schedule, and its counters (queries, hits) rose's.

The model is the chapters' random strong-oracle model, which has no sliding window, so the
engine's window hook (`drop_out_of_window`) is not the learner's to write.
"""

from __future__ import annotations

import functools
import hashlib
import types
from collections.abc import Callable
from dataclasses import dataclass

from rosecourse.builds.grading import Build, KnownWrong, Mismatch, Part, made, seen
from rosecourse.exercises import encoded, oracle_model, reference_tokens
from roseinfer.engine.block_manager import BlockManager, BlockManagerProtocol, check_pool
from roseinfer.engine.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.engine.sequence import EngineSequence
from roseinfer.request.sampling import SamplingParams
from rosetrainer.errors import one_line
from rosetrainer.tokenizer import Tokenizer

MAX_STEPS = 300  # an engine that makes no progress is stopped here, and says so
COUNTERS = "the prefix cache's counters"  # run_schedule's entry for them
EXAMPLES = 6  # random schedules per check: a few, so the check takes seconds


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_tokens: int
    arrives: int = 0  # the engine step it is added before
    aborted_at: int | None = None  # the engine step it is aborted before, if any


@dataclass(frozen=True)
class Schedule:
    requests: tuple[Request, ...]
    kv_block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool = True

    def __str__(self) -> str:
        shown = ", ".join(
            f"r{i}: {len(r.prompt)} prompt + {r.max_tokens} new tokens"
            + (f" from step {r.arrives}" if r.arrives else "")
            + (f", aborted at step {r.aborted_at}" if r.aborted_at is not None else "")
            for i, r in enumerate(self.requests)
        )
        return (
            f"kv_block_size {self.kv_block_size}, {self.num_kv_blocks} blocks, "
            f"max_num_seqs {self.max_num_seqs}, max_num_batched_tokens "
            f"{self.max_num_batched_tokens}"
            + ("" if self.enable_prefix_caching else ", no prefix caching")
            + f"; {shown}"
        )


@functools.cache
def tokenizer() -> Tokenizer:
    return Tokenizer("gpt2")


def learners(module: types.ModuleType) -> Callable[..., BlockManagerProtocol]:
    """What LLMEngine builds its manager with (`block_manager_class`): the learner's
    BlockManager, with what the engine also calls that the build leaves out (this model
    has no sliding window; chapters 11-13 draft no tokens)."""

    class Learners(module.BlockManager):
        def __init__(self, num_blocks, kv_block_size, enable_prefix_caching, *_seed_window):
            super().__init__(num_blocks, kv_block_size, enable_prefix_caching)
            if not isinstance(getattr(self, "cache_version", None), int):
                raise Mismatch(
                    "your BlockManager's __init__ sets no cache_version (an int): the "
                    "engine's scheduler reads it to know when the prefix cache changed"
                )

        @property
        def num_available(self) -> int:
            return self.num_free + len(self.evictable)

        def drop_out_of_window(self, seq: EngineSequence) -> None:
            pass

    return Learners


def run_schedule(schedule: Schedule, module: types.ModuleType | None) -> dict[str, tuple]:
    """Each request's (tokens, prompt tokens the prefix cache served) when rose's engine
    runs `schedule` on the learner's manager (None: rose's own); the pool's invariants
    are checked after every step."""
    config = EngineConfig(
        kv_block_size=schedule.kv_block_size,
        num_kv_blocks=schedule.num_kv_blocks,
        max_num_seqs=schedule.max_num_seqs,
        max_num_batched_tokens=schedule.max_num_batched_tokens,
        enable_prefix_caching=schedule.enable_prefix_caching,
        record_writes=True,  # the pool's invariants are checked after every step
    )
    made = BlockManager if module is None else learners(module)
    engine = LLMEngine(oracle_model(), tokenizer(), config, block_manager_class=made)
    seen: dict[str, tuple] = {}
    step = 0
    while step <= max(r.arrives for r in schedule.requests) or engine.has_unfinished():
        for i, request in enumerate(schedule.requests):
            params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
            if request.arrives == step:
                engine.add_request(list(request.prompt), params, request_id=f"r{i}")
            if request.aborted_at == step:
                engine.abort(f"r{i}")
        for output in engine.step():
            seen[output.request_id] = (tuple(output.token_ids), output.num_cached_tokens)
        ran = bool(engine.last_batch.seqs)
        runner = engine.runner
        live = list(engine.requests.values())
        try:
            check_pool(
                engine.block_manager,
                live,
                runner.written_slots if ran else (),
                runner.writer_tables if ran else (),
            )
            problem = cache_map_problem(engine.block_manager, schedule.enable_prefix_caching)
        except AssertionError as error:
            problem = pool_problem(engine.block_manager, live, schedule.enable_prefix_caching)
            problem = (
                str(error)
                or problem
                or "a block in `evictable` is not the one `cached` maps its key to"
            )
        if problem is not None:
            raise Mismatch(f"after engine step {step}, the pool's invariants break: {problem}")
        step += 1
        if step == MAX_STEPS:
            raise Mismatch(f"the engine made no progress in {MAX_STEPS} steps")
    manager = engine.block_manager
    seen[COUNTERS] = (manager.prefix_cache_queries, manager.prefix_cache_hits)
    return seen


@functools.cache
def roses(schedule: Schedule) -> dict[str, tuple]:
    return run_schedule(schedule, None)


def compare_schedule(schedule: Schedule, module: types.ModuleType) -> None:
    """The learner's manager on `schedule`: every request against its solo uncached run,
    and the prefix cache's service against rose's manager's on the same schedule."""
    try:
        mine = made(f"the engine on {schedule}", lambda: run_schedule(schedule, module))
    except Mismatch as error:
        raise Mismatch(f"{error} [{schedule}]") from None
    except NotImplementedError:
        raise
    except Exception as error:  # the learner's manager broke the engine
        why = f"the engine raised {one_line(error)} [{schedule}]"
        raise Mismatch(why) from None
    rose = roses(schedule)
    for i, request in enumerate(schedule.requests):
        tokens, served = mine[f"r{i}"]
        want = reference_tokens(request.prompt, request.max_tokens)
        if tokens != want[: len(tokens)] or (request.aborted_at is None and tokens != want):
            parted = (j for j, (a, b) in enumerate(zip(tokens, want, strict=False)) if a != b)
            step = next(parted, len(tokens))
            raise Mismatch(
                f"r{i}'s token {step} is {tokens[step] if step < len(tokens) else 'missing'} "
                f"where its solo uncached run gives {want[step]} [{schedule}]"
            )
        if served != rose[f"r{i}"][1]:
            raise Mismatch(
                f"the prefix cache served r{i} {served} prompt tokens where rose's block "
                f"manager serves {rose[f'r{i}'][1]} [{schedule}]"
            )
    if mine[COUNTERS] != rose[COUNTERS]:
        raise Mismatch(
            "after the run, (prefix_cache_queries, prefix_cache_hits) is "
            f"{mine[COUNTERS]} where rose's manager has {rose[COUNTERS]}: each start counts "
            "the full blocks its whole text may be served (lookup_blocks(len(seq.all_ids))) "
            f"and those it is served [{schedule}]"
        )


# -- the chained key ---------------------------------------------------------------------------


def _chain_hash(module: types.ModuleType) -> None:
    key = module.chain_hash
    first = key(b"", (1, 2, 3))
    cases = [
        ("the same block behind the same parent", key(b"", (1, 2, 3)) == first, True),
        ("(1, 2, 3) and (1, 2, 4) behind one parent", key(b"", (1, 2, 4)) == first, False),
        ("(1, 23) and (12, 3)", key(b"", (1, 23)) == key(b"", (12, 3)), False),
        ("one block behind two parents", key(first, (4, 5, 6)) == key(b"", (4, 5, 6)), False),
        ("a block and its own repeat", key(first, (1, 2, 3)) == first, False),
    ]
    kind, cases = seen("chain_hash's kind and cases", (type(first).__name__, cases))
    if kind != "bytes":
        raise Mismatch(f"chain_hash returns a {kind}, not bytes")
    for what, got, want in cases:
        if got != want:
            raise Mismatch(f"{what} get {'one key' if got else 'two keys'}")


# -- the bookkeeping, scripted -----------------------------------------------------------------


def cache_map_problem(manager: object, caching: bool) -> str | None:
    """What is wrong with the prefix cache's map, in words (None: nothing): every key in
    `cached` names a block keyed by it and holding its tokens, every keyed block is in
    `cached` under its key, and without prefix caching nothing is keyed."""
    for key, block_id in manager.cached.items():
        block = manager.blocks[block_id]
        if block.hash != key:
            return (
                f"`cached` still maps a key to block {block_id}, which is no longer keyed by it "
                f"(it holds {list(block.token_ids) or 'nothing cached'}): an evicted block "
                "is keyed no more, so its key leaves `cached`"
            )
    for block in manager.blocks:
        if block.hash is not None and manager.cached.get(block.hash) != block.block_id:
            return f"block {block.block_id} is keyed, but `cached` does not map its key to it"
        if not caching and block.hash is not None:
            return (
                f"block {block.block_id} is keyed with prefix caching off: without "
                "enable_prefix_caching nothing is ever keyed or found"
            )
    for block_id in manager.evictable:
        if manager.blocks[block_id].hash is None:
            return (
                f"block {block_id} is evictable but keyed by nothing: a block nobody holds "
                "is free, unless it is keyed (cached)"
            )
    return None


def pool_problem(manager: object, live: list, caching: bool) -> str | None:
    """The pool's invariants (`check_pool`) and the cache map's, in words; None: they hold."""
    try:
        check_pool(manager, live)
    except AssertionError as error:
        if str(error):
            return str(error)
        # check_pool's asserts without a message of their own: say what they check.
        return cache_map_problem(manager, caching) or (
            "a block in `evictable` is not the block `cached` maps its key to"
        )
    return cache_map_problem(manager, caching)


class Stopped(Exception):
    """A scripted call raised: the script ends there."""


class Script:
    """A scripted life of a pool: every answer and count noted along the way, and the
    pool's invariants checked after every call."""

    def __init__(self, manager_cls: type, num_blocks: int, caching: bool = True) -> None:
        self.manager = manager_cls(num_blocks, 3, caching)
        self.caching = caching
        self.live: list[EngineSequence] = []
        self.seen: list[tuple] = []
        self.cache_as_noted: tuple[frozenset, object] | None = None  # (keys, cache_version)

    def call(self, what: str, fn, *args):
        """fn(*args); when the learner's code raises, that is noted as the call's answer
        and the script stops (what was noted before it is still compared first)."""
        try:
            return fn(*args)
        except NotImplementedError:
            raise
        except Exception as error:
            self.seen.append((what, None, f"raised {one_line(error)}"))
            raise Stopped from None

    def note(self, what: str, answer: object = None) -> None:
        manager = self.manager
        problem = pool_problem(manager, self.live, self.caching)
        noted = (frozenset(manager.cached), getattr(manager, "cache_version", None))
        if problem is None and self.cache_as_noted is not None:
            keys, version = self.cache_as_noted
            if keys != noted[0] and version == noted[1]:
                problem = (
                    "a key entered or left `cached` and cache_version did not change: the "
                    "scheduler would serve a waiting request the blocks of an old lookup"
                )
        self.cache_as_noted = noted
        self.seen.append(
            (
                what,
                problem,
                answer,
                manager.num_free,
                len(manager.evictable),
                manager.prefix_cache_queries,
                manager.prefix_cache_hits,
                tuple((len(s.block_table), s.num_computed_tokens) for s in self.live),
            )
        )

    def start(self, seq: EngineSequence, name: str, hold: int | None = None) -> None:
        """Look `seq` up, start it if it can (holding `hold` tokens, all by default) and
        compute them."""
        m = self.manager
        cached = self.call(f"{name}: cached_prefix", m.cached_prefix, seq.all_ids)
        self.note(f"{name}: blocks the prefix cache holds", (len(cached), len(set(cached))))
        hold = seq.num_tokens if hold is None else hold
        can = self.call(f"{name}: can_start", m.can_start, cached, hold)
        self.note(f"{name}: can it start", can)
        if can:
            self.call(f"{name}: start", m.start, seq, cached, hold)
            self.live.append(seq)
            self.note(f"{name}: started")
            done = hold - seq.num_computed_tokens
            self.call(f"{name}: advance", m.advance, seq, done)
            self.note(f"{name}: computed")

    def release(self, seq: EngineSequence, name: str) -> None:
        self.call(f"{name}: release", self.manager.release, seq)
        self.live.remove(seq)
        self.note(f"{name}: released")

    def found(self, what: str, token_ids: list[int]) -> None:
        self.note(what, len(self.call(what, self.manager.cached_prefix, token_ids)))


def sequence(prompt: list[int], max_tokens: int = 1) -> EngineSequence:
    return EngineSequence(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def first_life(life: Script) -> None:
    """Shared prefixes, a block repeated inside one prompt, releases and an eviction."""
    manager = life.manager
    a = sequence(list(range(1, 9)))
    b = sequence([*range(1, 7), 20, 21])
    c = sequence([5] * 7)  # one block, repeated
    d = sequence([5] * 7)
    e = sequence(list(range(30, 41)))
    life.start(a, "a")
    life.start(b, "b")  # two blocks shared with a
    life.found("a's first 6 tokens: blocks the cache serves", a.all_ids[:6])
    life.release(a, "a")
    life.start(c, "c")
    life.start(d, "d")  # c's two full blocks, told apart by their parents
    what = "e before anyone leaves: can it grow"
    life.note(what, life.call(what, manager.can_grow, e, e.num_tokens))
    life.release(b, "b")
    what = "e: can it start now"  # one block short
    life.note(what, life.call(what, manager.can_start, [], e.num_tokens))
    life.release(c, "c")
    life.release(d, "d")
    what = "e: can it grow"  # with the cached blocks
    life.note(what, life.call(what, manager.can_grow, e, e.num_tokens))
    life.start(e, "e")  # one block more than the free ones: the least recently given back goes
    life.found("b's prefix after e", b.all_ids)
    life.found("d's prefix after e", d.all_ids)


def side_by_side(life: Script) -> None:
    """Two sequences compute one prompt side by side, each keying the block it computes
    first; the first block's copy is evicted while the second block's stays cached: a
    lookup of the prompt finds nothing (its first block is gone), not the second block."""
    m = life.manager
    s1, s2 = sequence(list(range(1, 8))), sequence(list(range(1, 8)))
    for seq, name in ((s1, "s1"), (s2, "s2")):  # both looked up before either computes
        cached = life.call(f"{name}: cached_prefix", m.cached_prefix, seq.all_ids)
        life.call(f"{name}: start", m.start, seq, cached, seq.num_tokens)
        life.live.append(seq)
    life.note("s1 and s2 started side by side")
    for seq, n, what in ((s1, 3, "s1 computes its first block"),
                         (s2, 6, "s2 computes its first two"),
                         (s1, 4, "s1 computes the rest")):  # fmt: skip
        life.call(f"{what}: advance", m.advance, seq, n)
        life.note(what)
    life.release(s1, "s1")
    life.start(sequence(list(range(50, 62))), "s3 (evicting s1's first block)")
    life.found(
        "the prompt of s1 and s2, its first block's copy evicted and its second's still "
        "cached: blocks the cache serves (the run of first full blocks ends at the first "
        "one missing)",
        s1.all_ids,
    )


def generated(life: Script) -> None:
    """A block filled by generated tokens is keyed and served like a prompt's; a start
    that holds a chunk of the prompt counts the queries of the whole text."""
    m = life.manager
    g = sequence([70, 71, 72, 73], max_tokens=5)
    life.start(g, "g")
    for token in (74, 75, 76):  # each sampled, then fed: the block fills with them
        g.append_token(token)
        life.call("g: grow", m.grow, g, g.num_tokens)
        life.call("g: advance", m.advance, g, 1)
        life.note(f"g decodes {token}")
    life.found(
        "g's text and one token more: blocks the cache serves (a full, computed block is "
        "keyed, whether its tokens are the prompt's or generated)",
        [*g.all_ids, 99],
    )
    h = sequence(list(range(80, 90)))
    life.start(h, "h, a first chunk of 4 of its 10 prompt tokens", hold=4)


def uncached(life: Script) -> None:
    """Without prefix caching: nothing keyed, nothing found, every block freed."""
    x, y = sequence(list(range(1, 8))), sequence(list(range(1, 8)))
    life.start(x, "x, prefix caching off")
    life.release(x, "x, prefix caching off")
    life.start(y, "y, x's prompt, prefix caching off")


def reclaimed(life: Script) -> None:
    """A prompt served blocks that wait to be evicted: it takes them back, so they are not
    also room to grow into (can_start counts the evictable blocks it is served out)."""
    a = sequence(list(range(1, 8)))  # 3 blocks: 2 full ones keyed, 1 token in the third
    life.start(a, "a")
    life.release(a, "a")  # a's 2 keyed blocks evictable, its third free
    # a's 2 full blocks served, 2 more needed for its 11 tokens, and 1 block left to take
    life.start(sequence([*range(1, 7), *range(40, 45)]), "f, a's 2 evictable blocks served")


# Each script with its pool: (the script, blocks, prefix caching).
SCRIPTS = ((first_life, 7, True), (side_by_side, 7, True), (generated, 7, True),
           (uncached, 4, False), (reclaimed, 3, True))  # fmt: skip


def scripted(manager_cls: type) -> list[tuple]:
    """Lives of small pools of blocks of 3 slots, every answer and count along the way;
    the pool's invariants are checked after every call."""
    seen = []
    for script, blocks, caching in SCRIPTS:
        life = Script(manager_cls, blocks, caching)
        try:
            script(life)
        except Stopped:
            return seen + life.seen
        seen += life.seen
    return seen


def _bookkeeping(module: types.ModuleType) -> None:
    want = scripted(BlockManager)
    got = made("the scripted lives", lambda: scripted(module.BlockManager))
    names = ("the pool's invariants break:", "the answer", "free blocks", "evictable blocks", "prefix_cache_queries",
             "prefix_cache_hits", "(table length, num_computed_tokens) of each live sequence")  # fmt: skip
    for mine, right in zip(got, want, strict=False):
        if isinstance(mine[2], str) and mine[2].startswith("raised "):
            raise Mismatch(f"{mine[0]}: {mine[2]}")
        for name, a, b in zip(names, mine[1:], right[1:], strict=True):
            if a != b and name.endswith(":"):
                raise Mismatch(f"{mine[0]}: {name} {a}")
            if a != b:
                raise Mismatch(f"{mine[0]}: {name} {a} where rose's manager has {b}")


# -- rose's engine -----------------------------------------------------------------------------


def chunk(text: str, size: int) -> tuple[int, ...]:
    return encoded(text)[:size]


def prefix_workload(num_kv_blocks: int) -> Schedule:
    """Four prompts behind one 12-token head (one exactly 3 blocks long), one whose blocks
    repeat one block, one that repeats another's second block behind another first."""
    head = chunk("ROMEO:\nBut soft, what light through yonder window", 12)
    repeated = chunk("Good night, good night!", 4) * 3
    swapped = (head[1], head[0], *head[2:])
    prompts = [head + encoded(" breaks?"), head + encoded(" is the east"), head, repeated,
               swapped + encoded(" breaks?"), repeated + encoded(" parting")]  # fmt: skip
    return Schedule(
        tuple(Request(p, 6) for p in prompts),
        kv_block_size=4,
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=2,
        max_num_batched_tokens=64,
    )


def _shared_prefixes(module: types.ModuleType) -> None:
    compare_schedule(prefix_workload(40), module)


def evicted_while_waiting() -> Schedule:
    """A waiting request's cached prefix evicted while it waits: r0 leaves its two full
    blocks cached; r2, which shares them, finds them but waits for room while r1 grows
    and evicts one; when r2 starts, only what the cache holds then may be served (the
    scheduler looks it up again only when `cache_version` says the cache changed)."""
    head = chunk("ROMEO:\nBut soft, what light through yonder window", 8)
    return Schedule(
        (
            Request(head + chunk(" breaks?", 1), 1),
            Request(chunk("JULIET:\nO Romeo, Romeo! wherefore art thou", 12), 8, arrives=1),
            Request(head + chunk(" is the east, and Juliet", 5), 4, arrives=1),
        ),
        kv_block_size=4,
        num_kv_blocks=6,
        max_num_seqs=2,
        max_num_batched_tokens=64,
    )


def _short_pool(module: types.ModuleType) -> None:
    compare_schedule(prefix_workload(9), module)  # preemptions and evictions
    compare_schedule(evicted_while_waiting(), module)


PIECES = ("ROMEO:\nBut soft, what light", "JULIET:\nO Romeo, Romeo", "Good night, good night")


def draw_schedule(draw: Callable, st: types.ModuleType) -> Schedule:
    """A schedule drawn by hypothesis (`draw`, its strategies `st`)."""
    size = draw(st.sampled_from([3, 5, 7]))
    pieces = [chunk(text, size) for text in PIECES]
    requests = []
    for i in range(draw(st.integers(2, 5))):
        blocks = draw(st.lists(st.integers(0, 2), min_size=1, max_size=3))
        tail = draw(st.integers(0, size - 1))
        prompt = tuple(t for b in blocks for t in pieces[b]) + chunk(" and more", tail)
        arrives = 0 if i == 0 else draw(st.integers(0, 12))
        aborted = draw(st.one_of(st.none(), st.integers(1, 8))) if i else None
        aborted = None if aborted is None else arrives + aborted  # some steps after it came
        requests.append(Request(prompt, draw(st.integers(1, 6)), arrives, aborted))
    longest = max(-(-(len(r.prompt) + r.max_tokens - 1) // size) for r in requests)
    return Schedule(
        tuple(requests),
        kv_block_size=size,
        num_kv_blocks=longest + draw(st.integers(0, 6)),
        max_num_seqs=draw(st.sampled_from([1, 2, 4])),
        max_num_batched_tokens=draw(st.sampled_from([4, 9, 64])),
        enable_prefix_caching=draw(st.sampled_from([True, True, False])),
    )


def _random_schedules(module: types.ModuleType) -> None:
    # Imported here: the grader imports this module to name the parts, and only this part
    # draws (hypothesis takes a third of a second to import).
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import strategies as st

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=(Phase.generate,),  # no shrinking: a failing schedule is reported as drawn
        verbosity=Verbosity.quiet,
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.composite(draw_schedule)(st))
    def each(schedule: Schedule) -> None:
        compare_schedule(schedule, module)

    each()


def _probe(module: types.ModuleType) -> list[object]:
    return [scripted(module.BlockManager)]


# ---------------------------------------------------------------------------
# Known wrong answers: the reference with one method or function written wrong
# ---------------------------------------------------------------------------
# Each runs as if written in the learner's file (grading.replaced rebinds it to the
# module's globals); the names it reads are imported above from the reference solution.


def _unchained(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    # the mistake: was `data = parent + b"|" + ",".join(map(str, token_ids)).encode()`
    data = b"|" + ",".join(map(str, token_ids)).encode()
    return hashlib.sha256(data).digest()


def _hit_not_held(self, seq: EngineSequence, cached_ids: list[int], num_tokens: int) -> None:
    self.prefix_cache_queries += self.lookup_blocks(len(seq.all_ids))
    self.prefix_cache_hits += len(cached_ids)
    for block_id in cached_ids:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.evictable[block_id]
        # the mistake: `block.ref_count += 1` left out
    seq.block_table = list(cached_ids)
    seq.block_hashes = [self.blocks[block_id].hash for block_id in cached_ids]
    seq.num_computed_tokens = len(cached_ids) * self.kv_block_size
    if not seq.output_ids:
        seq.num_cached_tokens = seq.num_computed_tokens
    self.grow(seq, num_tokens)


def _serves_the_last_token(self, num_tokens: int) -> int:
    if not self.enable_prefix_caching:
        return 0
    # the mistake: was `return (num_tokens - 1) // self.kv_block_size`
    return num_tokens // self.kv_block_size


def _cache_dropped_on_release(self, seq: EngineSequence) -> None:
    for block_id in reversed(seq.block_table):
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            # the mistake: was `if block.hash is not None: self.evictable[block_id] = None else:
            # self.free_ids.append(block_id)`
            self.free_ids.append(block_id)
    seq.block_table = []
    seq.block_hashes = []
    seq.num_computed_tokens = 0


def _evicts_the_newest(self, seq: EngineSequence, num_tokens: int) -> None:
    while len(seq.block_table) * self.kv_block_size < num_tokens:
        if self.free_ids:
            block_id = self.free_ids.pop()
        else:
            # the mistake: was `block_id, _ = self.evictable.popitem(last=False)`
            block_id, _ = self.evictable.popitem(last=True)
            block = self.blocks[block_id]
            del self.cached[block.hash]
            self.cache_version += 1
            block.hash, block.token_ids = None, ()
        self.blocks[block_id].ref_count = 1
        seq.block_table.append(block_id)


def _cached_blocks_unavailable(self, seq: EngineSequence, num_tokens: int) -> bool:
    needed = -(-num_tokens // self.kv_block_size) - len(seq.block_table)
    # the mistake: was `return needed <= self.num_free + len(self.evictable)`
    return needed <= self.num_free


BLOCK_MANAGER = Build(
    name="block_manager",
    chapters="11-13",
    task="the KV block pool's bookkeeping: allocate, grow, free, ref counts, prefix cache",
    parts=(
        Part("chain hash", _chain_hash),
        Part("bookkeeping", _bookkeeping),
        Part("engine, shared prefixes", _shared_prefixes),
        Part("engine, a short pool", _short_pool),
        Part("engine, random schedules", _random_schedules),
    ),
    probe=_probe,
    known_wrong=(
        KnownWrong(
            "unchained",
            {"chain_hash": _unchained},
            "a block's key is its own tokens alone: chain the previous block's key in, or a "
            "block is found behind any other prefix (and a repeated block finds itself)",
        ),
        KnownWrong(
            "hit_not_held",
            {"BlockManager.start": _hit_not_held},
            "a block the prefix cache serves is not counted as held by the new sequence: "
            "add one to its ref_count",
        ),
        KnownWrong(
            "serves_the_last_token",
            {"BlockManager.lookup_blocks": _serves_the_last_token},  # fmt: skip
            "the cache may serve a block holding the prompt's last token: that token must "
            "be computed, its logits give the first new token",
        ),
        KnownWrong(
            "cache_dropped_on_release",
            {"BlockManager.release": _cache_dropped_on_release},
            "a keyed block nobody holds goes back to the free list, so the prefix cache "
            "never serves a finished request's blocks: keep it cached (evictable)",
        ),
        KnownWrong(
            "evicts_the_newest",
            {"BlockManager.grow": _evicts_the_newest},
            "the pool evicts the cached block given back most recently; evict the least "
            "recently given back",
        ),
        KnownWrong(
            "cached_blocks_unavailable",
            {"BlockManager.can_grow": _cached_blocks_unavailable},  # fmt: skip
            "can_grow counts the free blocks only: the cached blocks nobody holds are room "
            "too (evicted when taken)",
        ),
    ),
    passed="equal to rose's block manager, and every request to its solo run",
)
