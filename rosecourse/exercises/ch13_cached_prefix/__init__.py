"""Chapter 13's exercise: the prefix cache's lookup by chained block hashes.

The learner's function is the lookup of the block manager the engine is given
(`LookupOf`, through LLMEngine's block_manager_class: no patch).

The contract is the docstring of rosecourse/exercises/ch13_cached_prefix/reference.py.
"""

from __future__ import annotations

from collections.abc import Callable

from rosecourse.exercises.answers import known_mistakes
from rosecourse.exercises.common import (
    CheckResult,
    Exercise,
    Probe,
    check,
    encoded,
    held_function,
    hold,
    outcome,
)
from rosecourse.exercises.engine import (
    engine_runs,
    engine_step_name,
    greedy,
    make_engine,
)
from roseinfer.engine.block_manager import BlockManager, chain_hash
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.engine.outputs import RequestOutput
from roseinfer.engine.sequence import EngineSequence
from roseinfer.request.sampling import SamplingParams

_real_cached_prefix = BlockManager.cached_prefix


def cached_prefix(manager: BlockManager, token_ids: list[int]) -> list[int]:
    """The reference: BlockManager.cached_prefix."""
    return _real_cached_prefix(manager, token_ids)


class LookupOf(BlockManager):
    """rose's BlockManager whose prefix-cache lookup is the function `hold` holds (the
    learner's, in a check): LLMEngine takes it as its block_manager_class."""

    def cached_prefix(self, token_ids: list[int]) -> list[int]:
        return held_function(cached_prefix)(self, token_ids)


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


def _prefix_probe(fn: Callable) -> Probe:
    """Lookups in a pool that holds one finished 13-token prompt's full blocks, for blocks
    of 4 tokens and of 3."""
    probe: Probe = {}
    first = list(range(100, 113))
    for size in (4, 3):
        engine = make_engine(kv_block_size=size, num_kv_blocks=16, max_num_seqs=1)
        engine.add_request(first, greedy(1), request_id="a")
        while engine.has_unfinished():
            engine.step()
        manager = engine.block_manager
        queries = {
            "the same prompt": first,
            f"its first {3 * size} tokens": first[: 3 * size],
            "its first 2 blocks, then others": first[: 2 * size] + [1, 2, 3, 4, 5],
            "its blocks 1 and 0 swapped": [*first[size : 2 * size], *first[:size], 9],
            "its block 0 twice": [*first[:size], *first[:size], 9],
            "2 other tokens": [7, 8],
        }
        for name, query in queries.items():
            call = f"cached_prefix(manager, {name}), kv_block_size={size}"
            probe[call] = outcome(lambda q=query, m=manager: list(fn(m, q)))
    manager, prompt = _later_block_without_block_0()
    call = "cached_prefix(manager, [1, 2, 3, 4, 5]), block 0 evicted, block 1 still cached"
    probe[call] = outcome(lambda: list(fn(manager, prompt)))
    collided = _colliding_key()
    call = "cached_prefix(manager, [1, 2, 3]), the key of [1, 2] found on a block of [7, 8]"
    probe[call] = outcome(lambda: list(fn(collided, [1, 2, 3])))
    return probe


def _colliding_key() -> BlockManager:
    """A pool (2-token blocks) whose block of [7, 8] is cached, found under the key of
    [1, 2] too: what a lookup meets when two blocks' keys collide (a hash, however long,
    can), made by hand. The key alone would serve it; its tokens are not the prompt's."""
    manager = BlockManager(num_blocks=4, kv_block_size=2, enable_prefix_caching=True)
    seq = EngineSequence(prompt_ids=[7, 8, 9])
    manager.start(seq, [], 3)
    manager.advance(seq, 3)  # block 0, [7, 8], keyed
    manager.cached[chain_hash(b"", (1, 2))] = seq.block_table[0]
    return manager


def _later_block_without_block_0() -> tuple[BlockManager, list[int]]:
    """A pool (2-token blocks) where a prompt's block 1 is still cached and its block 0 is
    not: the lookup must stop at block 0 and serve nothing. Reached with the pool's own
    calls: two copies of the prompt run side by side, the one whose block 0 is keyed
    ends, another request takes its block 0 (evicted), and the copy that keyed block 1
    ends."""
    manager = BlockManager(num_blocks=4, kv_block_size=2, enable_prefix_caching=True)
    prompt = [1, 2, 3, 4, 5]
    a, c = EngineSequence(prompt_ids=list(prompt)), EngineSequence(prompt_ids=list(prompt))
    manager.start(a, [], 2)
    manager.start(c, [], 2)
    manager.advance(a, 2)  # a's block 0 keyed; c's copy is not (the key is taken)
    manager.advance(c, 2)
    manager.grow(c, 4)
    manager.advance(c, 2)  # c's block 1 keyed, chained on block 0's key
    manager.release(a)  # a's block 0: evictable
    other = EngineSequence(prompt_ids=[9] * 8)
    manager.start(other, [], 2)  # the one free block
    manager.grow(other, 4)  # no free block: a's block 0 evicted
    manager.release(c)  # c's block 1 evictable, still cached
    return manager, prompt


EXERCISE = Exercise(
    name="cached_prefix",
    reference=cached_prefix,
    probe=_prefix_probe,
    swapped_in=hold,
    runs=[
        run
        for size, blocks in ((4, 40), (3, 52))
        for run in engine_runs(
            _prefix_workload,
            cache_hits,
            "tokens served from the prefix cache, against the reference lookup's "
            f"(kv_block_size={size})",
            kv_block_size=size,
            num_kv_blocks=blocks,
            max_num_seqs=1,  # one at a time: each request finds its predecessors' blocks
            parts={"block_manager_class": LookupOf},
        )
    ],
    known_wrong=known_mistakes(__name__),
    fallback="the blocks you find are not the longest run of the prompt's full blocks "
    "(the last token excluded) that the pool holds under their chained keys",
    step_label=engine_step_name,
)


def check_cached_prefix(fn: Callable) -> CheckResult:
    """Chapter 13: `cached_prefix(manager, token_ids) -> physical block ids`."""
    return check(EXERCISE, fn)
