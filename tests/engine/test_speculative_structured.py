"""Structured output under speculative decoding: drafts checked against the grammar, the
constrained greedy output still the masked oracle's, token for token.

Under a grammar, a verify step masks its row j by the grammar as it stands after the
tokens taken at rows 0 .. j - 1; a draft model drafts within the grammar (on a fork of
the matcher); drafts the grammar forbids are cut before the target scores them; the
matcher never holds a rejected draft. Held here, in the teaching loop
and in the engine, for each drafter kind and k in (1, 3, 8): every constrained greedy
request equals its uncached masked run (so the plain constrained run too), a batch of
constrained and free requests equals their solo runs on schedules hypothesis draws
(small pools that preempt, shared prompts that hit the prefix cache), the pool's
invariants and every matcher's state are checked after every step.

The model has GPT-2's whole vocabulary, as in tests/request/test_structured.py (the library
spells a forced key with the tokenizer's own tokens).
"""

from __future__ import annotations

import itertools
import json
import random
import re
from unittest import mock

import jsonschema
import numpy as np
import pytest
import torch
from engine_runs import run_checked, schedules
from hypothesis import given
from hypothesis import strategies as st
from models import assert_clear_margins, make_test_model, perturbed_copy

from roseinfer.engine import EngineConfig, LLMEngine
from roseinfer.engine.llm import LLM
from roseinfer.loops import speculative
from roseinfer.loops.generate import generate
from roseinfer.loops.speculative import speculative_generate
from roseinfer.request.rows import make_sequences
from roseinfer.request.sampling import apply_grammar_masks
from roseinfer.request.sampling_params import SamplingParams, StructuredOutputs
from roseinfer.request.structured import GrammarMatcher, allowed_tokens, grammar_for
from roseinfer.request.token_step import take_tokens
from roseinfer.speculative.drafters import (
    ModelDrafter,
    NgramDrafter,
    SpeculativeConfig,
    first_layers,
)
from roseinfer.speculative.verify import Draft, SpeculativeStats, within_grammar
from rosetrainer.errors import RoseError
from rosetrainer.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 50257
CONTEXT = 128
KV_BLOCK = 4
KINDS = ("draft", "ngram", "self")
KS = (1, 3, 8)
EACH_DRAFTER_AND_K = pytest.mark.parametrize(("kind", "k"), list(itertools.product(KINDS, KS)))

ENUM_SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}
# A number's digits never end by themselves on a random model: the object is closed
# near max_tokens (GrammarMatcher.closing_token), its forced tokens verified like any.
NUMBER_SCHEMA = {
    "type": "object",
    "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 99}, "x": {"type": "number"}},
    "required": ["k", "x"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,5}( [A-Z][a-z]{1,8})?"
CHOICES = ("the quick brown fox jumps over the lazy dog", "a stitch in time saves nine")
CONSTRAINTS = {
    "json schema": StructuredOutputs(json=ENUM_SCHEMA),
    "json number": StructuredOutputs(json=NUMBER_SCHEMA),
    "regex": StructuredOutputs(regex=REGEX),
    "choice": StructuredOutputs(choice=CHOICES),
}
# The choice's text in the prompt: prompt lookup finds drafts the grammar allows.
PROMPT_TEXT = "Say the quick brown fox jumps over the lazy dog, or a stitch in time saves nine:"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer("gpt2")


@pytest.fixture(scope="module")
def model():
    return make_test_model(0, n_layer=3, vocab_size=VOCAB, block_size=CONTEXT)


@pytest.fixture(scope="module")
def draft_model(model):
    # Agrees with the target on most tokens, not all (every draft accepted would never
    # roll anything back).
    return perturbed_copy(model, 0.1)


def make_drafter(kind: str, model, draft_model):
    if kind == "ngram":
        return NgramDrafter(1, 3)
    if kind == "self":
        return ModelDrafter(first_layers(model, 1))
    return ModelDrafter(draft_model)


def constrained(name: str, max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured_outputs=CONSTRAINTS[name])


def check_output(name: str, text: str) -> None:
    """What the constraint promises of a finished output."""
    if name.startswith("json"):
        schema = ENUM_SCHEMA if name == "json schema" else NUMBER_SCHEMA
        jsonschema.validate(json.loads(text), schema)
    elif name == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


class Oracles:
    """Each (prompt, params)'s uncached masked greedy run, made once; its margins among
    the tokens the grammar allows are checked clear (a forced step has no margin)."""

    def __init__(self, model, tokenizer: Tokenizer) -> None:
        self.model, self.tokenizer, self.runs = model, tokenizer, {}

    def __call__(
        self, prompt: list[int], params: SamplingParams, check_margins: bool = True
    ) -> list[int]:
        key = (tuple(prompt), params)
        if key not in self.runs:
            result = generate(
                self.model, prompt, params, use_cache=False, eot_id=self.tokenizer.eot_id,
                tokenizer=self.tokenizer, keep_logits=True,
            )  # fmt: skip
            allowed = [step[torch.isfinite(step)] for step in result.step_logits]
            choices = [step for step in allowed if step.numel() > 1]
            if choices and check_margins:
                assert_clear_margins(choices)
            self.runs[key] = result
        return self.runs[key].token_ids


@pytest.fixture(scope="module")
def oracle(model, tokenizer) -> Oracles:
    return Oracles(model, tokenizer)


# ---------------------------------------------------------------------------
# The teaching loop
# ---------------------------------------------------------------------------


def spec_run(model, tokenizer, drafter, prompt, params, k: int, stats=None):
    return speculative_generate(
        model, drafter, prompt, params, num_speculative_tokens=k, eot_id=tokenizer.eot_id,
        tokenizer=tokenizer, stats=stats,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.oracle
@EACH_DRAFTER_AND_K
def test_the_teaching_loop_equals_the_masked_oracle(
    model, draft_model, tokenizer, oracle, kind: str, k: int
) -> None:
    prompt = tokenizer.encode(PROMPT_TEXT)
    stats = SpeculativeStats()
    for name in CONSTRAINTS:
        params = constrained(name)
        drafter = make_drafter(kind, model, draft_model)
        got = spec_run(model, tokenizer, drafter, prompt, params, k, stats)
        assert got.token_ids == oracle(prompt, params), name
        assert got.finish_reason == "stop", name  # the grammar completed
        check_output(name, tokenizer.decode(got.token_ids))
    # Both roads were taken: drafts kept, drafts rejected (the cache rolled back).
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


class ReplayDrafter:
    """Drafts a known output: the next k tokens of `answer` after the request's output,
    then `junk` (every token past the answer, and at `junk_at` outputs' lengths)."""

    def __init__(self, answer: list[int], junk: int, junk_at: tuple[int, ...] = ()) -> None:
        self.answer, self.junk, self.junk_at = answer, junk, junk_at

    def propose(self, seqs, ks):
        drafts = []
        for seq, k in zip(seqs, ks, strict=True):
            done = len(seq.output_ids)
            tokens = [
                self.junk if done + i in self.junk_at else token
                for i, token in enumerate(self.answer[done : done + k])
            ]
            drafts.append(Draft(tokens + [self.junk] * (k - len(tokens))))
        return drafts

    def release(self, seq) -> None:
        pass


@pytest.mark.oracle
@pytest.mark.parametrize("name", ["json schema", "json number", "choice"])
def test_forbidden_drafts_are_cut_before_they_are_verified(
    model, tokenizer, oracle, name: str
) -> None:
    """A drafter that knows the answer, with junk the grammar forbids ("@": no string of
    these outputs holds one) after it and inside it: every draft the target sees is
    accepted (the junk is cut at the first forbidden token, before verification), the
    grammar completes inside an accepted run and ends the request there, nothing past
    it. Without the cut the output is the same (the mask rejects the junk) and the
    target verifies the junk too."""
    prompt = tokenizer.encode(PROMPT_TEXT)
    params = constrained(name)
    want = oracle(prompt, params)
    (junk,) = tokenizer.encode("@")
    drafter = ReplayDrafter(want, junk, junk_at=(4, 5, 11))
    stats = SpeculativeStats()
    got = spec_run(model, tokenizer, drafter, prompt, params, 8, stats)
    assert got.token_ids == want and got.finish_reason == "stop"
    assert stats.num_draft_tokens == stats.num_accepted_tokens > 0
    uncut = SpeculativeStats()
    with mock.patch.object(speculative, "within_grammar", lambda seq, draft: draft):
        again = spec_run(model, tokenizer, drafter, prompt, params, 8, uncut)
    assert again.token_ids == want
    assert uncut.num_draft_tokens > uncut.num_accepted_tokens == stats.num_accepted_tokens


def verify_masked_once(seq, logits, draft, *, max_len=None, on_token=None) -> int:
    """The wrong depth: every row masked by the grammar as it stands before the drafts
    (one mask per request per step, as for a plain decode), then greedy verification."""
    for row in range(len(logits)):
        apply_grammar_masks(logits[row : row + 1], [seq])
    for row, drafted in enumerate([*draft.tokens, None]):
        token = int(logits[row].argmax())
        take_tokens([seq], [token], on_token=on_token, max_len=max_len)
        if token != drafted or seq.is_finished:
            return row + int(token == drafted)
    raise AssertionError("unreachable: the bonus position never agrees")


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_a_mask_at_the_wrong_depth_breaks_the_grammar(model, tokenizer, oracle, name: str) -> None:
    """Drafts the target agrees with: verified with every row under the mask of the
    position before the drafts, a row past the first takes a token the grammar allowed
    there but forbids where it stands (vLLM #9423's failure); rose's verify gives the
    oracle."""
    prompt = tokenizer.encode(PROMPT_TEXT)
    params = constrained(name)
    want = oracle(prompt, params)
    (junk,) = tokenizer.encode("@")
    assert (
        spec_run(model, tokenizer, ReplayDrafter(want, junk), prompt, params, 4).token_ids == want
    )
    with (
        mock.patch.object(speculative, "verify_drafts", verify_masked_once),
        pytest.raises(RoseError, match="breaks the grammar"),
    ):
        spec_run(model, tokenizer, ReplayDrafter(want, junk), prompt, params, 4)


def test_a_draft_check_leaves_the_matcher_where_it_was(model, tokenizer) -> None:
    """allowed_prefix looks ahead and comes back: the same tokens, the same mask, the
    closing plan kept."""
    params = constrained("json schema")
    (seq,) = make_sequences(model, [[1, 2]], params, None, None, tokenizer)
    matcher = seq.matcher
    text = tokenizer.encode('{"color":"red","ok":true}')
    for token in text[:3]:
        matcher.advance(token)
    before = allowed_tokens([matcher], VOCAB)
    (junk,) = tokenizer.encode("@")
    assert matcher.allowed_prefix(text[3:] + [junk]) == len(text) - 3  # stops at the end
    assert matcher.allowed_prefix(text[3:5] + [junk] + text[5:]) == 2  # at the junk
    assert matcher.allowed_prefix([junk]) == 0
    assert matcher.tokens == text[:3] and not matcher.is_finished
    assert np.array_equal(allowed_tokens([matcher], VOCAB), before)
    matcher.closing = [text[3]]  # a plan under way is not forgotten by a look-ahead
    matcher.allowed_prefix(text[3:])
    assert matcher.closing == [text[3]]


def test_a_sampled_draft_keeps_its_first_forbidden_token(model, tokenizer) -> None:
    """A deterministic draft is cut before the first forbidden token; one drawn from q
    keeps it (the accept rule rejects it and draws from the residual: cutting it would
    bias the output towards q) and drops what follows."""
    (seq,) = make_sequences(model, [[1, 2]], constrained("json schema"), None, None, tokenizer)
    good = tokenizer.encode('{"color"')
    (junk,) = tokenizer.encode("@")
    tokens = [*good, junk, *good]
    assert within_grammar(seq, Draft(tokens)).tokens == good
    q = torch.full((len(tokens), VOCAB), 1 / VOCAB)
    sampled = within_grammar(seq, Draft(tokens, q))
    assert sampled.tokens == [*good, junk] and torch.equal(sampled.probs, q[: len(good) + 1])
    assert within_grammar(seq, Draft(good, q[: len(good)])).tokens == good


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_sampled_constrained_drafts_keep_the_grammar(
    model, draft_model, tokenizer, kind: str
) -> None:
    """The sampled accept rule draws from the masked distribution: every output a seeded
    sampled request makes with drafts holds to its constraint."""
    prompt = tokenizer.encode(PROMPT_TEXT)
    for name in CONSTRAINTS:
        for seed in (0, 1):
            params = SamplingParams(
                max_tokens=40, temperature=1.0, seed=seed, structured_outputs=CONSTRAINTS[name]
            )
            drafter = make_drafter(kind, model, draft_model)
            got = spec_run(model, tokenizer, drafter, prompt, params, 3)
            assert got.finish_reason == "stop", name
            check_output(name, tokenizer.decode(got.token_ids))


# ---------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------


# The engine's prompts: the choice's text, and its first words followed by others (they
# share its first blocks: prefix-cache hits), one repeating itself (prompt lookup).
ENGINE_PROMPTS = (
    PROMPT_TEXT,
    "Say the quick brown fox, in JSON:",
    "Say the quick brown fox jumps, and jumps, and jumps again",
    "Hello",
)


def mixed_requests(tokenizer: Tokenizer, rng: random.Random, n: int):
    """Constrained greedy requests of every kind beside free greedy and seeded ones, over
    a few prompts (their oracles are made once, margins checked, whatever is drawn)."""
    requests = []
    for i in range(n):
        prompt = tokenizer.encode(rng.choice(ENGINE_PROMPTS))
        if i % 3 == 2:
            seeded = rng.random() < 0.3
            params = SamplingParams(
                max_tokens=rng.choice((6, 20)),
                temperature=1.0 if seeded else 0.0,
                seed=rng.randrange(2) if seeded else None,
            )
        else:
            params = constrained(rng.choice(list(CONSTRAINTS)), max_tokens=rng.choice((12, 40)))
        requests.append((prompt, params))
    return requests


def matcher_check(seq) -> None:
    """A constrained request's matcher state is its output's, token for token: never a
    draft beyond it (its next mask is that of a fresh matcher fed the output)."""
    if seq.matcher is None:
        return
    assert seq.matcher.tokens == seq.output_ids
    fresh = GrammarMatcher(seq.grammar)
    for token in seq.output_ids:
        fresh.advance(token)
    assert np.array_equal(allowed_tokens([seq.matcher], VOCAB), allowed_tokens([fresh], VOCAB))


def assert_solo(model, tokenizer, oracle: Oracles, outputs: dict, check_margins=True) -> None:
    """Each greedy request is its uncached (masked) run; a seeded one, which decodes
    without drafts, its own seeded run."""
    for output, prompt, params in outputs.values():
        if params.greedy:
            assert output.token_ids == oracle(prompt, params, check_margins)
        else:
            want = generate(model, prompt, params, eot_id=tokenizer.eot_id).token_ids
            assert output.token_ids == want
        if params.structured_outputs is not None and output.finish_reason == "stop":
            name = next(n for n, c in CONSTRAINTS.items() if c == params.structured_outputs)
            check_output(name, output.text)


@pytest.mark.slow
@pytest.mark.oracle
@EACH_DRAFTER_AND_K
def test_llm_generate_mixed_batch_equals_solo_runs(
    model, draft_model, tokenizer, oracle, kind: str, k: int
) -> None:
    """LLM.generate, every constraint and free requests in one batch, with drafts: each
    equals its solo run; the grammars completed ("stop")."""
    spec = {
        "draft": SpeculativeConfig(k, "draft", model="(in memory)"),
        "ngram": SpeculativeConfig(k, "ngram", ngram_min=1, ngram_max=3),
        "self": SpeculativeConfig(k, "self", self_layers=1),
    }[kind]
    draft = draft_model if kind == "draft" else None
    llm = LLM.from_model(model, tokenizer, spec, draft, kv_block_size=KV_BLOCK, num_kv_blocks=120)
    prompt = tokenizer.encode(PROMPT_TEXT)
    free = [3, 1, 4, 1, 5, 9, 2, 6] * 2
    requests = [(prompt, constrained(name)) for name in CONSTRAINTS]
    requests += [(free, SamplingParams(max_tokens=20)), (prompt, SamplingParams(max_tokens=12))]
    outputs = llm.generate([p for p, _ in requests], [q for _, q in requests], use_tqdm=False)
    for output, (prompt_ids, params) in zip(outputs, requests, strict=True):
        assert output.token_ids == oracle(prompt_ids, params)
    for output, name in zip(outputs, CONSTRAINTS, strict=False):
        assert output.finish_reason == "stop"
        check_output(name, output.text)
    stats = llm.engine.stats().speculative
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


@pytest.mark.oracle
@schedules(8)
@given(
    seed=st.integers(0, 10_000),
    kind=st.sampled_from(KINDS),
    k=st.sampled_from(KS),
    budget=st.sampled_from([3, 9, 24, 256]),
    num_blocks=st.integers(16, 32),
    max_num_seqs=st.integers(1, 5),
)
@pytest.mark.slow
def test_random_schedules_equal_solo_runs(
    model, draft_model, tokenizer, oracle, seed, kind, k, budget, num_blocks, max_num_seqs
) -> None:
    """Arrivals between steps, budgets that cut verify chunks short, pools small enough
    to preempt a constrained request mid-output; then a second wave continuing the first
    wave's greedy outputs, served from the prefix cache."""
    rng = random.Random(seed)
    config = EngineConfig(
        kv_block_size=KV_BLOCK, num_kv_blocks=num_blocks, max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs, shuffle_blocks_seed=seed, record_writes=True,
    )  # fmt: skip
    engine = LLMEngine(model, tokenizer, config, make_drafter(kind, model, draft_model), k)
    first = run_checked(engine, mixed_requests(tokenizer, rng, 8), rng, matcher_check)
    assert_solo(model, tokenizer, oracle, first)
    hits_before = engine.block_manager.prefix_cache_hits
    continued = [
        (prompt + output.token_ids, SamplingParams(max_tokens=6))
        for output, prompt, params in first.values()
        if params.greedy and output.token_ids
    ]
    second = run_checked(engine, continued, rng, matcher_check)
    # (prompts made by the first wave: their margins are whatever they are; the point
    # here is the prefix cache, which a block holding a rejected draft would break)
    assert_solo(model, tokenizer, oracle, second, check_margins=False)
    if len(continued) > 1:
        assert engine.block_manager.prefix_cache_hits > hits_before


@pytest.mark.slow
@pytest.mark.oracle
def test_a_preempted_constrained_request_with_drafts_equals_its_solo_run(
    model, tokenizer, oracle
) -> None:
    """Four JSON requests that each grow to 40 tokens, with drafts (self-draft), in a pool
    that holds fewer: some are preempted mid-output (their matchers keep their output,
    only the cache is recomputed), all equal their solo runs."""
    config = EngineConfig(
        kv_block_size=KV_BLOCK,
        num_kv_blocks=24,
        max_num_batched_tokens=64,
        shuffle_blocks_seed=0,
        record_writes=True,
    )
    engine = LLMEngine(model, tokenizer, config, ModelDrafter(first_layers(model, 1)), 3)
    requests = [
        (tokenizer.encode(text), constrained("json number", max_tokens=40))
        for text in ENGINE_PROMPTS
    ]
    outputs = run_checked(engine, requests, random.Random(0), matcher_check)
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats().speculative.num_accepted_tokens > 0
    assert_solo(model, tokenizer, oracle, outputs)


def test_a_failed_look_ahead_fails_its_request_alone(model, tokenizer, oracle) -> None:
    """The library failing to roll a look-ahead back (its matcher left in error): that
    request ends as "abort" with the matcher's error, the others in the batch finish with
    their solo tokens."""
    real = GrammarMatcher.allowed_prefix
    victim = constrained("choice")

    def failing(self, tokens):
        if self.grammar.text != compiled_choice.text:
            return real(self, tokens)
        self.matcher.consume_token(tokenizer.encode("@")[0])  # (puts it in error)
        raise RoseError("cannot roll back 1 looked-ahead tokens")

    compiled_choice = grammar_for(victim.structured_outputs, tokenizer, VOCAB)
    config = EngineConfig(kv_block_size=KV_BLOCK, num_kv_blocks=120, record_writes=True)
    engine = LLMEngine(model, tokenizer, config, ModelDrafter(first_layers(model, 1)), 3)
    prompt = tokenizer.encode(PROMPT_TEXT)
    others = [(prompt, constrained("regex")), (prompt, SamplingParams(max_tokens=12))]
    with mock.patch.object(GrammarMatcher, "allowed_prefix", failing):
        outputs = run_checked(engine, [(prompt, victim), *others], random.Random(0))
    (failed, *fine) = outputs.values()
    assert failed[0].finish_reason == "abort" and "grammar matcher failed" in failed[0].error
    assert_solo(model, tokenizer, oracle, dict(enumerate(fine)))
