"""Exercises on the serving engine: chapters 11 to 14.

The learner's piece is swapped into the real engine (LLMEngine over a paged pool whose
free blocks are handed out in a shuffled order, so a logical block number used as a
physical one cannot pass by luck). After every engine step the pool's invariants are
checked (roseinfer.engine.block_manager.check_pool); a broken one is reported at that
step. The oracle is each request's solo uncached run, and where the piece decides
something the tokens cannot show (what was scheduled, what was found in the prefix
cache, what a stream showed), the real piece's decisions on the same workload.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from unittest import mock

import torch

from rosecourse.demo import PROMPT
from rosecourse.exercises import (
    BATCH_TEXTS,
    CheckResult,
    Exercise,
    KnownWrong,
    check,
    encoded,
    oracle_model,
    outcome,
    reference_tokens,
)
from roseinfer.cache.paged import slot_mapping
from roseinfer.engine.block_manager import BlockManager, check_pool
from roseinfer.engine.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.engine.outputs import RequestOutput
from roseinfer.engine.scheduler import ScheduledBatch, Scheduler
from roseinfer.request.detokenizer import held_back
from roseinfer.request.sampling import SamplingParams
from rosetrainer.tokenizer import Tokenizer

KV_BLOCK = 4  # tokens per KV block: small, so a few requests span many blocks
ENGINE_NEW = 12  # tokens per request
MAX_STEPS = 400  # an engine that makes no progress is stopped here, and says so


def engine_step_name(step: int) -> str:
    return f"engine step {step}"


@functools.cache
def tokenizer() -> Tokenizer:
    return Tokenizer("gpt2")


def make_engine(**config: object) -> LLMEngine:
    settings = {"kv_block_size": KV_BLOCK, "shuffle_blocks_seed": 0, **config}
    return LLMEngine(oracle_model(), tokenizer(), EngineConfig(**settings))


@dataclasses.dataclass
class EngineRun:
    """One workload driven to its end: per request its tokens, per step what was seen."""

    tokens: dict[str, list[int]]
    steps: list[object]


def drive(
    engine: LLMEngine,
    requests: list[tuple[list[int], SamplingParams]],
    observe: Callable[[LLMEngine, list[RequestOutput]], object],
    on_token: Callable[[int, int], None] | None = None,
) -> EngineRun:
    """Add every request, step until all finish, checking the pool after every step;
    `observe(engine, outputs)` says what each step shows the check, `on_token(row, token)`
    hears each request's (row's) every new token."""
    ids = [
        engine.add_request(list(p), params, request_id=f"r{i}")
        for i, (p, params) in enumerate(requests)
    ]
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    steps: list[object] = []
    while engine.has_unfinished():
        if len(steps) == MAX_STEPS:
            raise RuntimeError(f"the engine made no progress in {MAX_STEPS} steps")
        outputs = engine.step()
        for output in outputs:
            tokens[output.request_id] = list(output.token_ids)
            for token in output.new_token_ids if on_token else ():
                on_token(ids.index(output.request_id), token)
        steps.append(observe(engine, outputs))
        runner = engine.runner
        check_pool(
            engine.block_manager,
            list(engine.requests.values()),
            runner.written_slots,
            runner.writer_tables,
        )
    return EngineRun(tokens, steps)


def greedy(max_tokens: int = ENGINE_NEW, **options: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **options)


def solo_tokens(requests: list[tuple[list[int], SamplingParams]]) -> list[tuple[int, ...]]:
    return [reference_tokens(tuple(p), params.max_tokens) for p, params in requests]


def engine_runs(
    workload: Callable[[], list[tuple[list[int], SamplingParams]]],
    observe: Callable[[LLMEngine, list[RequestOutput]], object] | None,
    what: str,
    tokens_too: bool = True,
    **config: object,
) -> list[tuple[str, Callable, Callable]]:
    """Two runs of one workload on an engine built from `config`: first (when `observe` is
    given) what each step shows against the real piece's steps, then each request's tokens
    against its solo uncached run (the rows of that run are the requests)."""

    def run_engine(on_step: Callable[[int, int], None] | None, on_token=None) -> EngineRun:
        def seen(engine: LLMEngine, outputs: list[RequestOutput]) -> object:
            if on_step is not None:
                on_step(0, 0)  # a step is a "token" of the run of plans
            return observe(engine, outputs) if observe else None

        return drive(make_engine(**config), workload(), seen, on_token)

    def tokens(on_token: Callable[[int, int], None]) -> list[list[int]]:
        run = run_engine(None, on_token)
        return [run.tokens[f"r{i}"] for i in range(len(run.tokens))]

    runs = []
    if observe is not None:
        reference_steps = functools.cache(lambda: [tuple(run_engine(None).steps)])
        runs.append(
            (what, reference_steps, lambda on_token: [run_engine(on_token).steps]),
        )
    if tokens_too:
        runs.append(("each request's tokens", lambda: solo_tokens(workload()), tokens))
    return runs


def chapter_prompts() -> list[tuple[int, ...]]:
    return [encoded(text) for text in (*BATCH_TEXTS, PROMPT + " now")]


# -- 11: the slot mapping ------------------------------------------------------------------------


def _slot_probe(fn: Callable) -> list[object]:
    tables = torch.tensor([[5, 2, 7], [3, 0, 0]])
    seq_of_token = torch.tensor([0, 0, 0, 0, 1, 1])
    positions = torch.tensor([0, 3, 4, 9, 0, 2])
    return [outcome(lambda: fn(tables, seq_of_token, positions, 4))]


def _slot_workload() -> list[tuple[list[int], SamplingParams]]:
    return [(list(p), greedy()) for p in chapter_prompts()]


def _logical_slots(block_tables, seq_of_token, positions, kv_block_size):
    return seq_of_token * block_tables.size(1) * kv_block_size + positions


def _position_as_offset(block_tables, seq_of_token, positions, kv_block_size):
    return block_tables[seq_of_token, positions // kv_block_size] * kv_block_size + positions


def _first_table(block_tables, seq_of_token, positions, kv_block_size):
    return block_tables[0, positions // kv_block_size] * kv_block_size + positions % kv_block_size


def _swapped_division(block_tables, seq_of_token, positions, kv_block_size):
    return (
        block_tables[seq_of_token, positions % kv_block_size] * kv_block_size
        + positions // kv_block_size
    )


SLOT_MAPPING = Exercise(
    name="slot_mapping",
    reference=slot_mapping,
    probe=_slot_probe,
    swapped_in=lambda fn: mock.patch("roseinfer.cache.paged.slot_mapping", fn),
    runs=engine_runs(_slot_workload, None, "", num_kv_blocks=40),
    known_wrong=[
        KnownWrong(
            "logical_slots",
            _logical_slots,
            "you never look at the block table: a logical slot is not a physical one "
            "(the pool hands blocks out in any order)",
        ),
        KnownWrong(
            "position_as_offset",
            _position_as_offset,
            "the offset inside the block is the whole position (no % kv_block_size): every "
            "token past the first block lands in some other block",
        ),
        KnownWrong(
            "first_table",
            _first_table,
            "every token uses the first sequence's block table: pick the row of the "
            "token's own sequence",
        ),
        KnownWrong(
            "swapped_division",
            _swapped_division,
            "// and % are swapped: the block index is position // kv_block_size, the offset "
            "position % kv_block_size",
        ),
    ],
    fallback="some token is written to or read from a slot that is not its own",
)


def check_slot_mapping(fn: Callable) -> CheckResult:
    """Chapter 11: `slot_mapping(block_tables, seq_of_token, positions, kv_block_size) -> slots`."""
    return check(SLOT_MAPPING, fn)


# -- 12: the scheduler's step --------------------------------------------------------------------

_real_schedule = Scheduler.schedule


def schedule(scheduler: Scheduler) -> ScheduledBatch:
    """The reference: Scheduler.schedule."""
    return _real_schedule(scheduler)


def plan(engine: LLMEngine, outputs: list[RequestOutput]) -> tuple:
    """What the scheduler decided in the step just run: who ran with how many tokens, who
    was preempted."""
    batch = engine.last_batch
    ran = tuple(
        (seq.request_id, n) for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
    )
    return ran, tuple(seq.request_id for seq in batch.preempted)


SCHEDULE_SETTINGS = {"max_num_batched_tokens": 10, "max_num_seqs": 3, "num_kv_blocks": 14}


def _schedule_workload() -> list[tuple[list[int], SamplingParams]]:
    return [(list(p), greedy()) for p in chapter_prompts()]


def _schedule_probe(fn: Callable) -> list[object]:
    """The plans of a small workload, steps only (no model): prompts of 9, 5 and 7 tokens."""
    config = EngineConfig(kv_block_size=KV_BLOCK, **SCHEDULE_SETTINGS)
    manager = BlockManager(6, KV_BLOCK)
    scheduler = Scheduler(config, manager)
    engine = make_engine(**SCHEDULE_SETTINGS)  # only to build sequences as it does
    for i, length in enumerate((9, 5, 7)):
        engine.add_request(list(range(1, length + 1)), greedy(3), request_id=f"p{i}")
        scheduler.add(engine.requests[f"p{i}"])

    def steps() -> list[tuple]:
        seen = []
        for _ in range(12):
            batch = fn(scheduler)
            seen.append(
                (
                    tuple(
                        (s.request_id, n)
                        for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
                    ),
                    tuple(s.request_id for s in batch.preempted),
                )
            )
            for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
                seq.num_computed_tokens += n
                if seq.num_computed_tokens == seq.num_tokens:
                    seq.append_token(7, 0.0)
                    if seq.is_finished:
                        scheduler.finish(seq)
        return seen

    return [outcome(steps)]


@contextlib.contextmanager
def _config_replaced(scheduler: Scheduler, **changes: object):
    kept = scheduler.config
    scheduler.config = dataclasses.replace(kept, **changes)
    try:
        yield
    finally:
        scheduler.config = kept


def _ignores_budget(scheduler):
    with _config_replaced(scheduler, max_num_batched_tokens=10**9):
        return schedule(scheduler)


def _ignores_max_seqs(scheduler):
    with _config_replaced(scheduler, max_num_seqs=10**9):
        return schedule(scheduler)


def _static_batching(scheduler):
    if not scheduler.running:
        return schedule(scheduler)
    waiting, scheduler.waiting = scheduler.waiting, type(scheduler.waiting)()
    try:
        return schedule(scheduler)
    finally:
        scheduler.waiting = waiting


SCHEDULE = Exercise(
    name="schedule",
    reference=schedule,
    probe=_schedule_probe,
    swapped_in=lambda fn: mock.patch.object(Scheduler, "schedule", fn),
    runs=engine_runs(
        _schedule_workload,
        plan,
        "the plan of every step, against the reference scheduler's",
        **SCHEDULE_SETTINGS,
    ),
    known_wrong=[
        KnownWrong(
            "ignores_budget",
            _ignores_budget,
            "you ignore max_num_batched_tokens: a long prompt must be prefilled in chunks "
            "of what is left of the step's token budget",
        ),
        KnownWrong(
            "ignores_max_seqs",
            _ignores_max_seqs,
            "you admit more running sequences than max_num_seqs",
        ),
        KnownWrong(
            "static_batching",
            _static_batching,
            "nobody is admitted while anyone runs: that is static batching; continuous "
            "batching admits waiting requests into every step with room",
        ),
    ],
    fallback="your plan differs from the policy (running oldest first, the newest "
    "preempted, waiting first come first served, within the token budget)",
    step_label=engine_step_name,
)


def check_schedule(fn: Callable) -> CheckResult:
    """Chapter 12: `schedule(scheduler) -> ScheduledBatch`, the decision for one step."""
    return check(SCHEDULE, fn)


# -- 13: the prefix cache's lookup -------------------------------------------------------------

_real_cached_prefix = BlockManager.cached_prefix


def cached_prefix(manager: BlockManager, token_ids: list[int]) -> list[int]:
    """The reference: BlockManager.cached_prefix."""
    return _real_cached_prefix(manager, token_ids)


def _prefix_workload() -> list[tuple[list[int], SamplingParams]]:
    """A shared 12-token head, one prompt exactly 3 blocks long (its last token must be
    computed), and a prompt whose second block repeats another's second block behind a
    different first block (a key of the block's tokens alone would find it)."""
    head = list(encoded("ROMEO:\nBut soft, what light through yonder window")[:12])
    other = [head[1], head[0], head[2], head[3], *head[4:]]
    return [
        (head + list(encoded(" breaks?")), greedy()),
        (head + list(encoded(" is the east")), greedy()),
        (head, greedy()),
        (other + list(encoded(" breaks?")), greedy()),
    ]


def cache_hits(engine: LLMEngine, outputs: list[RequestOutput]) -> tuple:
    return tuple(sorted((o.request_id, o.num_cached_tokens) for o in outputs))


def _prefix_probe(fn: Callable) -> list[object]:
    """Lookups in a manager that holds two registered sequences' full blocks."""
    engine = make_engine(num_kv_blocks=16, max_num_seqs=1)
    first = list(range(100, 113))  # 13 tokens: 3 full blocks
    engine.add_request(first, greedy(1), request_id="a")
    while engine.has_unfinished():
        engine.step()
    manager = engine.block_manager
    queries = [first, first[:12], first[:8] + [1, 2, 3, 4, 5], [*first[4:8], *first[:4], 9], [7, 8]]
    return [outcome(lambda q=q: list(fn(manager, q))) for q in queries]


def _unchained(manager, token_ids):
    from roseinfer.engine.block_manager import chain_hash

    found = []
    for i in range(manager.lookup_blocks(len(token_ids))):
        tokens = tuple(token_ids[i * manager.kv_block_size : (i + 1) * manager.kv_block_size])
        block_id = manager.cached.get(chain_hash(b"", tokens))
        if block_id is None:
            break
        found.append(block_id)
    return found


def _serves_the_last_token(manager, token_ids):
    # One more block than lookup_blocks allows when the prompt fills its blocks exactly.
    return cached_prefix(manager, [*token_ids, 0])


PREFIX_CACHED = Exercise(
    name="cached_prefix",
    reference=cached_prefix,
    probe=_prefix_probe,
    swapped_in=lambda fn: mock.patch.object(BlockManager, "cached_prefix", fn),
    runs=engine_runs(
        _prefix_workload,
        cache_hits,
        "tokens served from the prefix cache, against the reference lookup's",
        num_kv_blocks=40,
        max_num_seqs=1,  # one at a time: each request finds its predecessors' blocks
    ),
    known_wrong=[
        KnownWrong(
            "unchained",
            _unchained,
            "your key is the block's tokens alone: the pool keys a block by its tokens and "
            "every token before it (chain the parent's hash), so only the first block is found",
        ),
        KnownWrong(
            "serves_the_last_token",
            _serves_the_last_token,
            "you serve a prompt's last block even when it holds the last token: that token "
            "must be computed, its logits choose the first new token",
        ),
    ],
    fallback="the blocks you find are not the longest run of the prompt's full blocks "
    "(the last token excluded) that the pool holds under their chained keys",
    step_label=engine_step_name,
)


def check_cached_prefix(fn: Callable) -> CheckResult:
    """Chapter 13: `cached_prefix(manager, token_ids) -> physical block ids`."""
    return check(PREFIX_CACHED, fn)


# -- 14: the stream's hold-back ------------------------------------------------------------------


def _hold_probe(fn: Callable) -> list[object]:
    cases = [
        ("Good mor", ("morning",)),
        ("Good morning", ("morning",)),
        ("ab", ("abc", "bcd")),
        ("xxab", ("bz", "abz")),
        ("", ("a",)),
        ("hello", ()),
    ]
    return [outcome(lambda c=c: fn(*c)) for c in cases]


@functools.cache
def stop_strings() -> tuple[str, ...]:
    """Stops that the chapter prompt's greedy text begins partway through its tokens: the
    text of 3 tokens from token 6 on, and one that never comes."""
    ids = reference_tokens(encoded(PROMPT), ENGINE_NEW)
    decode = tokenizer().decode
    return (decode(list(ids[6:9])), decode(list(ids[2:4])) + "\u00a7")


def _stream_workload() -> list[tuple[list[int], SamplingParams]]:
    return [(list(encoded(PROMPT)), greedy(stop=list(stop_strings())))]


def shown_text(engine: LLMEngine, outputs: list[RequestOutput]) -> tuple:
    return tuple(o.text for o in outputs)


def _holds_nothing(text, stops):
    return 0


def _holds_whole_stop(text, stops):
    return min(len(text), max(map(len, stops), default=0))


def _first_stop_only(text, stops):
    return held_back(text, stops[:1])


def _includes_the_whole_stop(text, stops):
    longest = 0
    for stop in stops:
        for length in range(min(len(stop), len(text)), 0, -1):
            if text.endswith(stop[:length]):
                longest = max(longest, length)
                break
    return longest


HELD_BACK = Exercise(
    name="held_back",
    reference=held_back,
    probe=_hold_probe,
    swapped_in=lambda fn: mock.patch("roseinfer.request.detokenizer.held_back", fn),
    runs=engine_runs(
        _stream_workload,
        shown_text,
        "the text the stream shows at every step",
        tokens_too=False,  # a stop string ends it early: its steps are the oracle
        num_kv_blocks=40,
    ),
    known_wrong=[
        KnownWrong(
            "holds_nothing",
            _holds_nothing,
            "you hold nothing back: the stream shows the start of a stop string, and "
            "cannot take it back when the stop completes",
        ),
        KnownWrong(
            "holds_whole_stop",
            _holds_whole_stop,
            "you always hold back a stop string's length: hold only a tail that could "
            "still begin one, or the stream lags for nothing",
        ),
        KnownWrong(
            "first_stop_only",
            _first_stop_only,
            "you look at the first stop string only: any of them may be beginning",
        ),
        KnownWrong(
            "includes_the_whole_stop",
            _includes_the_whole_stop,
            "you count a whole stop string as 'could still begin one': a completed stop "
            "has finished the request already; hold at most len(stop) - 1 characters",
        ),
    ],
    fallback="the tail you hold back is not the longest one that could begin a stop string",
    step_label=engine_step_name,
)


def check_held_back(fn: Callable) -> CheckResult:
    """Chapter 14: `held_back(text, stops) -> characters to hold back`."""
    return check(HELD_BACK, fn)
