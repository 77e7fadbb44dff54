"""Speculative decoding in the engine keeps the oracle's promise on every schedule.

Hypothesis draws the schedules: arrivals between steps, token budgets that cut verify
chunks short, pools small enough to preempt, shared and repeated prompts, a drafter of
each kind and k in 1..8. After every step the pool's invariants hold; at the end every
block is free or cached, every greedy request equals its solo uncached run (a sampled
one its solo run without drafts), and a second wave of requests that continue the first
wave's outputs hits the blocks those requests wrote while drafts were being rejected
(a block registered with a rejected token in it would give another request wrong keys).
"""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch
from engine_runs import assert_one_call_a_step, model_calls, run_checked, schedules
from hypothesis import given
from hypothesis import strategies as st
from models import LLAMA_CHOICES, make_test_model, perturbed_copy

from roseinfer.engine import EngineConfig, LLMEngine
from roseinfer.engine.block_manager import check_pool
from roseinfer.engine.config import ATTENTIONS
from roseinfer.loops.generate import generate
from roseinfer.request.sampling import SamplingParams
from roseinfer.speculative.drafters import ModelDrafter, NgramDrafter, first_layers
from rosetrainer.errors import RoseError
from rosetrainer.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONTEXT = 64
KV_BLOCK = 4
KINDS = ("draft", "ngram", "self")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer("gpt2")


@pytest.fixture(scope="module")
def model():
    return make_test_model(0, n_layer=3, block_size=CONTEXT)


def make_drafter(kind: str, model):
    if kind == "ngram":
        return NgramDrafter(1, 3)
    if kind == "self":
        return ModelDrafter(first_layers(model, 1))
    # A separate model that agrees with the target on most tokens, not all (every draft
    # accepted would never roll anything back).
    return ModelDrafter(perturbed_copy(model, 0.1))


def engine_for(model, tokenizer, drafter, k: int | None, **config) -> LLMEngine:
    config = EngineConfig(kv_block_size=KV_BLOCK, record_writes=True, **config)
    return LLMEngine(model, tokenizer, config, drafter, k)


def solo(model, tokenizer, prompt: list[int], params: SamplingParams) -> list[int]:
    """The oracle: the request alone, uncached, cut where the engine stops at the window."""
    room = CONTEXT - len(prompt) + 1
    params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
    result = generate(
        model, prompt, params, use_cache=False, eot_id=tokenizer.eot_id, decode=tokenizer.decode
    )
    return result.token_ids


def workload(rng: random.Random, n: int) -> list[tuple[list[int], SamplingParams]]:
    """Prompts that repeat themselves (prompt lookup finds drafts), share a prefix or come
    again whole; mostly greedy, some with a stop string, some sampled with a seed."""
    shared = [rng.randrange(512) for _ in range(3 * KV_BLOCK)]
    arrivals = []
    for _ in range(n):
        if arrivals and rng.random() < 0.15:
            prompt = list(rng.choice(arrivals)[0])
        else:
            piece = [rng.randrange(512) for _ in range(rng.randrange(1, 8))]
            prompt = shared[: KV_BLOCK * rng.randrange(4)] + piece * rng.randrange(1, 4)
        draw = rng.random()
        if draw < 0.15:
            params = SamplingParams(
                max_tokens=rng.randrange(1, 30), temperature=1.0, seed=rng.randrange(99)
            )
        elif draw < 0.3:
            params = SamplingParams(max_tokens=rng.randrange(1, 30), stop=("e",))
        else:
            params = SamplingParams(max_tokens=rng.randrange(1, 30))
        arrivals.append((prompt, params))
    return arrivals


@schedules(12)
@given(
    seed=st.integers(0, 10_000),
    kind=st.sampled_from(KINDS),
    k=st.integers(1, 8),
    budget=st.sampled_from([2, 5, 16, 256]),
    num_blocks=st.integers(CONTEXT // KV_BLOCK, 48),
    max_num_seqs=st.integers(1, 6),
    attention=st.sampled_from(ATTENTIONS),
)
@pytest.mark.slow
def test_random_schedules_equal_solo_runs(
    model, tokenizer, seed, kind, k, budget, num_blocks, max_num_seqs, attention
) -> None:
    rng = random.Random(seed)
    engine = engine_for(
        model, tokenizer, make_drafter(kind, model), k, num_kv_blocks=num_blocks,
        max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, attention=attention,
        shuffle_blocks_seed=seed,
    )  # fmt: skip
    first = run_checked(engine, workload(rng, 8), rng)
    # The second wave continues the first wave's greedy outputs: their full blocks, written
    # while drafts were rejected, are served from the prefix cache.
    hits_before = engine.block_manager.prefix_cache_hits
    continued = [
        (prompt + output.token_ids, SamplingParams(max_tokens=8))
        for output, prompt, params in first.values()
        if params.greedy and len(prompt) + len(output.token_ids) < CONTEXT
    ]
    second = run_checked(engine, continued, rng)
    for output, prompt, params in [*first.values(), *second.values()]:
        if params.greedy:
            assert output.token_ids == solo(model, tokenizer, prompt, params)
        else:  # a sampled request decodes without drafts: its own seeded run
            assert output.token_ids == generate(model, prompt, params, use_cache=True).token_ids
    stats = engine.stats().speculative
    assert stats.num_draft_tokens >= stats.num_accepted_tokens
    if len(continued) > 1:
        assert engine.block_manager.prefix_cache_hits > hits_before


@pytest.mark.parametrize("kind", KINDS)
def test_a_grouped_model_speculates_with_the_oracles_tokens(tokenizer, kind) -> None:
    """Four query heads over one key/value head, a pool small enough to preempt: every
    greedy request's tokens are its solo uncached run's, with each kind of drafter."""
    grouped = make_test_model(1, n_layer=3, n_head=4, block_size=CONTEXT, **LLAMA_CHOICES)
    rng = random.Random(7)
    engine = engine_for(
        grouped, tokenizer, make_drafter(kind, grouped), 3, num_kv_blocks=CONTEXT // KV_BLOCK + 4,
        max_num_batched_tokens=16, shuffle_blocks_seed=1,
    )  # fmt: skip
    outputs = run_checked(engine, workload(rng, 8), rng)
    assert engine.stats().num_preemptions > 0
    for output, prompt, params in outputs.values():
        if params.greedy:
            assert output.token_ids == solo(grouped, tokenizer, prompt, params)
    stats = engine.stats().speculative
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


class RecordingDrafter:
    """A drafter that remembers each proposal: the request's tokens then, and the draft."""

    def __init__(self, drafter) -> None:
        self.drafter = drafter
        self.proposals: list[tuple[list[int], list[int]]] = []

    def propose(self, seqs, ks):
        drafts = self.drafter.propose(seqs, ks)
        for seq, draft in zip(seqs, drafts, strict=True):
            self.proposals.append((list(seq.all_ids), list(draft.tokens)))
        return drafts

    def release(self, seq) -> None:
        self.drafter.release(seq)


def test_no_rejected_draft_is_ever_served_from_the_prefix_cache(model, tokenizer) -> None:
    """One request whose drafts are mostly rejected. Then (a) its prompt and output again:
    every full block is hit, and the tokens are the oracle's; (b) requests whose prompts
    are the first one's tokens followed by a draft it rejected: a block keyed by the
    rejected tokens (whose slots the accepted tokens overwrote afterwards) would give them
    wrong keys, so their tokens must be the oracle's too."""
    drafter = RecordingDrafter(make_drafter("self", model))
    engine = engine_for(model, tokenizer, drafter, 4)
    prompt, params = [3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_tokens=40)
    (first,) = run_checked(engine, [(prompt, params)], random.Random(0)).values()
    stats = engine.stats().speculative
    assert stats.num_accepted_tokens < stats.num_draft_tokens - 10  # many rejections
    again = prompt + first[0].token_ids
    (second,) = run_checked(engine, [(again, params)], random.Random(0)).values()
    assert second[0].num_cached_tokens == (len(again) - 1) // KV_BLOCK * KV_BLOCK
    assert second[0].token_ids == solo(model, tokenizer, again, params)
    rejected = [
        (tokens + draft, SamplingParams(max_tokens=4))
        for tokens, draft in drafter.proposals[: len(drafter.proposals) // 2]
        if draft and tokens + draft != again[: len(tokens) + len(draft)]
    ]
    assert len(rejected) > 5
    for output, prompt, params in run_checked(engine, rejected, random.Random(0)).values():
        assert output.token_ids == solo(model, tokenizer, prompt, params)


def test_stops_inside_an_accepted_run(model, tokenizer) -> None:
    """Every draft accepted (the target drafting for itself, k = 8): a stop token among
    them and max_tokens both end the request exactly where the oracle ends."""
    want = solo(model, tokenizer, [7, 8, 9], SamplingParams(max_tokens=20))
    engine = engine_for(model, tokenizer, ModelDrafter(model), 8)
    cases = [SamplingParams(max_tokens=20, stop_token_ids=(want[5],)), SamplingParams(max_tokens=6)]
    outputs = run_checked(engine, [([7, 8, 9], params) for params in cases], random.Random(1))
    got = [output.token_ids for output, _, _ in outputs.values()]
    assert got == [want[: want.index(want[5]) + 1], want[:6]]
    # Request 1's first verify step drafted tokens 1-8 and kept 1-5: the stop token among
    # them ended it (the drafts after it were never taken).
    assert engine.stats().speculative.num_accepted_tokens >= 5


def test_logprobs_of_verified_tokens_are_the_plain_steps(model, tokenizer) -> None:
    """Each token a verify step keeps reports the log-probabilities of its own row."""
    params = SamplingParams(max_tokens=24, logprobs=3)
    requests = [([5, 6, 7, 5, 6], params), ([9, 10, 11], params)]
    plain = run_checked(engine_for(model, tokenizer, None, None), requests, random.Random(0))
    spec = run_checked(
        engine_for(model, tokenizer, make_drafter("draft", model), 4), requests, random.Random(0)
    )
    for (want, _, _), (got, _, _) in zip(plain.values(), spec.values(), strict=True):
        assert got.token_ids == want.token_ids and len(got.logprobs) == len(want.logprobs)
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


class EndOfTextAt(Tokenizer):
    """GPT-2's tokenizer with end-of-text moved to an id the test model does make."""

    def __init__(self, eot_id: int) -> None:
        super().__init__("gpt2")
        self.moved_eot_id = eot_id

    @property
    def eot_id(self) -> int:
        return self.moved_eot_id


def test_end_of_text_inside_an_accepted_run(model, tokenizer) -> None:
    want = solo(model, tokenizer, [7, 8, 9], SamplingParams(max_tokens=20))
    eot = want[6]
    engine = engine_for(model, EndOfTextAt(eot), ModelDrafter(model), 8)
    ((output, _, _),) = run_checked(
        engine, [([7, 8, 9], SamplingParams(max_tokens=20))], random.Random(0)
    ).values()
    assert output.token_ids == want[: want.index(eot)]
    assert (output.finish_reason, output.stop_reason) == ("stop", eot)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_quantized_and_windowed_pools(tokenizer, kind) -> None:
    """int8 pool: equal to the same engine without drafts. A rotary model with a sliding
    window, far past its context: equal to the uncached banded oracle."""
    model = make_test_model(0, n_layer=3, block_size=CONTEXT)
    prompts = [[5, 6, 7] * 4, list(range(100, 130))]
    params = SamplingParams(max_tokens=30)
    quant = dict(kv_cache_dtype="int8", kv_cache_group_size=8, kv_cache_window=KV_BLOCK)
    requests = [(p, params) for p in prompts]
    plain = run_checked(
        engine_for(model, tokenizer, None, None, **quant), requests, random.Random(0)
    )
    drafter = make_drafter(kind, model)
    spec = run_checked(
        engine_for(model, tokenizer, drafter, 4, **quant), requests, random.Random(0)
    )
    assert [o.token_ids for o, _, _ in spec.values()] == [o.token_ids for o, _, _ in plain.values()]
    windowed = make_test_model(
        0, n_layer=3, block_size=32, position_embedding="rotary", sliding_window=10,
        attention_sinks=2,
    )  # fmt: skip
    long = SamplingParams(max_tokens=80)
    engine = engine_for(windowed, tokenizer, make_drafter(kind, windowed), 3)
    for output, prompt, _ in run_checked(
        engine, [(p, long) for p in prompts], random.Random(0)
    ).values():
        assert output.token_ids == generate(windowed, prompt, long, use_cache=False).token_ids


def test_bad_speculative_settings(model, tokenizer) -> None:
    with pytest.raises(RoseError, match="at most 63"):
        LLMEngine(model, tokenizer, None, NgramDrafter(), CONTEXT)
    with pytest.raises(RoseError, match="integer >= 1"):
        LLMEngine(model, tokenizer, None, NgramDrafter(), 0)
    with pytest.raises(RoseError, match="a drafter and num_speculative_tokens"):
        LLMEngine(model, tokenizer, None, NgramDrafter())


def test_every_decoding_sequence_drafts_in_the_same_step(model, tokenizer) -> None:
    """A sequence's room for drafts is at most its drafts (at most k): the first decoding
    sequence must not take the step's whole token budget (and the pool's spare blocks)
    for drafts it can never carry, which left the others out of the step and ran them
    one at a time; and every decoding sequence is asked in the same drafter call."""
    k, batch = 4, 4
    drafter = NgramDrafter(1, 3)
    asked: list[list[int]] = []
    propose = drafter.propose

    def spy(seqs, ks):
        asked.append(list(ks))
        return propose(seqs, ks)

    drafter.propose = spy
    engine = engine_for(model, tokenizer, drafter, k, max_num_batched_tokens=256)
    rng = random.Random(0)
    for _ in range(batch):
        line = [rng.randrange(512) for _ in range(5)]
        engine.add_request(line * 3, SamplingParams(max_tokens=24, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert asked and all(0 < n <= k for ks in asked for n in ks), asked
    assert max(len(ks) for ks in asked) == batch, asked  # all four drafted at once


def test_verify_chunks_go_through_the_model_with_the_rest_of_the_step(model, tokenizer) -> None:
    """One forward a step with drafts too: verify chunks (a sequence's newest token and
    its drafts), plain decoding tokens and prompt chunks in one call, the vocabulary
    projection over the rows that pick tokens (one per draft more)."""
    engine = engine_for(
        model, tokenizer, NgramDrafter(1, 3), 4, max_num_batched_tokens=24, num_kv_blocks=60
    )
    rng = random.Random(1)
    lines = [[rng.randrange(512) for _ in range(rng.randrange(2, 6))] for _ in range(5)]
    arrivals = [(line * 4, SamplingParams(max_tokens=16, ignore_eos=True)) for line in lines]
    arrivals.insert(2, ([3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_tokens=10, seed=1)))
    verified = mixed = steps = 0
    while arrivals or engine.has_unfinished():
        if arrivals and steps % 2 == 0:
            engine.add_request(*arrivals.pop(0))
        with model_calls(engine) as calls:
            engine.step()
        assert_one_call_a_step(engine, calls)
        steps += 1
        if calls:
            verified += calls[0]["sampled"] > len(engine.last_batch.seqs)
            mixed += len({min(n, 3) for n in engine.last_batch.num_new_tokens}) > 1
    assert verified >= 3 and mixed >= 3


def test_drafts_are_proposed_after_the_step_and_taken_by_the_next(model, tokenizer) -> None:
    """The drafter runs after a step's forward, never while the scheduler packs a step;
    a sequence's drafts wait on it (`draft_ids`) until a step runs it, which feeds its
    newest token and as many drafts as fit (the rest are dropped); one the step leaves
    out keeps its drafts; the stats count only the drafts fed."""
    k = 4
    drafter = ModelDrafter(model)  # the target drafting for itself: every draft is right
    engine = engine_for(model, tokenizer, drafter, k, max_num_batched_tokens=4)
    drafter = engine.drafter  # (the draft model in the pool's blocks)
    scheduling = False
    schedule, propose = engine.scheduler.schedule, drafter.propose

    def spied_schedule():
        nonlocal scheduling
        scheduling = True
        try:
            return schedule()
        finally:
            scheduling = False

    def spied_propose(seqs, ks):
        assert not scheduling, "the drafter ran inside scheduling"
        assert all(not seq.draft_ids for seq in seqs)  # asked only for those without drafts
        return propose(seqs, ks)

    engine.scheduler.schedule, drafter.propose = spied_schedule, spied_propose
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    prompts = [[10 + i] for i in range(3)]  # (all three read in one step, then decode)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    seqs = [engine.requests[request_id] for request_id in ids]
    fed = trimmed = kept = 0
    outputs = {}
    while engine.has_unfinished():
        before = {seq: list(seq.draft_ids) for seq in engine.scheduler.running}
        drafted = engine.stats().speculative.num_draft_tokens
        for output in engine.step():
            outputs[output.request_id] = output
        ran = dict(zip(engine.last_batch.seqs, engine.last_batch.num_new_tokens, strict=True))
        step_fed = 0
        for seq, drafts in before.items():
            if seq not in ran:
                assert seq.draft_ids == drafts  # left out: its drafts wait for the next step
                kept += bool(drafts)
            elif drafts:
                assert 1 <= ran[seq] <= 1 + len(drafts)
                step_fed += ran[seq] - 1
                trimmed += ran[seq] - 1 < len(drafts)
        assert engine.stats().speculative.num_draft_tokens - drafted == step_fed
        fed += step_fed
        for seq in engine.scheduler.running:  # who decodes next has its drafts already
            last = len(seq.output_ids) == params.max_tokens - 1  # (its last token: none)
            if seq.num_computed_tokens + 1 == seq.num_tokens and not last:
                assert seq.draft_ids, seq.request_id
    assert fed and trimmed and kept
    assert engine.stats().speculative.num_draft_tokens == fed
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert not seq.draft_ids
        assert outputs[seq.request_id].token_ids == solo(model, tokenizer, prompt, params)
    assert engine.block_manager.num_used == 0  # the drafts' blocks went back with the rest


def test_preempted_and_aborted_sequences_lose_their_drafts(model, tokenizer) -> None:
    """A sequence preempted drops its drafts (it recomputes, then drafts again); an aborted
    one's drafts go with it. Prompt lookup's drafts take no block, so a sequence carrying
    them can be preempted; a draft model's take the blocks their keys go to, only from
    those no running sequence needs for its next token, so the step after a proposal
    preempts nobody, and under the same pressure fewer sequences draft."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [[5 + i, 6 + i, 7 + i, 8 + i, 9 + i] * 2 for i in range(3)]
    for drafter in (NgramDrafter(1, 3), ModelDrafter(perturbed_copy(model, 0.1))):
        engine = engine_for(model, tokenizer, drafter, 3, num_kv_blocks=11)
        ids = [engine.add_request(prompt, params) for prompt in prompts]
        preempted_with_drafts, aborted, drafted = 0, None, 0
        while engine.has_unfinished():
            had = {seq for seq in engine.scheduler.running if seq.draft_ids}
            drafted += len(had)
            engine.step()
            for seq in engine.last_batch.preempted:
                assert not seq.draft_ids
                preempted_with_drafts += seq in had
            last = engine.requests.get(ids[2])
            if aborted is None and last is not None and last.draft_ids:
                engine.abort(ids[2])
                aborted = last
            if aborted is not None:
                assert not aborted.draft_ids and not aborted.block_table
            check_pool(engine.block_manager, list(engine.requests.values()))
        assert engine.scheduler.num_preemptions and aborted is not None and drafted
        assert bool(preempted_with_drafts) == isinstance(drafter, NgramDrafter)
        assert engine.block_manager.num_used == 0


@pytest.mark.parametrize("kind", ["draft", "self"])
def test_a_draft_model_drafts_from_its_keys_in_the_pool_blocks(model, tokenizer, kind) -> None:
    """The draft model's keys live in the pool's blocks (a separate model's in a pool of
    its own, a self-draft's in the target's): every proposal equals the draft model's own
    greedy continuation of the request's tokens, run alone and uncached; drafting takes
    one call per draft for the whole batch, whatever its size; and a separate draft
    model's pool is counted in stats and sized with the target's."""
    drafter = make_drafter(kind, model)
    k = 3
    calls, proposals, mirrors = [], [], [0]
    engine = engine_for(model, tokenizer, drafter, k, max_num_seqs=6)
    propose, forward = engine.drafter.propose, engine.drafter.model.forward

    def counted_forward(*args, **kwargs):  # (a call outside propose: the step's mirror)
        (calls if proposing else mirrors)[-1] += 1
        return forward(*args, **kwargs)

    def recorded(seqs, ks):
        nonlocal proposing
        calls.append(0)
        proposing = True
        drafts = propose(seqs, ks)
        proposing = False
        proposals.extend(
            (list(s.all_ids), n, d.tokens) for s, n, d in zip(seqs, ks, drafts, strict=True)
        )
        return drafts

    proposing = False
    engine.drafter.propose, engine.drafter.model.forward = recorded, counted_forward
    rng = random.Random(4)
    steps = 0
    for batch in (1, 5):
        for _ in range(batch):
            prompt = [rng.randrange(512) for _ in range(rng.randrange(3, 12))]
            engine.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
            steps += 1
    assert max(calls) == k and len(proposals) > 20
    assert mirrors[0] == (steps if kind == "draft" else 0)  # one call a step, or none
    for tokens, n, drafted in proposals:
        alone = generate(drafter.model, tokens, SamplingParams(max_tokens=n), use_cache=False)
        assert drafted == alone.token_ids
    plain = engine_for(model, tokenizer, None, None, kv_cache_memory="1MiB")
    sized = engine_for(model, tokenizer, make_drafter(kind, model), k, kv_cache_memory="1MiB")
    if kind == "self":  # the target's pool holds its keys: nothing more
        assert sized.draft_pool is None
        assert dataclasses.replace(sized.stats(), speculative=None) == plain.stats()
    else:
        assert sized.stats().kv_pool_bytes == sized.pool.nbytes + sized.draft_pool.nbytes <= 2**20
        assert sized.block_manager.num_blocks < plain.block_manager.num_blocks


def test_the_engine_refuses_a_draft_model_that_cannot_read_the_targets_blocks(
    model, tokenizer
) -> None:
    short = make_test_model(0, n_layer=1, block_size=CONTEXT // 2)
    with pytest.raises(RoseError, match="draft model must reach every position"):
        engine_for(model, tokenizer, ModelDrafter(short), 2)
    windowed = make_test_model(0, n_layer=1, block_size=CONTEXT, sliding_window=8)
    with pytest.raises(RoseError, match="sliding window and sinks"):
        engine_for(model, tokenizer, ModelDrafter(windowed), 2)


def test_a_draft_model_in_another_dtype_keeps_its_keys_in_its_own(model, tokenizer) -> None:
    """A bfloat16 draft for a float32 target (and the other way round): the draft's pool is
    in the draft's dtype (the target's made the first step raise), and greedy outputs
    are the target's solo runs."""
    params = SamplingParams(max_tokens=12)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    for target_dtype, draft_dtype in (
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ):
        target = copy.deepcopy(model).to(target_dtype)
        draft = perturbed_copy(model, 0.1).to(draft_dtype)
        engine = engine_for(target, tokenizer, ModelDrafter(draft), 3)
        assert engine.draft_pool.k[0].dtype == draft_dtype
        requests = [(prompt, params) for prompt in prompts]
        runs = run_checked(engine, requests, random.Random(0))
        if target_dtype == torch.float32:  # (the float32 promise)
            for output, prompt, _ in runs.values():
                assert output.token_ids == solo(model, tokenizer, prompt, params)
        assert engine.stats().speculative.num_draft_tokens > 0
