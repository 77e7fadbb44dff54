"""The reference solutions that copy rose's own code agree with it, on inputs drawn at random.

A chapter's reference (rosecourse/exercises/chNN_name/reference.py) is rose's own piece
wherever rose has it as a function of the same signature: it delegates to it, and cannot
drift. Where the exercise's piece is a part of a method of rose's (chapter 06's write into
the static cache, 13's prefix lookup, 15's exported positions and mask, 16's stage, 17's
quantizer), the reference is that part written out for the learner to read, and a copy
drifts: rose's piece grows (a sliding window, rotary positions) while the copy, whose check
never meets the new case, still passes (chapter 16's stage once had no rotary positions).
So each such copy runs here beside rose's piece on what hypothesis draws, and must do what
it does: the same outputs, and for the prefix lookup the pool's own answer at every step of
an engine.

The builds are held to rose's pieces by their own checks, which tests/course/test_builds.py runs
on each reference: the model beside rose's GPT, the training step beside rose's trainer,
the block manager inside rose's engine beside rose's BlockManager. The verify build's
sampled rule and the block manager's key are rose's own (their references delegate).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import make_test_model

from rosecourse.exercises.ch06_static_update import reference as ch06_static_update
from rosecourse.exercises.ch13_cached_prefix import reference as ch13_cached_prefix
from rosecourse.exercises.ch15_export_prepare import reference as ch15_export_prepare
from rosecourse.exercises.ch16_stage_forward import reference as ch16_stage_forward
from rosecourse.exercises.ch17_quantize import reference as ch17_quantize
from roseinfer.cache import quantized
from roseinfer.cache.dense import ConcatKVCache, StaticLayerCache
from roseinfer.cache.export import ExportCache
from roseinfer.engine import EngineConfig, LLMEngine
from roseinfer.pipeline.stage import PipelineStage
from roseinfer.request.sampling_params import SamplingParams
from rosetrainer import model as gpt
from rosetrainer.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Cheap functions: many draws, the same ones every run.
MANY = settings(max_examples=60, deadline=None, derandomize=True)
# An engine to the end: a few schedules, the same ones every run.
SCHEDULES = settings(
    max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


def same_tensor(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def seeded(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------
# Chapter 13: the prefix cache's lookup, in an engine's pool
# ---------------------------------------------------------------------------

KV_BLOCK = 4
VOCAB = 128


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer("gpt2")


@pytest.fixture(scope="module")
def models() -> dict[str, object]:
    """A model of learned positions, and a rotary one with a sliding window and sinks (its
    pool gives back the blocks behind the window: BlockManager.drop_out_of_window)."""
    small = dict(n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB)
    return {
        "learned": make_test_model(0, block_size=64, **small),
        "windowed": make_test_model(
            0, block_size=32, position_embedding="rotary", sliding_window=9, attention_sinks=2,
            **small,
        ),
    }  # fmt: skip


def workload(rng: random.Random) -> list[tuple[list[int], SamplingParams]]:
    """Prompts that share a prefix, repeat a piece or come again whole, each asking for a
    few to many tokens."""
    shared = [rng.randrange(VOCAB) for _ in range(3 * KV_BLOCK)]
    arrivals: list[tuple[list[int], SamplingParams]] = []
    for _ in range(rng.randrange(3, 9)):
        if arrivals and rng.random() < 0.2:
            prompt = list(rng.choice(arrivals)[0])
        else:
            piece = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))]
            prompt = shared[: KV_BLOCK * rng.randrange(4)] + piece * rng.randrange(1, 4)
        arrivals.append((prompt, SamplingParams(max_tokens=rng.randrange(1, 24))))
    return arrivals


def drive(engine: LLMEngine, rng: random.Random) -> int:
    """Step an engine to the end with arrivals and aborts before every step (`rng` decides
    them); fail at the first step where chapter 13's lookup differs from the pool's for a
    live request's tokens. Returns how many steps it ran."""
    pending = workload(rng)
    for step in range(400):
        while pending and rng.random() < 0.5:
            prompt, params = pending.pop(0)
            engine.add_request(list(prompt), params, request_id=f"r{len(pending)}")
        if engine.requests and rng.random() < 0.03:  # now and then a request is aborted
            engine.abort(rng.choice(sorted(engine.requests)))
        if not (pending or engine.has_unfinished()):
            return step
        engine.step()
        manager = engine.block_manager
        for seq in engine.requests.values():
            found = ch13_cached_prefix.cached_prefix(manager, seq.all_ids)
            assert found == manager.cached_prefix(seq.all_ids), f"step {step}, {seq.request_id}"
    raise AssertionError("the engine made no progress in 400 steps")


@SCHEDULES
@given(
    seed=st.integers(0, 10_000),
    kind=st.sampled_from(["learned", "windowed"]),
    budget=st.sampled_from([3, 7, 16, 64]),
    num_blocks=st.integers(16, 40),
    max_num_seqs=st.integers(1, 5),
)
def test_cached_prefix_finds_what_the_pool_finds(
    models, tokenizer, seed, kind, budget, num_blocks, max_num_seqs
) -> None:
    """Chapter 13's solution beside the pool's own lookup, at every step of an engine with
    prefix caching: the same blocks for every live request's tokens."""
    settings = EngineConfig(
        kv_block_size=KV_BLOCK, num_kv_blocks=num_blocks, max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs, enable_prefix_caching=True,
    )  # fmt: skip
    drive(LLMEngine(models[kind], tokenizer, settings), random.Random(seed))


# ---------------------------------------------------------------------------
# The chapters' functions, beside rose's
# ---------------------------------------------------------------------------


@MANY
@given(seed=st.integers(0, 99), max_len=st.integers(1, 9), data=st.data())
def test_static_update(seed, max_len, data) -> None:
    slots = data.draw(
        st.lists(st.integers(0, max_len - 1), min_size=1, max_size=max_len, unique=True)
    )
    input_pos = torch.tensor(slots)
    k_new, v_new = seeded(seed, 2, 2, len(slots), 3), seeded(seed + 1, 2, 2, len(slots), 3)
    ours = [seeded(seed + 2, 2, 2, max_len, 3), seeded(seed + 3, 2, 2, max_len, 3)]
    theirs = StaticLayerCache(ours[0].clone(), ours[1].clone())
    got = ch06_static_update.static_update(*ours, input_pos, k_new, v_new)
    want = theirs.update(input_pos, k_new, v_new)
    for mine, rose, buffer in zip(got, want, (theirs.k, theirs.v), strict=True):
        assert same_tensor(mine, rose) and same_tensor(mine, buffer)  # the buffers, in place
    assert same_tensor(ours[0], theirs.k) and same_tensor(ours[1], theirs.v)


@MANY
@given(
    seed=st.integers(0, 99),
    batch=st.integers(1, 3),
    past=st.integers(0, 4),
    q_len=st.integers(1, 3),
    data=st.data(),
)
def test_export_prepare(seed, batch, past, q_len, data) -> None:
    pads = data.draw(st.lists(st.integers(0, past), min_size=batch, max_size=batch))
    attention_mask = torch.tensor([[0] * pad + [1] * (past + q_len - pad) for pad in pads])
    positions = gpt.padded_position_ids(attention_mask)[:, past:]
    cache = ExportCache([], attention_mask, positions)
    got = ch15_export_prepare.export_prepare(cache, batch, q_len, torch.device("cpu"))
    for mine, rose in zip(got, cache.prepare(batch, q_len, torch.device("cpu")), strict=True):
        assert same_tensor(mine, rose)


@pytest.mark.parametrize("kind", ["learned", "windowed"])
def test_stage_forward(kind) -> None:
    """Every stage of a split into 1, 2 and 3 stages, on a batch with a left-padded row,
    three calls on one cache per stage: rotary positions too (a block takes their angles)."""
    model = make_test_model(
        0, n_layer=3, n_head=2, n_embd=16, vocab_size=VOCAB, block_size=32,
        **({"position_embedding": "rotary", "sliding_window": 5} if kind == "windowed" else {}),
    )  # fmt: skip
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    for n_stages in (1, 2, 3):
        stages = [PipelineStage(model, s, n_stages) for s in range(n_stages)]
        caches = {who: [ConcatKVCache() for _ in stages] for who in ("ours", "theirs")}
        for cache in (*caches["ours"], *caches["theirs"]):
            cache.reset(torch.tensor([0, 2]))
        with torch.inference_mode():
            for chunk in (ids[:, :5], ids[:, 5:8], ids[:, 8:]):
                x_ours = x_theirs = chunk
                for stage, mine, rose in zip(stages, caches["ours"], caches["theirs"], strict=True):
                    x_ours = ch16_stage_forward.stage_forward(stage, x_ours, mine)
                    x_theirs = PipelineStage.forward(stage, x_theirs, rose)
                    assert same_tensor(x_ours, x_theirs), (n_stages, stage.layers)


@MANY
@given(
    seed=st.integers(0, 999),
    bits=st.sampled_from([2, 4, 8]),
    group_size=st.sampled_from([1, 2, 4]),
    dim=st.sampled_from([2, 3]),
    equal=st.booleans(),
)
def test_quantize(seed, bits, group_size, dim, equal) -> None:
    x = seeded(seed, 2, 2, 4, 8) * 10
    if equal:  # groups of equal numbers: scale 0
        x = x.round().clamp(0, 0)
    got = ch17_quantize.quantize(x, bits, group_size, dim)
    want = quantized.quantize(x, bits, group_size, dim)
    for mine, rose in zip(got, want, strict=True):
        assert same_tensor(mine, rose)
