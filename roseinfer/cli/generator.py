"""What rose-generate runs, built from its parsed flags: one factory for every path.

`build_generator(args, say)` checks the flags against each other (before anything slow
happens), reads and encodes the prompts, loads the model, says what it chose through
`say(what, value)`, and returns a `Generator` for the path the flags pick:

* the engine (several prompts, or speculative decoding; roseinfer/engine): one batch of
  every prompt, each result told as it finishes;
* the teaching loop on a cache (--cache static|concat|rolling|offloaded, --compile; the
  uncached oracle with --no-kv-cache) or the exported graph in onnxruntime (--onnx): the
  prompts in left-padded batches of --batch-size;
* a split model (--pipeline-parallel-size): the same batches through the pipeline,
  printed by stage 0's process (the CLI starts the stages, or is one under torchrun).

`generator.run(print_batch)` generates every prompt in prompt order, handing each batch
to `print_batch` (the CLI's printing, roseinfer/cli/generate.py) as a `Batch`.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from roseinfer.cache.dense import CACHE_KINDS, ConcatKVCache, StaticKVCache
from roseinfer.cache.offloaded import OffloadedKVCache
from roseinfer.cache.quantized import check_quant_settings, make_kv_cache
from roseinfer.cache.rolling import RollingKVCache
from roseinfer.cli.engine_flags import (
    check_quantization_flags,
    engine_config,
    engine_from_flags,
    kv_cache_group_size,
    kv_cache_window,
    speculative_config,
)
from roseinfer.engine.llm_engine import LLMEngine, RequestOutput, RequestOutputKind
from roseinfer.engine.packed import can_pack, packed_linears
from roseinfer.loading import load_model_and_tokenizer, model_config_and_tokenizer
from roseinfer.loops import onnx_generate
from roseinfer.loops.generate import GenerationResult, generate_batch
from roseinfer.loops.onnx_generate import OnnxModel
from roseinfer.pipeline.launch import PipelineSetup, run_pipeline, stage_main, torchrun_rank
from roseinfer.pipeline.runner import Driver
from roseinfer.pipeline.stage import stage_layers
from roseinfer.request.sampling import SamplingParams
from roseinfer.request.sampling_params import InvalidParam, StructuredOutputs
from roseinfer.request.structured import grammar_for
from roseinfer.speculative.drafters import SAMPLED_NOT_DRAFTED
from roseinfer.speculative.verify import SpeculativeStats
from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError, not_a_file, os_cause
from rosetrainer.model import GPT
from rosetrainer.runtime import pick_device, pick_dtype
from rosetrainer.threads import Threads
from rosetrainer.tokenizer import Tokenizer

STDIN_NAMES = ("-", "/dev/stdin")  # --prompt-file names that read standard input
DEFAULT_BATCH_SIZE = 32
# The longest --json-schema or --grammar file read (the server takes a whole request
# body of 1 MiB by default).
MAX_CONSTRAINT_BYTES = 16 << 20

Say = Callable[[str, object], None]  # one status line: what, value
OnDone = Callable[[int, GenerationResult], None]  # a prompt's index in its batch, its result


@dataclass
class Batch:
    """Prompts generated together. `generate(on_token=None, on_done=None)` returns their
    results in prompt order; on_token(row, token) hears each new token as it is made
    (where `streams`), on_done(index, result) each result once it is ready. `summary`
    gives the status lines after the batch's results (its throughput); `tokenizer`
    decodes the tokens."""

    prompts: list[str]
    generate: Callable[..., list[GenerationResult]]
    streams: bool
    summary: Callable[[list[GenerationResult], float], list[tuple[str, object]]]
    tokenizer: Tokenizer


PrintBatch = Callable[[Batch], None]


class Generator:
    """The prompts, their ids and sampling, the tokenizer; `run` generates every prompt."""

    def __init__(
        self,
        prompts: list[str],
        prompt_ids: list[list[int]],
        params: SamplingParams,
        tokenizer: Tokenizer,
    ) -> None:
        self.prompts, self.prompt_ids = prompts, prompt_ids
        self.params, self.tokenizer = params, tokenizer

    def run(self, print_batch: PrintBatch) -> None:
        raise NotImplementedError


def build_generator(args: argparse.Namespace, say: Say) -> Generator:
    """The generator the parsed flags ask for, checked, loaded and told (see the module)."""
    params = sampling_params(args)
    if args.batch_size is not None and args.batch_size < 1:
        raise RoseError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.pipeline_parallel_size != 1 or args.micro_batches is not None:
        return split_generator(args, params, say)
    prompts, blank_lines = read_prompts(args)
    if args.onnx:
        model, tokenizer = load_onnx(args)
        prompt_ids = encode_prompts(prompts, tokenizer, model.meta.block_size)
        say("device", "cpu (onnxruntime)")
        say("dtype", args.dtype)
        say("model", f"{args.onnx} (ONNX, exported from {model.meta.source})")
        say("tokenizer", tokenizer.name)
        say("kv cache", "past_key_values in and present out of the graph")
        generator = LoopGenerator(prompts, prompt_ids, params, tokenizer, model, args, say)
    else:
        generator = torch_generator(args, params, prompts, say)
    if args.compile:
        # Compiling happens inside the first decode step, so tokens/s includes it.
        how_long = "a minute or two" if args.compile == "max-autotune" else "seconds"
        say("compiled decode", f"{args.compile} (the first step compiles: {how_long})")
    report_seed_and_prompts(args, generator.params, blank_lines, say)
    return generator


def torch_generator(
    args: argparse.Namespace, params: SamplingParams, prompts: list[str], say: Say
) -> Generator:
    """The engine, or the teaching loop on the cache the flags name, on a PyTorch model."""
    # The engine's flags are checked even when one prompt runs on another path: a bad
    # value is told, never silently unused.
    engine_settings = engine_config(args)
    if not uses_engine(args, len(prompts)):
        engine_settings = None
    if engine_settings is not None and args.batch_size is not None:
        raise RoseError(
            "--batch-size sizes the left-padded batches of --no-kv-cache, --cache, "
            "--compile and --onnx: the engine (several prompts) takes --max-num-seqs"
        )
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    # Compiled code keeps the thread count it was built for: chosen once, at the start.
    threads = Threads(args.num_threads, follow_load=not args.compile)
    model, tokenizer, source = load_model_and_tokenizer(
        args.checkpoint_path, args.hf_model, args.tokenizer_name, device, dtype
    )
    prompt_ids = encode_prompts(prompts, tokenizer, model.config.block_size)
    # An invalid constraint is told now, in one line (the loops reuse the compile).
    grammar_for(params.structured_outputs, tokenizer, model.config.vocab_size)
    kind = cache_kind(args, model.config)
    check_quant_settings(
        model.config,
        args.kv_cache_dtype,
        kv_cache_group_size(args),
        kv_cache_window(args),
        "channel",
    )
    engine = None
    if engine_settings is not None:
        engine = engine_from_flags(model, tokenizer, args)  # (it packs its own)
    # A cached decode multiplies a few rows by every weight: on a CPU, by weights packed
    # once for oneDNN, as the engine does (roseinfer.engine.packed).
    packing = not (args.no_kv_cache or args.compile or args.no_pack_weights)
    if engine is None and packing and can_pack(model):
        model = packed_linears(model, args.batch_size or len(prompts))
        say("weights", "linear layers packed for oneDNN (--no-pack-weights: as stored)")
    say("device", device)
    if device.type == "cpu":
        say("threads", threads.describe())
    say("dtype", args.dtype)
    say("model", f"{source} ({model.num_params(non_embedding=False):,} params)")
    say("tokenizer", tokenizer.name)
    if args.no_kv_cache:
        say("kv cache", "off (uncached reference)")
    elif engine is not None:
        say("kv cache", "paged (engine)")
        spec = speculative_config(args)
        if spec is not None and params.greedy:
            say("speculative decoding", spec.describe())
        elif spec is not None:  # the engine's documented limit, told (never a nan)
            say(
                "speculative decoding",
                f"off: --temperature {args.temperature} samples, and {SAMPLED_NOT_DRAFTED}",
            )
    else:
        say("kv cache", kind)
    if args.kv_cache_dtype != "auto":
        say(
            "kv cache dtype",
            f"{args.kv_cache_dtype} (group size {kv_cache_group_size(args)}, latest "
            f"{kv_cache_window(args)} tokens exact)",
        )
    if engine is not None:
        return EngineGenerator(prompts, prompt_ids, params, tokenizer, engine, say, threads)
    return LoopGenerator(prompts, prompt_ids, params, tokenizer, model, args, say, threads)


# ---------------------------------------------------------------------------
# Flags -> settings, each checked before anything slow happens
# ---------------------------------------------------------------------------


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    if args.compile and (args.no_kv_cache or args.cache in ("concat", "offloaded")):
        raise RoseError(
            "--compile compiles the static cache's decode step: drop --no-kv-cache "
            f"and --cache {args.cache or 'concat'}, or drop --compile"
        )
    if args.onnx and (args.no_kv_cache or args.cache or args.compile):
        raise RoseError(
            "--onnx runs the exported graph with its own past key/values: drop "
            "--no-kv-cache, --cache and --compile"
        )
    if args.no_kv_cache and args.cache:
        raise RoseError(f"--no-kv-cache runs uncached: drop --cache {args.cache} or --no-kv-cache")
    quantized = args.kv_cache_dtype != "auto"
    check_quantization_flags(args)
    if quantized and (args.no_kv_cache or args.cache in ("concat", "offloaded") or args.onnx):
        raise RoseError(
            f"--kv-cache-dtype {args.kv_cache_dtype} quantizes the static cache or the "
            f"engine's pool: drop --no-kv-cache, --cache {args.cache or 'concat'} and --onnx"
        )
    if quantized and args.compile:
        raise RoseError(
            "--compile needs the unquantized cache (--kv-cache-dtype auto): a quantized "
            "cache's steps change shape when it flushes a group"
        )
    if quantized and (args.pipeline_parallel_size != 1 or args.micro_batches is not None):
        raise RoseError("a split model keeps unquantized per-stage caches: drop --kv-cache-dtype")
    if speculative_config(args) is not None and (
        other_path(args) or args.pipeline_parallel_size != 1
    ):
        raise RoseError(
            "speculative decoding runs in the engine: drop --no-kv-cache, --cache, --compile, "
            "--onnx and --pipeline-parallel-size"
        )
    if args.onnx and (args.device == "cuda" or args.dtype != "float32"):
        raise RoseError("--onnx runs the float32 graph on the CPU: drop --device and --dtype")
    structured = structured_outputs(args)
    if structured is not None and (args.onnx or args.pipeline_parallel_size != 1):
        raise RoseError(
            "structured output runs on the engine and the PyTorch loops: drop --onnx and "
            "--pipeline-parallel-size"
        )
    # torch's default generator starts from the same seed in every process, so an unseeded
    # run would repeat itself: without --seed, draw a fresh one (shown on stderr).
    seed = random.SystemRandom().randrange(2**31) if args.seed is None else args.seed
    try:
        return SamplingParams(
            max_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=seed,
            ignore_eos=args.no_stop_at_eot,
            stop=tuple(args.stop),
            structured_outputs=structured,
        )
    except InvalidParam as err:  # told by the flag the user typed, not the field's name
        flag = FLAG_OF_FIELD.get(err.param)
        message = str(err)
        if flag is not None and message.startswith(err.param):
            message = flag + message[len(err.param) :]
        raise RoseError(message) from None


# The SamplingParams fields whose command-line flag has another name.
FLAG_OF_FIELD = {
    "max_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "seed": "--seed",
    "stop": "--stop",
}


def structured_outputs(args: argparse.Namespace) -> StructuredOutputs | None:
    """The constraint the flags ask for (its files read; None: free text)."""
    if args.json_schema is not None:
        return StructuredOutputs(json=read_text(args.json_schema, "--json-schema"))
    if args.grammar is not None:
        return StructuredOutputs(grammar=read_text(args.grammar, "--grammar"))
    if args.json_object:
        return StructuredOutputs(json_object=True)
    if args.regex is not None:
        return StructuredOutputs(regex=args.regex)
    if args.choice is not None:
        return StructuredOutputs(choice=args.choice)
    return None


def read_text(path: str, flag: str) -> str:
    """A constraint's file, read only as far as MAX_CONSTRAINT_BYTES (a device such as
    /dev/zero never ends), as UTF-8 text."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONSTRAINT_BYTES + 1)
    except OSError as err:
        raise RoseError(f"{flag}: cannot read {path}: {os_cause(err)}") from None
    if len(raw) > MAX_CONSTRAINT_BYTES:
        raise RoseError(
            f"{flag}: {path} is larger than {MAX_CONSTRAINT_BYTES >> 20} MiB: "
            "no schema or grammar is this long"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RoseError(
            f"{flag}: {path} is not UTF-8 text (byte {raw[err.start]:#04x} at {err.start})"
        ) from None


def read_prompts(args: argparse.Namespace) -> tuple[list[str], int]:
    """The prompts (--prompt ones first, then the file's), and how many blank lines were skipped."""
    prompts = list(args.prompt or [])
    blank_lines = 0
    if args.prompt_file:
        path = Path(args.prompt_file)
        from_stdin = args.prompt_file in STDIN_NAMES  # /dev/stdin is no regular file
        why = None if from_stdin else not_a_file(path)
        if why is not None:
            raise RoseError(f"prompt file {path} {why}")
        try:
            raw = sys.stdin.buffer.read() if from_stdin else path.read_bytes()
            lines = raw.decode("utf-8").splitlines()
        except UnicodeDecodeError:
            raise RoseError(f"prompt file {path} is not UTF-8 text") from None
        from_file = [line for line in lines if line.strip()]
        if not from_file:
            raise RoseError(f"prompt file {path} holds no prompts (blank lines are skipped)")
        prompts += from_file
        blank_lines = len(lines) - len(from_file)
    return prompts or [""], blank_lines


def encode_prompts(prompts: list[str], tokenizer: Tokenizer, block_size: int) -> list[list[int]]:
    """Token ids per prompt; an empty prompt starts from <|endoftext|>, as in training."""
    encoded = []
    for number, prompt in enumerate(prompts, start=1):
        ids = tokenizer.encode(prompt) or [tokenizer.eot_id]
        if len(ids) > block_size:
            raise RoseError(
                f"prompt {number} has {len(ids)} tokens but the model's context (block_size) is "
                f"{block_size}: shorten it"
            )
        encoded.append(ids)
    return encoded


def report_seed_and_prompts(
    args: argparse.Namespace, params: SamplingParams, blank_lines: int, say: Say
) -> None:
    """The seed (greedy decoding draws nothing, so none is used) and the prompt file."""
    if params.greedy:
        say("seed", "none (temperature 0: greedy, no random draws)")
    else:
        random_seed = " (random; pass --seed to repeat this run)" if args.seed is None else ""
        say("seed", f"{params.seed}{random_seed}")
    if args.prompt_file:
        where = "standard input" if args.prompt_file in STDIN_NAMES else args.prompt_file
        say("prompt file", f"{where} ({blank_lines} blank lines skipped)")


def other_path(args: argparse.Namespace) -> bool:
    """A flag asks for a path other than the engine."""
    return bool(args.no_kv_cache or args.cache or args.compile or args.onnx)


def uses_engine(args: argparse.Namespace, num_prompts: int) -> bool:
    """Several prompts go through the engine, unless a flag asks for another path; so does
    speculative decoding."""
    engine_only = num_prompts > 1 or speculative_config(args) is not None
    return engine_only and not other_path(args)


def batches(num_prompts: int, args: argparse.Namespace) -> list[slice]:
    """The left-padded batches of the paths other than the engine, in prompt order."""
    size = DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size
    return [slice(start, start + size) for start in range(0, num_prompts, size)]


def batched_summary(results: list[GenerationResult], elapsed: float) -> list[tuple[str, object]]:
    """The throughput line of a batch of several prompts (one prompt's is its own report)."""
    if len(results) < 2:
        return []
    new_tokens = sum(len(result.token_ids) for result in results)
    return [("batched tokens/s", f"{new_tokens / elapsed:.1f} ({new_tokens} new tokens)")]


def tell(results: list[GenerationResult], on_done: OnDone | None) -> list[GenerationResult]:
    """Hand each result of a batch that finished together to on_done, in order."""
    for index, result in enumerate(results):
        if on_done is not None:
            on_done(index, result)
    return results


# ---------------------------------------------------------------------------
# The teaching loop's caches and onnxruntime: left-padded batches
# ---------------------------------------------------------------------------


def cache_kind(args: argparse.Namespace, config: GPTConfig) -> str:
    """static, concat, rolling or offloaded, checked against the model: a sliding window needs the
    rolling cache (the others keep every key), and only a window can roll."""
    windowed = config.sliding_window is not None
    kind = args.cache or ("rolling" if windowed else "static")
    if windowed and kind != "rolling":
        raise RoseError(
            f"the model attends over a sliding window of {config.sliding_window} tokens: "
            f"use --cache rolling (the default for it), not --cache {kind}"
        )
    if kind == "rolling" and not windowed:
        raise RoseError(
            "--cache rolling needs a model with a sliding window: pick static, concat or offloaded"
        )
    if kind == "rolling" and (args.kv_cache_dtype != "auto" or args.compile):
        raise RoseError("the rolling cache is not quantized or compiled: drop --kv-cache-dtype "
                        "and --compile")  # fmt: skip
    return kind


def make_cache(
    args: argparse.Namespace, model: GPT, batch: list[list[int]]
) -> StaticKVCache | ConcatKVCache | RollingKVCache | OffloadedKVCache | None:
    """A fresh cache for one batch (None: the uncached reference path)."""
    if args.no_kv_cache:
        return None
    kind = cache_kind(args, model.config)
    if kind == "concat":
        return ConcatKVCache()
    # No row ever needs more slots than the longest prompt plus its new tokens: allocate
    # no more (a window may be far larger than any run).
    longest = max(map(len, batch))
    if kind == "rolling":
        return RollingKVCache(model, len(batch), max_len=longest + args.max_new_tokens)
    # Nor more than the context (longer runs restart from a shorter window). A compiled
    # step is built for one buffer shape: then always allocate the whole context.
    max_len = min(model.config.block_size, longest + args.max_new_tokens)
    if args.compile:
        max_len = model.config.block_size
    if kind == "offloaded":
        return OffloadedKVCache(model, batch_size=len(batch), max_len=max_len)
    return make_kv_cache(
        model,
        batch_size=len(batch),
        max_len=max_len,
        kv_cache_dtype=args.kv_cache_dtype,
        window=kv_cache_window(args),
        group_size=kv_cache_group_size(args),
    )


def load_onnx(args: argparse.Namespace) -> tuple[OnnxModel, Tokenizer]:
    """The exported graph in an onnxruntime session, and the tokenizer it was exported with."""
    model = OnnxModel(args.onnx, threads=Threads(args.num_threads).count)
    tokenizer = Tokenizer(args.tokenizer_name or model.meta.tokenizer_name)
    if tokenizer.n_vocab > model.meta.vocab_size:
        raise RoseError(
            f"tokenizer {tokenizer.name!r} has {tokenizer.n_vocab} tokens but the model's "
            f"vocabulary has {model.meta.vocab_size}: use the tokenizer the model was exported with"
        )
    return model, tokenizer


class LoopGenerator(Generator):
    """The teaching loop (roseinfer/loops) on a fresh cache per batch, or onnxruntime."""

    def __init__(
        self,
        prompts: list[str],
        prompt_ids: list[list[int]],
        params: SamplingParams,
        tokenizer: Tokenizer,
        model: GPT | OnnxModel,
        args: argparse.Namespace,
        say: Say,
        threads: Threads | None = None,  # (None: onnxruntime keeps its own threads)
    ) -> None:
        super().__init__(prompts, prompt_ids, params, tokenizer)
        self.model, self.args, self.say, self.threads = model, args, say, threads

    def run(self, print_batch: PrintBatch) -> None:
        for part in batches(len(self.prompts), self.args):
            self.say("batch size", len(self.prompts[part]))
            generate = functools.partial(self.generate, self.prompt_ids[part])
            batch = Batch(self.prompts[part], generate, True, batched_summary, self.tokenizer)
            print_batch(batch)

    def generate(
        self,
        prompt_ids: list[list[int]],
        on_token: Callable[[int, int], None] | None = None,
        on_done: OnDone | None = None,
    ) -> list[GenerationResult]:
        tokenizer = self.tokenizer
        if isinstance(self.model, OnnxModel):
            results = onnx_generate.generate_batch(
                self.model, prompt_ids, self.params, eot_id=tokenizer.eot_id,
                decode=tokenizer.decode, on_token=on_token,
            )  # fmt: skip
        else:
            cache = make_cache(self.args, self.model, prompt_ids)
            threads = self.threads
            threads.adapt()

            def on_each_token(row: int, token: int) -> None:
                threads.adapt()  # (between steps: the loop hears every token of a step)
                if on_token is not None:
                    on_token(row, token)

            results = generate_batch(
                self.model, prompt_ids, self.params, use_cache=cache is not None, cache=cache,
                eot_id=tokenizer.eot_id, decode=tokenizer.decode, tokenizer=tokenizer,
                compile=self.args.compile, on_token=on_each_token,
            )  # fmt: skip
        return tell(results, on_done)


# ---------------------------------------------------------------------------
# The engine: every prompt at once
# ---------------------------------------------------------------------------


def as_result(output: RequestOutput) -> GenerationResult:
    """An engine output in the shape the other paths report (times from its arrival)."""
    return GenerationResult(
        prompt_ids=output.prompt_token_ids,
        token_ids=output.token_ids,
        finish_reason=output.finish_reason,
        stop_reason=output.stop_reason,
        step_logits=None,
        time_to_first_token_s=(output.first_token_time or output.finish_time) - output.arrival_time,
        total_time_s=output.finish_time - output.arrival_time,
    )


class EngineGenerator(Generator):
    """Every prompt through the engine at once (continuous batching on the paged pool);
    each result told as it finishes."""

    def __init__(
        self,
        prompts: list[str],
        prompt_ids: list[list[int]],
        params: SamplingParams,
        tokenizer: Tokenizer,
        engine: LLMEngine,
        say: Say,
        threads: Threads,
    ) -> None:
        super().__init__(prompts, prompt_ids, params, tokenizer)
        self.engine, self.say, self.threads = engine, say, threads

    def run(self, print_batch: PrintBatch) -> None:
        self.report_context_cap()
        print_batch(Batch(self.prompts, self.generate, False, self.summary, self.tokenizer))

    def generate(
        self, on_token: object = None, on_done: OnDone | None = None
    ) -> list[GenerationResult]:
        """(on_token is not heard: the engine tells finished requests only.)"""
        engine = self.engine
        final_only = RequestOutputKind.FINAL_ONLY  # (the engine makes no other output)
        request_ids = [
            engine.add_request(ids, self.params, output_kind=final_only) for ids in self.prompt_ids
        ]
        index = {request_id: i for i, request_id in enumerate(request_ids)}
        done: dict[str, GenerationResult] = {}
        self.threads.adapt()
        for output in engine.drain(after_step=self.threads.adapt):
            done[output.request_id] = result = as_result(output)
            if on_done is not None:
                on_done(index[output.request_id], result)
        return [done[request_id] for request_id in request_ids]

    def summary(self, results: list[GenerationResult], elapsed: float) -> list[tuple[str, object]]:
        engine = self.engine
        stats = engine.stats()
        new_tokens = stats.generation_tokens
        lines: list[tuple[str, object]] = [
            ("engine tokens/s", f"{new_tokens / elapsed:.1f} ({new_tokens} new tokens)"),
            (
                "engine",
                f"{stats.num_kv_blocks} KV blocks of {engine.config.kv_block_size} tokens, "
                f"{stats.num_preemptions} preemptions, prefix cache {stats.prefix_cache_hits}/"
                f"{stats.prefix_cache_queries} blocks hit",
            ),
        ]
        spec = stats.speculative
        if spec is not None and self.params.greedy:  # (a sampled run was told it drafts nothing)
            lines.append(("speculative decoding", speculative_summary(spec)))
        return lines

    def report_context_cap(self) -> None:
        """One line when the engine will stop prompts before --max-new-tokens: a request's
        last token is sampled, never fed, so it runs until it has fed `limit` tokens (finish
        reason length), as vLLM's offline LLM stops at its context. The server refuses such
        a request instead (roseinfer/serving/checks.py)."""
        limit, max_tokens = self.engine.length_limit, self.params.max_tokens
        prompt_ids = self.prompt_ids
        over = [
            ids for ids in prompt_ids if limit is not None and len(ids) + max_tokens - 1 > limit
        ]
        if over:
            which = (
                "the prompt"
                if len(prompt_ids) == 1
                else f"{len(over)} of {len(prompt_ids)} prompts"
            )
            self.say(
                "context",
                f"{which} + --max-new-tokens {max_tokens} do not fit the model's {limit}-token "
                "context: the engine stops each when the context is full (finish reason length)",
            )


def speculative_summary(spec: SpeculativeStats) -> str:
    """What the drafts did, in one line; no step with a draft is said so (no rate of 0/0)."""
    if not spec.num_drafts:
        return "no step had a draft to verify (0 tokens drafted)"
    return (
        f"{spec.num_accepted_tokens}/{spec.num_draft_tokens} drafted tokens accepted "
        f"({spec.acceptance_rate:.1%}), {spec.mean_accepted_length:.2f} tokens per verify "
        f"step ({spec.num_drafts} steps)"
    )


# ---------------------------------------------------------------------------
# A split model: --pipeline-parallel-size N
# ---------------------------------------------------------------------------


@dataclass
class SplitPrinter:
    """Stage 0's part of the CLI: each batch generated through the pipeline, printed as
    a single process prints it (a StageProgram, see roseinfer/pipeline/launch.py)."""

    args: argparse.Namespace
    prompts: list[str]
    prompt_ids: list[list[int]]
    params: SamplingParams
    tokenizer_name: str
    print_batch: PrintBatch
    say: Say

    def run(self, driver: Driver) -> list[list[GenerationResult]]:
        tokenizer = Tokenizer(self.tokenizer_name)

        def generate(ids, on_token=None, on_done: OnDone | None = None) -> list[GenerationResult]:
            results = driver.generate(
                ids, self.params, eot_id=tokenizer.eot_id, decode=tokenizer.decode,
                micro_batches=self.args.micro_batches, on_token=on_token,
            )  # fmt: skip
            return tell(results, on_done)

        for part in batches(len(self.prompts), self.args):
            self.say("batch size", len(self.prompts[part]))
            run_part = functools.partial(generate, self.prompt_ids[part])
            batch = Batch(self.prompts[part], run_part, True, batched_summary, tokenizer)
            self.print_batch(batch)
        return []


class SplitGenerator(Generator):
    """The model's layers over --pipeline-parallel-size processes, stage 0 printing."""

    def __init__(
        self,
        prompts: list[str],
        prompt_ids: list[list[int]],
        params: SamplingParams,
        tokenizer: Tokenizer,
        setup: PipelineSetup,
        args: argparse.Namespace,
        say: Say,
    ) -> None:
        super().__init__(prompts, prompt_ids, params, tokenizer)
        self.setup, self.args, self.say = setup, args, say

    def run(self, print_batch: PrintBatch) -> None:
        program = SplitPrinter(
            self.args, self.prompts, self.prompt_ids, self.params, self.tokenizer.name,
            print_batch, self.say,
        )  # fmt: skip
        under_torchrun = torchrun_rank()
        if under_torchrun is None:
            run_pipeline(self.setup, program)
            return
        rank, world_size, init_method = under_torchrun
        n_stages = self.setup.n_stages
        if world_size != n_stages:
            raise RoseError(
                f"torchrun started {world_size} processes for --pipeline-parallel-size "
                f"{n_stages}: pass --nproc_per_node={n_stages}"
            )
        report = stage_main(rank, self.setup, program, init_method)
        if report.error is not None:
            raise RoseError(report.error)


def split_generator(args: argparse.Namespace, params: SamplingParams, say: Say) -> Generator:
    """Generate with the model's layers split over --pipeline-parallel-size processes."""
    n_stages = args.pipeline_parallel_size
    if n_stages < 1:
        raise RoseError(f"--pipeline-parallel-size must be >= 1, got {n_stages}")
    if n_stages == 1:
        raise RoseError(
            "--micro-batches cuts a batch for a split model: add --pipeline-parallel-size 2 or more"
        )
    if args.no_kv_cache or args.compile or args.onnx:
        raise RoseError(
            "a split model runs on per-stage KV caches (--cache static or concat): drop "
            "--no-kv-cache, --compile and --onnx"
        )
    cache = args.cache or "static"
    if cache not in CACHE_KINDS:
        raise RoseError(
            f"a split model keeps a {' or '.join(CACHE_KINDS)} cache per stage: drop --cache {cache}"
        )
    if args.micro_batches is not None and args.micro_batches < 1:
        raise RoseError(f"--micro-batches must be >= 1, got {args.micro_batches}")
    prompts, blank_lines = read_prompts(args)
    device = pick_device(args.device)
    pick_dtype(args.dtype, device)
    config, tokenizer_name, source = model_config_and_tokenizer(args.checkpoint_path, args.hf_model)
    layers = stage_layers(config.n_layer, n_stages)  # a clear error for too many stages
    tokenizer = Tokenizer(args.tokenizer_name or tokenizer_name)
    prompt_ids = encode_prompts(prompts, tokenizer, config.block_size)
    if device.type == "cuda" and torch.cuda.device_count() < n_stages:
        raise RoseError(
            f"{n_stages} stages on CUDA need {n_stages} GPUs (one per stage), "
            f"{torch.cuda.device_count()} visible; use fewer stages or --device cpu"
        )
    setup = PipelineSetup(
        str(source),
        n_stages,
        hf=args.hf_model is not None,
        device=device.type,
        dtype=args.dtype,
        cache=cache,
        threads=args.num_threads or max(1, (os.cpu_count() or 1) // n_stages),
    )
    under_torchrun = torchrun_rank()
    if under_torchrun is None or under_torchrun[0] == 0:
        say("device", f"{device} ({'NCCL' if device.type == 'cuda' else 'gloo'})")
        say("dtype", args.dtype)
        say("model", f"{source} ({config.n_layer} layers)")
        split = ", ".join(f"stage {i}: layers {r.start}-{r.stop - 1}" for i, r in enumerate(layers))
        say("pipeline", f"{n_stages} stages ({split})")
        say("tokenizer", tokenizer.name)
        say("kv cache", f"{cache}, one per stage")
        report_seed_and_prompts(args, params, blank_lines, say)
    return SplitGenerator(prompts, prompt_ids, params, tokenizer, setup, args, say)
