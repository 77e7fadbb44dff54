"""Structured output: the grammar's mask keeps the oracle's promise, and holds a random
model (which alone never writes JSON) to every schema, regex and choice.

The models here have GPT-2's whole vocabulary (the library spells a forced key with
the tokenizer's own tokens); the oracle's is padded to 50,304, as GPT-2 checkpoints
trained at that size are: the 47 ids past the tokenizer must never be chosen.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import weakref
from pathlib import Path

import jsonschema
import pytest
import torch
from models import LLAMA_CHOICES, assert_clear_margins, assert_logits_close, make_test_model
from torch import nn

from benchmarks import structured as bench_structured
from roseinfer.engine import EngineConfig, LLMEngine
from roseinfer.engine.block_manager import check_pool
from roseinfer.engine.llm import LLM
from roseinfer.loops.generate import generate, generate_batch
from roseinfer.request import structured
from roseinfer.request.sampling import apply_grammar_masks
from roseinfer.request.sampling_params import InvalidParam, SamplingParams
from roseinfer.request.sequence import Sequence
from roseinfer.request.structured import (
    JSON_WHITESPACE_MAX,
    GrammarMatcher,
    StructuredOutputs,
    allowed_tokens,
    compile_grammar,
    json_closing,
)
from rosetrainer.errors import RoseError
from rosetrainer.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 50257  # GPT-2's tokens
PADDED_VOCAB = 50304  # padded to a multiple of 64
CONTEXT = 128

# Nested objects, arrays with bounds, enums, numbers with ranges, string patterns,
# optional fields.
SCHEMAS = {
    "nested object": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "name": {"type": "string", "maxLength": 6},
                },
                "required": ["id", "name"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "bounded array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    },
    "number range": {
        "type": "object",
        "properties": {
            "k": {"type": "integer", "exclusiveMinimum": 10, "maximum": 20},
            # a number's digits are unbounded: a random model writes them until its
            # object must close (GrammarMatcher.closing_token)
            "x": {"type": "number", "minimum": -1.5, "maximum": 2},
        },
        "required": ["k", "x"],
        "additionalProperties": False,
    },
    "string pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "optional fields": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 9},
            "b": {"type": "string", "maxLength": 4},
            "c": {"type": "null"},
        },
        "required": ["a"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer("gpt2")


@pytest.fixture(scope="module")
def model():
    return make_test_model(0, vocab_size=VOCAB, block_size=CONTEXT)


@pytest.fixture(scope="module")
def grouped():
    """Llama-shaped: four query heads over one key/value head."""
    return make_test_model(0, vocab_size=VOCAB, block_size=CONTEXT, n_head=4, **LLAMA_CHOICES)


@pytest.fixture(scope="module")
def padded_model():
    return make_test_model(0, vocab_size=PADDED_VOCAB, block_size=CONTEXT)


def json_params(schema: dict, **fields: object) -> SamplingParams:
    fields.setdefault("max_tokens", 64)
    return SamplingParams(structured_outputs=StructuredOutputs(json=schema), **fields)


def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    return [tokenizer.encode("Answer in JSON:"), tokenizer.encode("Hello")]


# ---------------------------------------------------------------------------
# The oracle: masked cached == masked uncached
# ---------------------------------------------------------------------------


def assert_masked_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same tokens masked (-inf) and the others within the logit tolerance."""
    masked = torch.isinf(want)
    assert torch.equal(torch.isinf(got), masked)
    assert_logits_close(got[~masked], want[~masked])


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["nested object", "number range"])
def test_the_masked_cached_run_equals_the_masked_oracle(padded_model, tokenizer, kind: str) -> None:
    """Two prompts of different lengths as one left-padded cached batch, against each
    prompt's uncached run: the same tokens, the same masked logits at every step."""
    params = json_params(SCHEMAS[kind])
    options = dict(eot_id=tokenizer.eot_id, tokenizer=tokenizer, keep_logits=True)
    oracle = generate_batch(padded_model, prompts(tokenizer), params, use_cache=False, **options)
    cached = generate_batch(padded_model, prompts(tokenizer), params, **options)
    for want, got in zip(oracle, cached, strict=True):
        # Margins among the allowed tokens (a step that allows one token is forced).
        allowed = [step[torch.isfinite(step)] for step in want.step_logits]
        assert_clear_margins([step for step in allowed if step.numel() > 1])
        assert got.token_ids == want.token_ids
        assert got.finish_reason == want.finish_reason == "stop"
        for got_step, want_step in zip(got.step_logits, want.step_logits, strict=True):
            assert_masked_logits_close(got_step, want_step)
            assert torch.isinf(want_step[tokenizer.n_vocab :]).all()  # the padding: never
        jsonschema.validate(json.loads(tokenizer.decode(want.token_ids)), SCHEMAS[kind])


def test_without_the_mask_the_random_model_writes_no_json(model, tokenizer) -> None:
    """What the suite below holds the model to is the mask's doing, not the model's."""
    result = generate(model, prompts(tokenizer)[0], SamplingParams(max_tokens=32))
    with pytest.raises(json.JSONDecodeError):
        json.loads(tokenizer.decode(result.token_ids))


# ---------------------------------------------------------------------------
# Every output valid: schemas, regexes, choices, through the engine
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(model, tokenizer) -> LLM:
    return LLM.from_model(model, tokenizer, kv_block_size=8, num_kv_blocks=200)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(SCHEMAS))
def test_every_output_is_valid_for_its_schema(llm, tokenizer, kind: str) -> None:
    """Greedy and seeded sampled runs on a random model: each output parses, validates
    and ended because the grammar was complete."""
    schema = SCHEMAS[kind]
    params = [json_params(schema)] + [
        json_params(schema, temperature=1.0, seed=seed) for seed in range(3)
    ]
    for prompt in prompts(tokenizer):
        for out in llm.generate([prompt] * len(params), params, use_tqdm=False):
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), schema)


def test_regex_and_choice_outputs_match(llm, tokenizer) -> None:
    regex = r"[0-9]{3}-[a-z]{2,5}( [A-Z][a-z]+)?"
    choices = ("yes", "no", 'a "quoted" choice\n')
    for prompt in prompts(tokenizer):
        for seed in (None, 0, 1):
            sampled = {} if seed is None else {"temperature": 1.0, "seed": seed}
            by_regex, by_choice = llm.generate(
                [prompt, prompt],
                [
                    SamplingParams(structured_outputs=StructuredOutputs(regex=regex), **sampled),
                    SamplingParams(structured_outputs=StructuredOutputs(choice=choices), **sampled),
                ],
                use_tqdm=False,
            )
            assert re.fullmatch(regex, by_regex.text), by_regex.text
            assert by_choice.text in choices and by_choice.finish_reason == "stop"


def test_a_grammar_constrains_the_output(llm, tokenizer) -> None:
    grammar = 'start: "(" pair ")"\npair: WORD "=" NUMBER\nWORD: /[a-z]{1,5}/\nNUMBER: /[0-9]{1,3}/'
    params = SamplingParams(structured_outputs=StructuredOutputs(grammar=grammar))
    (out,) = llm.generate([prompts(tokenizer)[0]], params, use_tqdm=False)
    assert re.fullmatch(r"\([a-z]{1,5}=[0-9]{1,3}\)", out.text) and out.finish_reason == "stop"


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputs(json_object=True),
        StructuredOutputs(json={}),  # any value: a number's digits need never stop
        StructuredOutputs(json={"type": "string"}),
        StructuredOutputs(json={"type": "array"}),
    ],
    ids=["json_object", "empty schema", "string", "array"],
)
@pytest.mark.slow
def test_json_closes_before_max_tokens(llm, tokenizer, spec: StructuredOutputs) -> None:
    """A random model's strings and numbers never end by themselves; the JSON is closed
    in time anyway, so it always parses (finish_reason "stop"). End-of-text, which ends a
    number, ends it even under ignore_eos (the grammar allows it only there)."""
    for max_tokens in (2, 6, 20, 48):  # ("{}" is two tokens)
        params = [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if seed is not None else 0.0,
                seed=seed,
                ignore_eos=seed == 2,
                structured_outputs=spec,
            )
            for seed in (None, 0, 1, 2)
        ]
        for prompt in prompts(tokenizer):
            for out in llm.generate([prompt] * len(params), params, use_tqdm=False):
                assert out.finish_reason == "stop" and len(out.token_ids) <= max_tokens
                value = json.loads(out.text)
                assert not spec.json_object or isinstance(value, dict), out.text


@pytest.mark.parametrize(
    ("text", "closing"),
    [
        ("", "{}"),
        ("{", "}"),
        ('{"a', '":0}'),
        ('{"a": ', "0}"),
        ('{"a":1,', '"":0}'),
        ('{"a":[1,', "0]}"),
        ('{"a":[{"b":-1.', "0}]}"),
        ('{"a":"x\\u1', '000"}'),
        ('{"a{":tr', "ue}"),
    ],
)
def test_json_closing_is_the_shortest_text_that_makes_it_whole(text: str, closing: str) -> None:
    assert json_closing(text) == closing
    json.loads(text + closing)


def test_max_tokens_cutting_a_value_is_length(llm, tokenizer) -> None:
    """A schema the closing text does not fit (its values are not numbers) is cut."""
    params = json_params(SCHEMAS["nested object"], max_tokens=4)
    (out,) = llm.generate([prompts(tokenizer)[0]], params, use_tqdm=False)
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


# ---------------------------------------------------------------------------
# The engine: constrained and free requests in one batch, preemption
# ---------------------------------------------------------------------------


def solo(model, tokenizer, prompt: list[int], params: SamplingParams) -> list[int]:
    return generate(
        model, prompt, params, use_cache=False, eot_id=tokenizer.eot_id, tokenizer=tokenizer
    ).token_ids


def mixed_workload(tokenizer: Tokenizer) -> list[tuple[list[int], SamplingParams]]:
    """Constrained (greedy and seeded) and free requests over prompts of several lengths."""
    workload = []
    for i, text in enumerate(["Answer in JSON:", "Hello", "A longer prompt, in several words"]):
        prompt = tokenizer.encode(text)
        workload += [
            (prompt, json_params(SCHEMAS["nested object"])),
            (prompt, json_params(SCHEMAS["enum"], temperature=0.9, seed=i)),
            (prompt, SamplingParams(max_tokens=20)),
            (prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=i)),
        ]
    return workload


def run_engine(engine: LLMEngine, workload) -> tuple[list[list[int]], int]:
    """Each request's tokens, and how many times a constrained request mid-output was
    preempted; the pool and every matcher checked after every step."""
    ids = [engine.add_request(prompt, params) for prompt, params in workload]
    finished, preempted = {}, 0
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        preempted += sum(
            1 for seq in engine.last_batch.preempted if seq.matcher is not None and seq.output_ids
        )
        live = list(engine.requests.values())
        check_pool(
            engine.block_manager, live, engine.runner.written_slots, engine.runner.writer_tables
        )
        for seq in live:  # a matcher's state is its output, token for token
            if seq.matcher is not None:
                assert seq.matcher.num_tokens == len(seq.output_ids)
    return [finished[i].token_ids for i in ids], preempted


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["roomy", "preempting"])
@pytest.mark.parametrize("which", ["model", "grouped"])
def test_a_mixed_batch_equals_each_requests_solo_run(request, which, tokenizer, pool: str) -> None:
    """Every request's tokens are its solo uncached run's, whether the pool holds them all
    or preempts (a preempted request keeps its output and its matcher, and recomputes
    only its cache); a grouped model's as GPT-2's."""
    model = request.getfixturevalue(which)
    blocks = {"roomy": 200, "preempting": 14}[pool]
    engine = LLMEngine(
        model,
        tokenizer,
        EngineConfig(
            kv_block_size=8,
            num_kv_blocks=blocks,
            max_num_batched_tokens=48,
            shuffle_blocks_seed=0,
            record_writes=True,
        ),
    )
    workload = mixed_workload(tokenizer)
    got, preempted = run_engine(engine, workload)
    assert (preempted > 0) == (pool == "preempting")
    for (prompt, params), tokens in zip(workload, got, strict=True):
        assert tokens == solo(model, tokenizer, prompt, params)


# ---------------------------------------------------------------------------
# The whitespace trap
# ---------------------------------------------------------------------------


def whitespace_loving(model, tokenizer: Tokenizer) -> nn.Module:
    """The model with a strong pull towards whitespace tokens (a bias on them, the one
    piece swapped): what a weak model does inside JSON, made certain."""
    whitespace = [t for t in range(tokenizer.n_vocab) if tokenizer.decode([t]).isspace()]
    head = nn.Linear(model.config.n_embd, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[whitespace] = 100.0
    biased = make_test_model(0, vocab_size=VOCAB, block_size=CONTEXT)
    biased.lm_head = head
    return biased


def test_whitespace_between_json_tokens_is_bounded(model, tokenizer, monkeypatch) -> None:
    """A model that always prefers whitespace: under the library's default (any
    whitespace) it spends all of max_tokens on it; under rose's bound it writes at
    most JSON_WHITESPACE_MAX whitespace characters in a row, and the object completes."""
    lover = whitespace_loving(model, tokenizer)
    schema = SCHEMAS["enum"]
    params = json_params(schema, max_tokens=48)
    options = dict(eot_id=tokenizer.eot_id, tokenizer=tokenizer)
    bounded = generate(lover, prompts(tokenizer)[0], params, **options)
    text = tokenizer.decode(bounded.token_ids)
    assert bounded.finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)
    assert re.search(r"\s", text)  # the model did take whitespace where it could
    assert max(map(len, re.findall(r"\s+", text))) <= JSON_WHITESPACE_MAX

    monkeypatch.setattr(structured, "JSON_OVERRIDES", {})  # the library's default
    unbounded = generate(lover, prompts(tokenizer)[0], params, **options)
    assert unbounded.finish_reason == "length"
    # after a token or two of JSON, whitespace to the end
    assert all(tokenizer.decode([t]).isspace() for t in unbounded.token_ids[-40:])


# ---------------------------------------------------------------------------
# The boundary: what is refused, and why
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
        ({"choice": []}, "non-empty strings"),
        ({"json": "{not json"}, "not JSON"),
        ({"json": [1]}, "a JSON object"),
        ({"json_object": "yes"}, "true or false"),
    ],
)
def test_a_malformed_constraint_is_refused_when_made(fields: dict, reason: str) -> None:
    with pytest.raises(InvalidParam, match=reason) as caught:
        StructuredOutputs(**fields)
    assert caught.value.param == "structured_outputs"


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (StructuredOutputs(json={"type": "frobnicate"}), "frobnicate"),
        (StructuredOutputs(json={"type": "string", "format": "no-such-format"}), "no-such"),
        (StructuredOutputs(regex="[0-9"), "unclosed character class"),
        (StructuredOutputs(grammar="start: undefined_rule"), "undefined_rule"),
    ],
)
def test_what_the_library_refuses_raises_with_its_reason(tokenizer, spec, reason: str) -> None:
    with pytest.raises(InvalidParam, match=reason):
        compile_grammar(spec, tokenizer)


@pytest.mark.slow
def test_a_compile_past_its_time_bound_is_refused_and_its_process_killed(tokenizer) -> None:
    """A schema of 10,000 optional properties compiles for seconds (11 s on the 2-core EPYC here, a minute under load). It is refused
    when its bound runs out, and the worker process it ran in is killed then: nothing of
    it runs on, holding a compile slot (it did, on a thread, to its end). A
    constraint sent meanwhile compiles in the other worker."""
    from threading import Thread

    from roseinfer.request.grammar_process import pool

    pool.warm()  # both workers started: the quick compile below waits for no start
    properties = {f"p{i}": {"type": "string"} for i in range(10_000)}
    slow = StructuredOutputs(json={"type": "object", "properties": properties})
    refused: list[BaseException] = []

    def compile_slow() -> None:
        try:
            compile_grammar(slow, tokenizer, timeout_s=3)
        except InvalidParam as err:
            refused.append(err)

    thread = Thread(target=compile_slow)
    thread.start()
    while not pool.busy and thread.is_alive():
        time.sleep(0.01)
    (worker,) = pool.busy
    compile_grammar(StructuredOutputs(regex="[a-z]{1,7}@beside"), tokenizer)
    assert thread.is_alive()  # the quick one did not wait for the slow one
    thread.join()
    assert refused and "took longer than 3 s" in str(refused[0])
    assert worker.process.returncode == -9  # killed (and reaped: no process left)
    assert worker.pid not in pool.pids


def test_a_model_without_the_tokenizers_vocabulary_is_refused(tokenizer) -> None:
    small = make_test_model(0, vocab_size=512, block_size=32)
    params = SamplingParams(structured_outputs=StructuredOutputs(json_object=True))
    with pytest.raises(RoseError, match="whole vocabulary"):
        generate(small, [1, 2], params, tokenizer=tokenizer)


def test_compiled_grammars_are_cached_and_bounded(tokenizer, monkeypatch) -> None:
    """A second request with the same constraint reuses its grammar; the cache keeps at
    most CACHE_SIZE unused ones, and never drops one a request still holds."""
    monkeypatch.setattr(structured, "CACHE_SIZE", 2)
    specs = [StructuredOutputs(regex=f"cache-{i}[0-9]") for i in range(4)]
    held = compile_grammar(specs[0], tokenizer)
    assert compile_grammar(StructuredOutputs(regex="cache-0[0-9]"), tokenizer) is held
    unused = weakref.ref(compile_grammar(specs[1], tokenizer))
    for spec in specs[2:]:
        compile_grammar(spec, tokenizer)
    # Pushed out of the LRU, and no request held it: gone (once the compiling thread has
    # let go of its result, a moment after handing it over).
    deadline = time.monotonic() + 5
    while unused() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert unused() is None
    assert compile_grammar(specs[0], tokenizer) is held  # pushed out too, but held


def test_the_matcher_rolls_back_to_an_earlier_mask(tokenizer) -> None:
    matcher = GrammarMatcher(compile_grammar(StructuredOutputs(json=SCHEMAS["enum"]), tokenizer))
    tokens = tokenizer.encode('{"color":"red","ok":true}')
    masks = []
    for token in tokens:
        masks.append(allowed_tokens([matcher], VOCAB))
        matcher.advance(token)
    assert matcher.is_finished and matcher.is_accepting
    matcher.rollback(3)
    assert not matcher.is_finished
    assert (allowed_tokens([matcher], VOCAB) == masks[-3]).all()
    with pytest.raises(RoseError, match="breaks the grammar"):
        matcher.advance(tokenizer.encode("[")[0])


@pytest.mark.slow
def test_the_benchmark_runs_in_its_quick_mode() -> None:
    """A smoke test: every table filled (no timing is asserted)."""
    command = [sys.executable, "-m", "benchmarks.structured", "--quick", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    root = str(Path(__file__).resolve().parents[2])  # where benchmarks/ is
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert [r["constraint"] for r in payload["compile"]] == list(bench_structured.SUITE)
    assert all(r["first_ms"] > 0 and r["cached_ms"] > 0 for r in payload["compile"])
    assert [r["batch_size"] for r in payload["mask"]] == [1, 16]
    assert all(r["free_step_ms"] > 0 and r["constrained_step_ms"] > 0 for r in payload["mask"])


def test_the_mask_is_the_same_written_through_numpy_or_torch(tokenizer) -> None:
    """float32 CPU logits take numpy's in-place write, others (bf16 here, a GPU's) torch's
    masked_fill: the same tokens masked, in the constrained rows only."""
    spec = StructuredOutputs(choice=("yes", "no"))
    grammar = compile_grammar(spec, tokenizer)
    seqs = [
        Sequence([1], SamplingParams(structured_outputs=spec), grammar=grammar),
        Sequence([1], SamplingParams()),
    ]
    logits = torch.randn(2, PADDED_VOCAB)
    masked = {}
    for dtype in (torch.float32, torch.bfloat16):
        masked[dtype] = logits.to(dtype)
        apply_grammar_masks(masked[dtype], seqs)
    allowed = torch.isfinite(masked[torch.float32][0]).nonzero().flatten().tolist()
    assert {tokenizer.decode([t]) for t in allowed} == {"y", "ye", "yes", "n", "no"}
    assert torch.equal(torch.isinf(masked[torch.bfloat16]), torch.isinf(masked[torch.float32]))
    assert torch.equal(masked[torch.float32][1], logits[1])  # the free row untouched
