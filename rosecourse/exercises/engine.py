"""What the engine's exercises (chapters 11 to 14) share: an engine, a workload, its runs.

The learner's piece is swapped into the real engine (LLMEngine over a paged pool whose
free blocks are handed out in a shuffled order, so a logical block number used as a
physical one cannot pass by luck). After every engine step the pool's invariants are
checked (roseinfer.engine.block_manager.check_pool); a broken one is reported at that
step. The oracle is each request's solo uncached run, and where the piece decides
something the tokens cannot show (what was scheduled, what was found in the prefix
cache, what a stream showed), the real piece's decisions on the same workload.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from rosecourse.demo import (
    PROMPT,
)
from rosecourse.exercises.common import (
    BATCH_TEXTS,
    encoded,
    oracle_model,
    reference_tokens,
)
from roseinfer.engine.block_manager import check_pool
from roseinfer.engine.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.engine.outputs import RequestOutput
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


def make_engine(parts: dict[str, type] | None = None, **config: object) -> LLMEngine:
    """rose's engine on the oracle model; `parts`: LLMEngine's block_manager_class and
    scheduler_class, where a check passes the learner's piece in."""
    # record_writes: drive() checks the pool after every step, the writes included
    settings = {
        "kv_block_size": KV_BLOCK,
        "shuffle_blocks_seed": 0,
        "record_writes": True,
        **config,
    }
    config = EngineConfig(**settings)
    return LLMEngine(oracle_model(), tokenizer(), config, **(parts or {}))


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
        try:
            check_pool(
                engine.block_manager,
                list(engine.requests.values()),
                runner.written_slots,
                runner.writer_tables,
            )
        except AssertionError as error:  # one sentence: which step, which invariant
            raise PoolBroken(
                f"after engine step {len(steps) - 1}, the pool's invariants break: {error}"
            ) from None
    return EngineRun(tokens, steps)


class PoolBroken(Exception):
    """The block pool's invariants (check_pool) broke after an engine step: its message
    says after which step and which invariant."""


def greedy(max_tokens: int = ENGINE_NEW, **options: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **options)


def solo_tokens(requests: list[tuple[list[int], SamplingParams]]) -> list[tuple[int, ...]]:
    return [reference_tokens(tuple(p), params.max_tokens) for p, params in requests]


def engine_runs(
    workload: Callable[[], list[tuple[list[int], SamplingParams]]],
    observe: Callable[[LLMEngine, list[RequestOutput]], object] | None,
    what: str,
    tokens_too: bool = True,
    parts: dict[str, type] | None = None,
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

        engine = make_engine(parts, **config)
        return drive(engine, workload(), seen, on_token)

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
        settings = ", ".join(f"{key}={value}" for key, value in config.items())
        runs.append(
            (f"each request's tokens ({settings})", lambda: solo_tokens(workload()), tokens)
        )
    return runs


def chapter_prompts() -> list[tuple[int, ...]]:
    return [encoded(text) for text in (*BATCH_TEXTS, PROMPT + " now")]
