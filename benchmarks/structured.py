"""python -m benchmarks.structured: what structured output costs.

Two tables, measured in one process:

1. Compiling: for each constraint of a small suite (JSON schemas, any JSON object, a
   regex, a choice), the first compile (the cache emptied first) and a cached one
   (the median of --rounds each), in ms.
2. The mask in the engine's decode step: B requests (for each B in --batch-sizes)
   run through the engine free, then held to a JSON object, interleaved round by
   round. A JSON object on a random model writes strings until max_tokens closes it,
   so every step of both runs decodes B rows (its last 64 steps also look for the text
   that closes the object, part of what JSON costs). Printed: the median decode step of each,
   the difference (the mask: filling it for the batch, applying it to the logits,
   advancing each matcher), per step and per token, and as a fraction of the free
   step. The target is at most 5% of a decode step at B = 16.

    python -m benchmarks.structured            # random GPT-2 124M weights
    python -m benchmarks.structured --quick    # a tiny model (a smoke test)

Run it alone on the machine: the figures are times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from rosecourse.demo import wide_random_init
from roseinfer.engine.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine, RequestOutputKind
from roseinfer.request import structured
from roseinfer.request.sampling_params import SamplingParams, StructuredOutputs
from rosetrainer.config import GPTConfig
from rosetrainer.errors import ArgumentParser, run_cli
from rosetrainer.model import GPT
from rosetrainer.tokenizer import Tokenizer

QUICK_CONFIG = GPTConfig(vocab_size=50257, block_size=64, n_layer=2, n_head=2, n_embd=32)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 5},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 10,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "price": {"type": "number", "exclusiveMinimum": 0},
                },
                "required": ["sku", "quantity", "price"],
            },
        },
        "shipping": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/address"}]},
    },
    "required": ["id", "items"],
    "$defs": {
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "country": {"enum": ["DE", "FR", "US"]}},
        }
    },
}
SUITE = {
    "schema: person": StructuredOutputs(json=PERSON),
    "schema: order ($ref, anyOf)": StructuredOutputs(json=ORDER),
    "json_object": StructuredOutputs(json_object=True),
    "regex: date": StructuredOutputs(regex=r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"),
    "choice: 3 strings": StructuredOutputs(choice=("positive", "negative", "neutral")),
}


@dataclass
class CompileResult:
    constraint: str
    first_ms: float
    cached_ms: float


@dataclass
class MaskResult:
    batch_size: int
    free_step_ms: float  # the median decode step, no constraint
    constrained_step_ms: float  # the same requests held to a JSON object
    mask_ms_per_step: float  # the difference
    mask_us_per_token: float
    fraction_of_step: float


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="benchmarks.structured", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny model, few steps (a smoke test)")
    p.add_argument("--batch-sizes", default="1,16", help="comma-separated; default: 1,16")
    p.add_argument("--new-tokens", type=int, help="per request (default: 128; quick: 8)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default: 3; quick: 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.new_tokens = args.new_tokens or (8 if args.quick else 128)
    args.rounds = args.rounds or (1 if args.quick else 3)
    return args


def compile_times(tokenizer: Tokenizer, rounds: int) -> list[CompileResult]:
    structured.ll_tokenizer(tokenizer.name)  # built once per tokenizer, outside the timing
    results = []
    for name, spec in SUITE.items():
        first, cached = [], []
        for _ in range(rounds):
            structured.clear_cache()
            started = time.perf_counter()
            grammar = structured.compile_grammar(spec, tokenizer)
            first.append(time.perf_counter() - started)
            started = time.perf_counter()
            structured.compile_grammar(spec, tokenizer)
            cached.append(time.perf_counter() - started)
            del grammar
        results.append(
            CompileResult(name, statistics.median(first) * 1e3, statistics.median(cached) * 1e3)
        )
    return results


def decode_steps(
    model: GPT, tokenizer: Tokenizer, batch_size: int, params: SamplingParams
) -> list[float]:
    """The engine's decode steps (seconds) while `batch_size` requests run together."""
    engine = LLMEngine(model, tokenizer, EngineConfig(kv_block_size=16, max_num_seqs=batch_size))
    prompts = [tokenizer.encode(f"Request {i} asks for JSON:") for i in range(batch_size)]
    for prompt in prompts:  # (DELTA outputs, as rose-serve's)
        engine.add_request(prompt, params, output_kind=RequestOutputKind.DELTA)
    steps = []
    with torch.inference_mode():
        while engine.has_unfinished():
            started = time.perf_counter()
            engine.step()
            if len(engine.last_batch.seqs) == batch_size == engine.last_batch.num_tokens:
                steps.append(time.perf_counter() - started)  # every row decodes one token
    return steps


def mask_costs(model: GPT, tokenizer: Tokenizer, args: argparse.Namespace) -> list[MaskResult]:
    free = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    held = SamplingParams(
        max_tokens=args.new_tokens, structured_outputs=StructuredOutputs(json_object=True)
    )
    decode_steps(model, tokenizer, 1, held)  # first calls pay one-off costs
    results = []
    for batch_size in args.batch_sizes:
        free_steps: list[float] = []
        held_steps: list[float] = []
        for _ in range(args.rounds):
            free_steps += decode_steps(model, tokenizer, batch_size, free)
            held_steps += decode_steps(model, tokenizer, batch_size, held)
        free_ms = statistics.median(free_steps) * 1e3
        held_ms = statistics.median(held_steps) * 1e3
        mask_ms = held_ms - free_ms
        results.append(
            MaskResult(
                batch_size, free_ms, held_ms, mask_ms, mask_ms * 1e3 / batch_size, mask_ms / free_ms
            )
        )
    return results


def bench(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = QUICK_CONFIG if args.quick else GPTConfig.from_preset("gpt2")
    model = wide_random_init(GPT(config), 0).eval()
    tokenizer = Tokenizer("gpt2")
    compiled = compile_times(tokenizer, args.rounds)
    masks = mask_costs(model, tokenizer, args)
    if args.json:
        payload = {
            "args": vars(args),
            "compile": [asdict(r) for r in compiled],
            "mask": [asdict(r) for r in masks],
        }
        print(json.dumps(payload))
        return 0
    where = f"the CPU, {torch.get_num_threads()} threads"
    print(f"model: {'tiny' if args.quick else 'gpt2 124M'} random weights, float32, on {where}")
    print(f"\ncompiling over GPT-2's {tokenizer.n_vocab:,} tokens (median of {args.rounds}):")
    print(f"{'constraint':<30}{'first':>12}{'cached':>12}")
    for r in compiled:
        print(f"{r.constraint:<30}{r.first_ms:>9.2f} ms{r.cached_ms:>9.3f} ms")
    print(f"\nthe mask in a decode step ({args.new_tokens} tokens per request, json_object):")
    print(f"{'batch':>5}{'free step':>13}{'held step':>13}{'mask/step':>13}{'mask/token':>14}{'of step':>9}")  # fmt: skip
    for r in masks:
        print(
            f"{r.batch_size:>5}{r.free_step_ms:>10.2f} ms{r.constrained_step_ms:>10.2f} ms"
            f"{r.mask_ms_per_step:>10.3f} ms{r.mask_us_per_token:>11.1f} us"
            f"{r.fraction_of_step:>9.1%}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: bench(argv), "benchmarks.structured")


if __name__ == "__main__":
    sys.exit(main())
