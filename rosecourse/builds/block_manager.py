"""Build (chapters 11-13): the block manager, run inside rose's engine.

Contract: rosecourse/solutions/build_block_manager.py. The parts:

* the chained key: equal for equal blocks behind equal parents, different otherwise;
* the bookkeeping alone: one scripted life of a few sequences (shared prefixes, a block
  repeated inside one prompt, a release, an eviction), every answer and count beside
  rose's BlockManager doing the same, the pool's invariants checked after every call
  (`check_pool`); block *ids* may differ from rose's, nothing else may;
* rose's engine with the learner's BlockManager in place of rose's (LLMEngine builds it):
  a workload of shared prefixes with room to spare, the same in a pool so small that
  requests are preempted and cached blocks evicted, and random schedules drawn by
  hypothesis (block sizes that are not powers of two, pool sizes, token budgets that
  chunk the prefill, arrivals, aborts, now and then no prefix caching). After every engine step the pool's invariants
  hold; every request's tokens are its solo uncached run's (an aborted one's, the start
  of it); and each request's prompt tokens served by the prefix cache are what rose's
  own manager serves on the same schedule.

The model is the chapters' random strong-oracle model, which has no sliding window, so the
engine's window hook (`drop_out_of_window`) is not the learner's to write.
"""

from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass
from unittest import mock

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import strategies as st

import roseinfer.engine.llm_engine
from rosecourse.builds.grading import Build, KnownWrong, Mismatch, Part
from rosecourse.exercises import encoded, oracle_model, reference_tokens
from roseinfer.engine.block_manager import BlockManager, check_pool
from roseinfer.engine.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.engine.sequence import EngineSequence
from roseinfer.request.sampling import SamplingParams
from rosetrainer.tokenizer import Tokenizer

MAX_STEPS = 300  # an engine that makes no progress is stopped here, and says so
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


def learners(module: types.ModuleType):
    """What LLMEngine calls to build its manager, building the learner's instead."""

    def make(num_blocks, kv_block_size, enable_prefix_caching=True, *_window_and_seed):
        manager = module.BlockManager(num_blocks, kv_block_size, enable_prefix_caching)
        manager.drop_out_of_window = lambda seq: None  # no sliding window in this model
        return manager

    return make


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
        check_invariants=True,
    )
    swap = contextlib.nullcontext()
    if module is not None:
        swap = mock.patch.object(roseinfer.engine.llm_engine, "BlockManager", learners(module))
    with swap:
        engine = LLMEngine(oracle_model(), tokenizer(), config)
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
        try:
            check_pool(
                engine.block_manager,
                list(engine.requests.values()),
                runner.written_slots if ran else (),
                runner.writer_tables if ran else (),
            )
        except AssertionError as error:
            why = f"after engine step {step}, the pool's invariants break: {error}"
            raise Mismatch(why) from None
        step += 1
        if step == MAX_STEPS:
            raise Mismatch(f"the engine made no progress in {MAX_STEPS} steps")
    return seen


@functools.cache
def roses(schedule: Schedule) -> dict[str, tuple]:
    return run_schedule(schedule, None)


def compare_schedule(schedule: Schedule, module: types.ModuleType) -> None:
    """The learner's manager on `schedule`: every request against its solo uncached run,
    and the prefix cache's service against rose's manager's on the same schedule."""
    try:
        mine = run_schedule(schedule, module)
    except Mismatch as error:
        raise Mismatch(f"{error} [{schedule}]") from None
    except NotImplementedError:
        raise
    except Exception as error:  # the learner's manager broke the engine
        message = str(error).splitlines()[0] if str(error) else ""
        why = f"the engine raised {type(error).__name__}: {message} [{schedule}]"
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
    if not isinstance(first, bytes):
        raise Mismatch(f"chain_hash returns a {type(first).__name__}, not bytes")
    for what, got, want in cases:
        if got != want:
            raise Mismatch(f"{what} get {'one key' if got else 'two keys'}")


# -- the bookkeeping, scripted -----------------------------------------------------------------


def scripted(manager_cls: type) -> list[tuple]:
    """One life of a pool of 7 blocks of 3 slots, every answer and count along the way;
    the pool's invariants are checked after every call."""
    manager = manager_cls(7, 3, True)
    a = EngineSequence(list(range(1, 9)), SamplingParams(max_tokens=1))
    b = EngineSequence([*range(1, 7), 20, 21], SamplingParams(max_tokens=1))
    c = EngineSequence([5] * 7, SamplingParams(max_tokens=1))  # one block, repeated
    d = EngineSequence([5] * 7, SamplingParams(max_tokens=1))
    e = EngineSequence(list(range(30, 41)), SamplingParams(max_tokens=1))
    live: list[EngineSequence] = []
    seen: list[tuple] = []

    def note(what: str, answer: object = None) -> None:
        try:
            check_pool(manager, live)
            broken = None
        except AssertionError as error:
            broken = str(error)
        seen.append(
            (
                what,
                broken,
                answer,
                manager.num_free,
                len(manager.evictable),
                manager.prefix_cache_queries,
                manager.prefix_cache_hits,
                tuple((len(s.block_table), s.num_computed_tokens) for s in live),
            )
        )

    def start(seq: EngineSequence, name: str) -> None:
        cached = manager.cached_prefix(seq.all_ids)
        note(f"{name}: blocks the prefix cache holds", (len(cached), len(set(cached))))
        can = manager.can_start(cached, seq.num_tokens)
        note(f"{name}: can it start", can)
        if can:
            manager.start(seq, cached, seq.num_tokens)
            live.append(seq)
            note(f"{name}: started")
            manager.advance(seq, seq.num_tokens - seq.num_computed_tokens)
            note(f"{name}: computed")

    def release(seq: EngineSequence, name: str) -> None:
        manager.release(seq)
        live.remove(seq)
        note(f"{name}: released")

    start(a, "a")
    start(b, "b")  # two blocks shared with a
    note("a's first 6 tokens: blocks the cache serves", len(manager.cached_prefix(a.all_ids[:6])))
    release(a, "a")
    start(c, "c")
    start(d, "d")  # c's two full blocks, told apart by their parents
    note("e before anyone leaves: can it grow", manager.can_grow(e, e.num_tokens))
    release(b, "b")
    note("e: can it start now", manager.can_start([], e.num_tokens))  # one block short
    release(c, "c")
    release(d, "d")
    note("e: can it grow", manager.can_grow(e, e.num_tokens))  # with the cached blocks
    start(e, "e")  # one block more than the free ones: the least recently given back goes
    note("b's prefix after e", len(manager.cached_prefix(b.all_ids)))
    note("d's prefix after e", len(manager.cached_prefix(d.all_ids)))
    return seen


def _bookkeeping(module: types.ModuleType) -> None:
    want = scripted(BlockManager)
    got = scripted(module.BlockManager)
    names = ("the pool's invariants break:", "the answer", "free blocks", "evictable blocks", "prefix_cache_queries",
             "prefix_cache_hits", "(table length, num_computed_tokens) of each live sequence")  # fmt: skip
    for mine, right in zip(got, want, strict=True):
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


def _short_pool(module: types.ModuleType) -> None:
    compare_schedule(prefix_workload(9), module)  # preemptions and evictions


PIECES = ("ROMEO:\nBut soft, what light", "JULIET:\nO Romeo, Romeo", "Good night, good night")


@st.composite
def schedules(draw: st.DrawFn) -> Schedule:
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
    @given(schedules())
    def each(schedule: Schedule) -> None:
        compare_schedule(schedule, module)

    each()


def _probe(module: types.ModuleType) -> list[object]:
    return [scripted(module.BlockManager)]


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
            (('data = parent + b"|" + ', 'data = b"|" + '),),
            "a block's key is its own tokens alone: chain the previous block's key in, or a "
            "block is found behind any other prefix (and a repeated block finds itself)",
        ),
        KnownWrong(
            "hit_not_held",
            (("            block.ref_count += 1\n", ""),),
            "a block the prefix cache serves is not counted as held by the new sequence: "
            "add one to its ref_count",
        ),
        KnownWrong(
            "serves_the_last_token",
            (
                (
                    "return (num_tokens - 1) // self.kv_block_size",
                    "return num_tokens // self.kv_block_size",
                ),
            ),  # fmt: skip
            "the cache may serve a block holding the prompt's last token: that token must "
            "be computed, its logits give the first new token",
        ),
        KnownWrong(
            "cache_dropped_on_release",
            (
                (
                    "                if block.hash is not None:\n"
                    "                    self.evictable[block_id] = None\n"
                    "                else:\n"
                    "                    self.free_ids.append(block_id)\n",
                    "                self.free_ids.append(block_id)\n",
                ),
            ),
            "a keyed block nobody holds goes back to the free list, so the prefix cache "
            "never serves a finished request's blocks: keep it cached (evictable)",
        ),
        KnownWrong(
            "evicts_the_newest",
            (("self.evictable.popitem(last=False)", "self.evictable.popitem(last=True)"),),
            "the pool evicts the cached block given back most recently; evict the least "
            "recently given back",
        ),
        KnownWrong(
            "cached_blocks_unavailable",
            (
                (
                    "return needed <= self.num_free + len(self.evictable)\n",
                    "return needed <= self.num_free\n",
                ),
            ),  # fmt: skip
            "can_grow counts the free blocks only: the cached blocks nobody holds are room "
            "too (evicted when taken)",
        ),
    ),
    passed="equal to rose's block manager, and every request to its solo run",
)
