"""Build (chapters 11-13): the block manager, run inside rose's engine.

Contract: rosecourse/builds/block_manager/reference.py. The parts:

* the chained key: equal for equal blocks behind equal parents, different otherwise;
* the bookkeeping alone: scripted lives of small pools (`LIVES`: shared prefixes, a block
  repeated inside one prompt, a release, an eviction; one prompt computed side by side
  by two sequences, whose first block is then evicted while its second stays cached;
  blocks filled by generated tokens; a start that holds a chunk of its prompt; a pool
  without prefix caching), every answer and count beside rose's BlockManager living the
  same, the pool's invariants checked after every call (`pool_problem`: rose's
  `check_pool`, and the prefix cache's map); block *ids* may differ from rose's, nothing
  else may;
* rose's engine with the learner's BlockManager in place of rose's (LLMEngine builds it):
  a workload of shared prefixes with room to spare, the same in a pool so small that
  requests are preempted and cached blocks evicted (also under a token budget below the
  sequence cap, every prompt prefilled two tokens a step), and random schedules drawn by
  hypothesis (block sizes that are not powers of two, pool sizes, token budgets that
  chunk the prefill, arrivals, aborts, now and then no prefix caching). After every
  engine step the pool's invariants hold; every request's tokens are its solo uncached
  run's (an aborted one's, the start of it); and each request's prompt tokens served by
  the prefix cache are what rose's own manager serves on the same schedule, and its
  counters (queries, hits) rose's.

The model is the chapters' random strong-oracle model, which has no sliding window, so the
engine's window hook (`drop_out_of_window`) is not the learner's to write.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass, replace

from rosecourse.builds.block_manager.mistakes import KNOWN_WRONG
from rosecourse.builds.grading import Build, Mismatch, Part, TapeEnded, judging, made, seen
from rosecourse.exercises import encoded, oracle_model, reference_tokens
from roseinfer.engine.block_manager import BlockManager, BlockManagerProtocol, check_pool
from roseinfer.engine.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.engine.sequence import EngineSequence
from roseinfer.request.sampling import SamplingParams
from rosetrainer.errors import one_line
from rosetrainer.tokenizer import Tokenizer

MAX_STEPS = 300  # an engine that makes no progress is stopped here, and says so
EXAMPLES = 6  # random schedules per check: a few, so the check takes seconds


def pool_problem(
    manager: object, live: list, caching: bool, written: list = (), writers: list = ()
) -> str | None:
    """What breaks the pool's invariants (`check_pool`) or the prefix cache's map, in
    words (None: nothing): every key in `cached` names a block keyed by it, every keyed
    block is cached under its key, and nothing is keyed without prefix caching
    (`check_pool` holds every evictable block to its key)."""
    try:
        check_pool(manager, live, written, writers)
    except AssertionError as error:
        return str(error)
    for key, block_id in manager.cached.items():
        if manager.blocks[block_id].hash != key:
            return (
                f"`cached` still maps a key to block {block_id}, which is no longer keyed by "
                "it: an evicted block is keyed no more, so its key leaves `cached`"
            )
    for block in manager.blocks:
        if block.hash is not None and not caching:
            return f"block {block.block_id} is keyed with prefix caching off: nothing is then"
        if block.hash is not None and manager.cached.get(block.hash) != block.block_id:
            return f"block {block.block_id} is keyed, but `cached` does not map its key to it"
    return None


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

TEXTS = {  # the sequences' tokens, by name
    **dict.fromkeys(("x", "y", "r", "s1", "s2"), range(1, 8)),
    "a": range(1, 9), "a6": range(1, 7), "b": [*range(1, 7), 20, 21], "c": [5] * 7,
    "d": [5] * 7, "e": range(30, 41), "s3": range(50, 62), "g": range(70, 74),
    "g99": [*range(70, 77), 99], "h": range(80, 90), "f": [*range(1, 7), *range(40, 45)],
}  # fmt: skip
# Lives of small pools of blocks of 3 slots: (blocks, prefix caching, the calls in order).
LIVES = (
    # Shared prefixes, a block repeated inside one prompt (c and d: two full blocks told
    # apart by their parents), releases; e one block more than the free ones: the least
    # recently given back cached block goes.
    (7, True, (("start", "a"), ("start", "b"), ("found", "a6"), ("release", "a"),
               ("start", "c"), ("start", "d"), ("can_grow", "e"), ("release", "b"),
               ("can_start", "e"), ("release", "c"), ("release", "d"), ("can_grow", "e"),
               ("start", "e"), ("found", "b"), ("found", "d"))),
    # Two sequences compute one prompt side by side, each keying the block it computes
    # first; the first block's copy is evicted while the second's stays cached: a lookup
    # of the prompt finds nothing (the run of first full blocks ends at the first missing).
    (7, True, (("open", "s1"), ("open", "s2"), ("advance", "s1", 3), ("advance", "s2", 6),
               ("advance", "s1", 4), ("release", "s1"), ("start", "s3"), ("found", "s1"))),
    # A block filled by generated tokens is keyed and served like a prompt's; a start that
    # holds a chunk of its prompt counts the queries of the whole text.
    (7, True, (("start", "g"), ("decode", "g", 74), ("decode", "g", 75), ("decode", "g", 76),
               ("found", "g99"), ("start", "h", 4))),
    # Without prefix caching: nothing keyed, nothing found, every block freed.
    (4, False, (("start", "x"), ("release", "x"), ("start", "y"))),
    # A prompt served blocks that wait to be evicted takes them back, so they are not also
    # room to grow into (can_start counts the evictable blocks it is served out).
    (3, True, (("start", "r"), ("release", "r"), ("start", "f"))),
)  # fmt: skip
NOTED = ("the pool's invariants break:", "the answer", "free blocks", "evictable blocks",
         "prefix_cache_queries", "prefix_cache_hits",
         "(table length, num_computed_tokens) of each live sequence")  # fmt: skip


def answer(manager, live: list, call: str, seq: EngineSequence, arg: int | None) -> object:
    """Make one scripted call with the manager's methods: what they answered."""
    if call in ("start", "open"):  # open: started, nothing computed yet
        cached = manager.cached_prefix(seq.all_ids)
        hold = arg or seq.num_tokens
        can = manager.can_start(cached, hold)
        if can:
            manager.start(seq, cached, hold)
            live.append(seq)
        if can and call == "start":
            manager.advance(seq, hold - seq.num_computed_tokens)
        return len(cached), len(set(cached)), can  # blocks found (distinct ones), can start
    if call == "advance":
        manager.advance(seq, arg)
    elif call == "decode":  # a token sampled, then fed: its block fills with generated tokens
        seq.append_token(arg)
        manager.grow(seq, seq.num_tokens)
        manager.advance(seq, 1)
    elif call == "release":
        manager.release(seq)
        live.remove(seq)
    elif call == "found":
        return len(manager.cached_prefix(seq.all_ids))
    elif call == "can_grow":
        return manager.can_grow(seq, seq.num_tokens)
    elif call == "can_start":  # with no cached block
        return manager.can_start([], seq.num_tokens)
    return None


def lived(manager_class: type) -> list[tuple]:
    """LIVES, each on a fresh pool: after every scripted call, what it was, what breaks
    the pool's invariants, the answer and the pool's counts (NOTED)."""
    noted = []
    for blocks, caching, script in LIVES:
        manager, live, seqs, keys = manager_class(blocks, 3, caching), [], {}, None
        for call, name, *arg in script:
            if name not in seqs:
                params = SamplingParams(max_tokens=8, ignore_eos=True)
                seqs[name] = EngineSequence(list(TEXTS[name]), params)
            try:
                got = answer(manager, live, call, seqs[name], *arg or [None])
                problem = pool_problem(manager, live, caching)
                now = (frozenset(manager.cached), manager.cache_version)
                if problem is None and keys and keys[0] != now[0] and keys[1] == now[1]:
                    problem = (
                        "a key entered or left `cached` and cache_version did not change: "
                        "the scheduler would serve a waiting request an old lookup's blocks"
                    )
                keys = now
                sizes = tuple((len(s.block_table), s.num_computed_tokens) for s in live)
                counts = (manager.num_free, len(manager.evictable))
                counters = (manager.prefix_cache_queries, manager.prefix_cache_hits)
                noted.append((f"{name}: {call}", problem, got, *counts, *counters, sizes))
            except NotImplementedError:
                raise
            except Exception as error:  # the learner's code raised: the lives end here
                return [*noted, (f"{name}: {call}", f"raised {one_line(error)}")]
    return noted


def _bookkeeping(module: types.ModuleType) -> None:
    want = lived(BlockManager)
    for mine, right in zip(
        made("the scripted lives", lambda: lived(module.BlockManager)), want, strict=False
    ):
        if len(mine) == 2:
            raise Mismatch(": ".join(mine))
        for name, got, rose in zip(NOTED, mine[1:], right[1:], strict=True):
            if got != rose:
                rose = "" if name.endswith(":") else f" where rose's manager has {rose}"
                raise Mismatch(f"{mine[0]}: {name} {got}{rose}")


# -- rose's engine -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_tokens: int
    arrives: int = 0  # the engine step it is added before
    aborted_at: int | None = None  # the engine step it is aborted before, if any


# What a schedule says of its engine's config in a message.
SHOWN = (
    "kv_block_size",
    "num_kv_blocks",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_prefix_caching",
)


@dataclass(frozen=True)
class Schedule:
    requests: tuple[Request, ...]
    config: EngineConfig

    def __str__(self) -> str:
        shown = ", ".join(f"{name} {getattr(self.config, name)}" for name in SHOWN)
        return f"{shown}; " + ", ".join(
            f"r{i}: {len(r.prompt)} prompt + {r.max_tokens} new tokens from step {r.arrives}"
            + (f", aborted at step {r.aborted_at}" if r.aborted_at is not None else "")
            for i, r in enumerate(self.requests)
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

        num_available = property(lambda self: self.num_free + len(self.evictable))

        def drop_out_of_window(self, seq: EngineSequence) -> None:
            pass

    return Learners


Run = tuple[dict[str, tuple[int, ...]], dict[str, int], tuple[int, int]]


def run_schedule(schedule: Schedule, manager_class: Callable[..., BlockManagerProtocol]) -> Run:
    """Each request's tokens, and the prompt tokens the prefix cache served it, and the
    prefix cache's counters (queries, hits), when rose's engine runs `schedule` with a
    manager of `manager_class`; the pool's invariants are checked after every step."""
    # record_writes: each step's written slots, so the pool's invariants are checked after it
    config = replace(schedule.config, record_writes=True)
    engine = LLMEngine(oracle_model(), tokenizer(), config, block_manager_class=manager_class)
    tokens, served = {}, {}
    for step in range(MAX_STEPS):
        if step > max(r.arrives for r in schedule.requests) and not engine.has_unfinished():
            manager = engine.block_manager
            return tokens, served, (manager.prefix_cache_queries, manager.prefix_cache_hits)
        for i, request in enumerate(schedule.requests):
            params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
            if request.arrives == step:
                engine.add_request(list(request.prompt), params, request_id=f"r{i}")
            if request.aborted_at == step:
                engine.abort(f"r{i}")
        for output in engine.step():
            tokens[output.request_id] = tuple(output.token_ids)
            served[output.request_id] = output.num_cached_tokens
        ran, runner = bool(engine.last_batch.seqs), engine.runner
        problem = pool_problem(
            engine.block_manager,
            list(engine.requests.values()),
            config.enable_prefix_caching,
            runner.written_slots if ran else (),
            runner.writer_tables if ran else (),
        )
        if problem is not None:
            raise Mismatch(f"after engine step {step}, the pool's invariants break: {problem}")
    raise Mismatch(f"the engine made no progress in {MAX_STEPS} steps")


@functools.cache
def roses(schedule: Schedule) -> Run:
    return run_schedule(schedule, BlockManager)


def compare_schedule(schedule: Schedule, module: types.ModuleType) -> None:
    """The learner's manager on `schedule`: every request against its solo uncached run,
    and the prefix cache's service against rose's manager's on the same schedule."""
    try:
        run = made(f"the engine on {schedule}", lambda: run_schedule(schedule, learners(module)))
    except (NotImplementedError, TapeEnded):
        raise
    except Exception as error:  # what the run found, or the learner's manager broke the engine
        why = str(error) if isinstance(error, Mismatch) else f"the engine raised {one_line(error)}"
        raise Mismatch(f"{why} [{schedule}]") from None
    if not judging():  # rose's runs are the grader's to make, for its comparisons
        return
    (tokens, served, counters), rose = run, roses(schedule)
    for i, request in enumerate(schedule.requests):
        got, want = tokens.get(f"r{i}", ()), reference_tokens(request.prompt, request.max_tokens)
        if got != want[: len(got)] or (request.aborted_at is None and got != want):
            raise Mismatch(
                f"r{i} makes the tokens {list(got)} where its solo uncached run makes "
                f"{list(want)} [{schedule}]"
            )
    for what, mine, right in (
        ("the prompt tokens the prefix cache served each request", served, rose[1]),
        ("(prefix_cache_queries, prefix_cache_hits), each start counting the full blocks "
         "its whole text may be served (lookup_blocks(len(seq.all_ids))) and those it is "
         "served", counters, rose[2]),
    ):  # fmt: skip
        if mine != right:
            raise Mismatch(f"{what}: {mine} where rose's manager has {right} [{schedule}]")


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
        EngineConfig(kv_block_size=4, num_kv_blocks=num_kv_blocks, max_num_seqs=2),
    )


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
        EngineConfig(kv_block_size=4, num_kv_blocks=6, max_num_seqs=2),
    )


def _shared_prefixes(module: types.ModuleType) -> None:
    compare_schedule(prefix_workload(40), module)


def chunked_in_a_short_pool() -> Schedule:
    """A token budget below the sequence cap (every prompt prefilled two tokens a step, so
    `can_grow` is asked for room for each chunk, not for the whole sequence) in a pool too
    short for all four requests: one is preempted, cached blocks are evicted, and two
    requests are served a prefix another computed."""
    head = chunk("ROMEO:\nBut soft, what light through yonder window", 8)
    return Schedule(
        (
            Request(head + chunk(" breaks?", 3), 4),
            Request(head + chunk(" is the east", 3), 4),
            Request(chunk("JULIET:\nO Romeo, Romeo! wherefore art thou", 10), 4, arrives=2),
            Request(head + chunk(" and Juliet is the sun", 2), 3, arrives=6),
        ),
        EngineConfig(kv_block_size=4, num_kv_blocks=6, max_num_seqs=4, max_num_batched_tokens=2),
    )


def _short_pool(module: types.ModuleType) -> None:
    compare_schedule(prefix_workload(9), module)  # preemptions and evictions
    compare_schedule(evicted_while_waiting(), module)
    compare_schedule(chunked_in_a_short_pool(), module)


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
        EngineConfig(
            kv_block_size=size,
            num_kv_blocks=longest + draw(st.integers(0, 6)),
            max_num_seqs=draw(st.sampled_from([1, 2, 4])),
            max_num_batched_tokens=draw(st.sampled_from([4, 9, 64])),
            enable_prefix_caching=draw(st.sampled_from([True, True, False])),
        ),
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
    return [lived(module.BlockManager)]


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
    known_wrong=KNOWN_WRONG,
    passed="equal to rose's block manager, and every request to its solo run",
)
