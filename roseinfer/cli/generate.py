"""python -m roseinfer.cli_generate: generate text with a rose checkpoint or a Hugging Face GPT-2.

    python -m roseinfer.cli_generate --prompt "ROMEO:" --max-new-tokens 100
    python -m roseinfer.cli_generate --onnx onnx/tiny --prompt "ROMEO:"   # onnxruntime

Reading order: parse the flags (bad values fail before anything loads), pick the
device and dtype, load the model and its tokenizer, encode the prompts, then generate
and report. Every check runs before the first status line, so a mistake is told
in exactly one line (`[roseinfer] error: ...`, exit code 2).

Which path runs:
* several prompts: the serving engine (roseinfer/engine: paged KV cache, continuous
  batching, prefix caching; its flags are rose-serve's, roseinfer/cli/engine_flags.py):
  --max-num-seqs of them run at once, and each prompt's output is printed, in prompt
  order, as soon as it and every prompt before it are done;
* one prompt: a static cache (a rolling one for a model with a sliding window), its
  text streamed as it is made;
* speculative decoding (--speculative-model or --speculative-method, with
  --num-speculative-tokens): the engine, for one prompt too (printed once it is done);
* --no-kv-cache, --cache static|concat|rolling|offloaded, --compile or --onnx: that path, for
  every prompt, in left-padded batches of --batch-size (each batch printed when it is
  done). --no-kv-cache on a windowed model is its oracle: the whole sequence under the
  banded mask.

stdout carries only the text (the prompt, then its continuation, then a newline) or,
with --json, one JSON object per prompt per line, in prompt order. Every status line
goes to stderr as `[roseinfer] what: value`.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from roseinfer.cache.dense import CACHE_KINDS, ConcatKVCache, StaticKVCache
from roseinfer.cache.offloaded import OffloadedKVCache
from roseinfer.cache.quantized import check_quant_settings, make_kv_cache
from roseinfer.cache.rolling import RollingKVCache
from roseinfer.cli.engine_flags import (
    add_engine_flags,
    engine_config,
    engine_from_flags,
    speculative_config,
)
from roseinfer.engine.llm_engine import LLMEngine, RequestOutput
from roseinfer.engine.packed import can_pack, packed_linears
from roseinfer.loading import load_model_and_tokenizer, model_config_and_tokenizer
from roseinfer.loops import onnx_generate
from roseinfer.loops.generate import COMPILE_MODES, GenerationResult, generate_batch
from roseinfer.loops.onnx_generate import OnnxModel
from roseinfer.pipeline.launch import (
    PipelineSetup,
    Terminated,
    run_pipeline,
    stage_main,
    torchrun_rank,
)
from roseinfer.pipeline.runner import Driver
from roseinfer.pipeline.stage import stage_layers
from roseinfer.request.sampling import SamplingParams
from roseinfer.request.sampling_params import StructuredOutputs
from roseinfer.request.structured import grammar_for
from roseinfer.speculative.drafters import SAMPLED_NOT_DRAFTED
from roseinfer.speculative.verify import SpeculativeStats
from rosetrainer.config import GPTConfig
from rosetrainer.errors import ArgumentParser, RoseError, run_cli
from rosetrainer.model import GPT
from rosetrainer.runtime import DTYPES, pick_device, pick_dtype
from rosetrainer.tokenizer import Tokenizer

PROG = "roseinfer"
STDIN_NAMES = ("-", "/dev/stdin")  # --prompt-file names that read standard input
DEFAULT_BATCH_SIZE = 32


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m roseinfer.cli_generate",
        description="Generate text with a rose checkpoint or a Hugging Face GPT-2. The text "
        "goes to stdout (the prompt, then its continuation); status goes to stderr. One prompt "
        "streams its text as it is made; several run through the serving engine (continuous "
        "batching on a paged KV cache) and print in prompt order.",
    )
    add_source_flags(p)
    add_prompt_flags(p)
    add_sampling_flags(p)
    add_structured_flags(p)
    add_path_flags(p)
    add_engine_flags(p)
    add_output_flags(p)
    return p


def add_source_flags(p: argparse.ArgumentParser) -> None:
    """Which model, and its tokenizer."""
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--checkpoint-path",
        help="a rose .pt file, or a run directory holding best.pt or last.pt "
        "(default: the newest checkpoint under checkpoints/)",
    )
    source.add_argument(
        "--hf-model",
        help="a local Hugging Face GPT-2 directory (config.json + weights), or a Hub id online",
    )
    source.add_argument(
        "--onnx",
        metavar="DIR",
        help="a directory written by `rose-export-onnx`: generate with that graph in "
        "onnxruntime (float32, CPU) instead of PyTorch",
    )
    p.add_argument(
        "--tokenizer-name",
        help="tiktoken encoding (default: the checkpoint's tokenizer, else gpt2)",
    )


def add_prompt_flags(p: argparse.ArgumentParser) -> None:
    prompts = p.add_argument_group("prompts")
    prompts.add_argument(
        "--prompt",
        action="append",
        help="a prompt; repeat the flag for several (they run together). With no prompt at "
        "all, one empty prompt: generation starts from <|endoftext|>",
    )
    prompts.add_argument(
        "--prompt-file",
        help="a UTF-8 text file, one prompt per line (- reads standard input); blank lines "
        "are skipped",
    )


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """What each request asks for (its SamplingParams)."""
    sampling = p.add_argument_group("sampling and stopping")
    sampling.add_argument("--max-new-tokens", type=int, default=200, help="default: 200")
    sampling.add_argument(
        "--temperature", type=float, default=0.8, help="0 = greedy (argmax); default: 0.8"
    )
    sampling.add_argument(
        "--top-k",
        type=int,
        default=200,
        help="sample among the k likeliest tokens; 0 = off; default: 200",
    )
    sampling.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample among the likeliest tokens whose probability reaches p, in (0, 1]; "
        "1.0 = off (default)",
    )
    sampling.add_argument(
        "--seed",
        type=int,
        help="one seed, one output (default: a random seed, shown on stderr)",
    )
    sampling.add_argument(
        "--no-stop-at-eot", action="store_true", help="keep going after <|endoftext|>"
    )
    sampling.add_argument(
        "--stop",
        action="append",
        default=[],
        help="stop once the generated text contains this string (kept in the output); repeatable",
    )


def add_structured_flags(p: argparse.ArgumentParser) -> None:
    """Hold the output to a constraint (SamplingParams.structured_outputs): one of these."""
    group = p.add_argument_group(
        "structured output",
        "hold every output to one constraint: the text then ends when the constraint is "
        "complete (finish reason stop), or is cut by --max-new-tokens (length)",
    )
    one = group.add_mutually_exclusive_group()
    one.add_argument("--json-schema", metavar="FILE", help="a JSON schema (a .json file)")
    one.add_argument("--json-object", action="store_true", help="any JSON object")
    one.add_argument("--regex", help="a regular expression the whole output matches")
    one.add_argument(
        "--choice",
        action="append",
        help="the output is exactly one of these strings; repeat the flag for each",
    )
    one.add_argument(
        "--grammar", metavar="FILE", help="a Lark grammar (llguidance's dialect; rule start)"
    )


def add_path_flags(p: argparse.ArgumentParser) -> None:
    """Which path runs instead of the engine: the teaching loop's caches, a split model."""
    path = p.add_argument_group(
        "other paths", "run every prompt on one of these instead of the engine"
    )
    path.add_argument(
        "--no-kv-cache",
        action="store_true",
        help="rerun the model on the whole sequence each step (the slow reference path)",
    )
    path.add_argument(
        "--cache",
        choices=["static", "concat", "rolling", "offloaded"],
        help="run every prompt on this cache in left-padded batches instead of the engine: "
        "static: buffers preallocated for the whole context (what one prompt uses anyway); "
        "concat: grown by concatenation each step; rolling: the sliding window's slots "
        "only (the default for a model with a sliding window, and its only cache); "
        "offloaded: every layer's keys and values in host memory, two layers' on the GPU, "
        "copied in one layer ahead (a long context on a small card, at PCIe speed)",
    )
    path.add_argument(
        "--batch-size",
        type=int,
        help="the left-padded batches of --no-kv-cache, --cache, --compile, --onnx and a split "
        "model: at most this many prompts at once, each output equal to its output alone "
        f"(default: {DEFAULT_BATCH_SIZE}; the engine runs --max-num-seqs at once)",
    )
    path.add_argument(
        "--compile",
        nargs="?",
        const="default",
        choices=COMPILE_MODES,
        help="torch.compile the one-token decode step of the static cache; the first step "
        "compiles, then every step reuses the graph. 'default' (what --compile alone asks) "
        "compiles in seconds; 'max-autotune' freezes the weights into the graph and picks "
        "the fastest matmul kernels, a minute or two of compiling for the fastest decode",
    )
    path.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=1,
        help="split the model's layers over this many processes (stages), each holding only "
        "its layers' weights and KV cache; the CLI starts them itself (gloo on CPU, NCCL with "
        "one GPU per stage), or runs as one of them under torchrun; default: 1 (no split)",
    )
    path.add_argument(
        "--micro-batches",
        type=int,
        help="with --pipeline-parallel-size: cut each batch into this many micro-batches, so "
        "the stages work at the same time (default: one per stage when the batch has rows "
        "enough, else 1)",
    )


def add_output_flags(p: argparse.ArgumentParser) -> None:
    """Where it runs and how the text is printed."""
    p.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: auto"
    )
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="float32",
        help="cast the weights to this type (float16 only on CUDA); default: float32",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="no streaming: print one JSON object per prompt per line",
    )


def status(what: str, value: object) -> None:
    print(f"[{PROG}] {what}: {value}", file=sys.stderr, flush=True)


def report_seed_and_prompts(
    args: argparse.Namespace, params: SamplingParams, blank_lines: int
) -> None:
    """The seed (greedy decoding draws nothing, so none is used) and the prompt file."""
    if params.greedy:
        status("seed", "none (temperature 0: greedy, no random draws)")
    else:
        random_seed = " (random; pass --seed to repeat this run)" if args.seed is None else ""
        status("seed", f"{params.seed}{random_seed}")
    if args.prompt_file:
        where = "standard input" if args.prompt_file in STDIN_NAMES else args.prompt_file
        status("prompt file", f"{where} ({blank_lines} blank lines skipped)")


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
    quantized = args.kv_cache_dtype != "auto"
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
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise RoseError(f"{flag}: cannot read {path}: {err.strerror or err}") from None


def read_prompts(args: argparse.Namespace) -> tuple[list[str], int]:
    """The prompts (--prompt ones first, then the file's), and how many blank lines were skipped."""
    prompts = list(args.prompt or [])
    blank_lines = 0
    if args.prompt_file:
        path = Path(args.prompt_file)
        from_stdin = args.prompt_file in STDIN_NAMES  # /dev/stdin is no regular file
        if not from_stdin and not path.is_file():
            raise RoseError(f"prompt file not found: {path}")
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


# ---------------------------------------------------------------------------
# Generation, streamed or as JSON
# ---------------------------------------------------------------------------


def write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


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
        window=args.kv_cache_window,
        group_size=args.kv_cache_group_size,
    )


def generate_streaming(
    prompt: str, generate_one: Callable[..., list[GenerationResult]], tokenizer: Tokenizer
) -> GenerationResult:
    """Print the prompt, each piece of text as its tokens arrive, and a final newline."""
    decoder = tokenizer.stream_decoder()
    write(prompt)
    try:
        [result] = generate_one(on_token=lambda _row, token: write(decoder.push(token)))
        return result
    finally:  # also on Ctrl-C: what was held back, and the line ends
        write(decoder.flush() + "\n")


def as_json(prompt: str, result: GenerationResult, tokenizer: Tokenizer) -> str:
    tokens_per_s = result.tokens_per_s
    return json.dumps(
        {
            "prompt": prompt,
            "prompt_token_ids": result.prompt_ids,
            "token_ids": result.token_ids,
            "text": tokenizer.decode(result.token_ids),
            "finish_reason": result.finish_reason,
            "stop_reason": result.stop_reason,
            "time_to_first_token_ms": round(result.time_to_first_token_s * 1000, 3),
            "tokens_per_s": None if math.isnan(tokens_per_s) else round(tokens_per_s, 3),
            "total_time_ms": round(result.total_time_s * 1000, 3),
        },
        ensure_ascii=False,
    )


def report(result: GenerationResult) -> None:
    """One prompt's status lines."""
    status("prompt tokens", len(result.prompt_ids))
    status("new tokens", len(result.token_ids))
    status("finish reason", result.finish_reason)
    status("time to first token", f"{result.time_to_first_token_s * 1000:.1f} ms")
    tokens_per_s = result.tokens_per_s
    status(
        "tokens/s",
        "n/a (fewer than 2 tokens)" if math.isnan(tokens_per_s) else f"{tokens_per_s:.1f}",
    )


def run_batch(
    prompts: list[str],
    prompt_ids: list[list[int]],
    args: argparse.Namespace,
    params: SamplingParams,
    model: GPT | OnnxModel,
    tokenizer: Tokenizer,
) -> None:
    """Generate for one batch of prompts, print their outputs in order, and report."""
    if isinstance(model, OnnxModel):
        generate_now = functools.partial(
            onnx_generate.generate_batch,
            model,
            prompt_ids,
            params,
            eot_id=tokenizer.eot_id,
            decode=tokenizer.decode,
        )
    else:
        cache = make_cache(args, model, prompt_ids)
        generate_now = functools.partial(
            generate_batch,
            model,
            prompt_ids,
            params,
            use_cache=cache is not None,
            cache=cache,
            eot_id=tokenizer.eot_id,
            decode=tokenizer.decode,
            tokenizer=tokenizer,
            compile=args.compile,
        )
    print_batch(prompts, args, tokenizer, generate_now)


def print_batch(
    prompts: list[str],
    args: argparse.Namespace,
    tokenizer: Tokenizer,
    generate_now: Callable[..., list[GenerationResult]],
) -> None:
    """Run `generate_now` (on_token=... streams) for one batch, print in order, report."""
    status("batch size", len(prompts))
    started = time.perf_counter()
    if args.json:
        results = generate_now()
        for prompt, result in zip(prompts, results, strict=True):
            print(as_json(prompt, result, tokenizer), flush=True)
    elif len(prompts) == 1:
        results = [generate_streaming(prompts[0], generate_now, tokenizer)]
    else:
        results = generate_now()
        for prompt, result in zip(prompts, results, strict=True):
            write(prompt + tokenizer.decode(result.token_ids) + "\n")
    elapsed = time.perf_counter() - started
    for result in results:
        report(result)
    if len(results) > 1:
        new_tokens = sum(len(result.token_ids) for result in results)
        status("batched tokens/s", f"{new_tokens / elapsed:.1f} ({new_tokens} new tokens)")


def load_onnx(args: argparse.Namespace) -> tuple[OnnxModel, Tokenizer]:
    """The exported graph in an onnxruntime session, and the tokenizer it was exported with."""
    model = OnnxModel(args.onnx)
    tokenizer = Tokenizer(args.tokenizer_name or model.meta.tokenizer_name)
    if tokenizer.n_vocab > model.meta.vocab_size:
        raise RoseError(
            f"tokenizer {tokenizer.name!r} has {tokenizer.n_vocab} tokens but the model's "
            f"vocabulary has {model.meta.vocab_size}: use the tokenizer the model was exported with"
        )
    return model, tokenizer


def batches(num_prompts: int, args: argparse.Namespace) -> list[slice]:
    """The left-padded batches of the paths other than the engine, in prompt order."""
    size = DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size
    return [slice(start, start + size) for start in range(0, num_prompts, size)]


def other_path(args: argparse.Namespace) -> bool:
    """A flag asks for a path other than the engine."""
    return bool(args.no_kv_cache or args.cache or args.compile or args.onnx)


def uses_engine(args: argparse.Namespace, num_prompts: int) -> bool:
    """Several prompts go through the engine, unless a flag asks for another path; so does
    speculative decoding."""
    engine_only = num_prompts > 1 or speculative_config(args) is not None
    return engine_only and not other_path(args)


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


def run_engine(
    prompts: list[str],
    prompt_ids: list[list[int]],
    args: argparse.Namespace,
    params: SamplingParams,
    engine: LLMEngine,
    tokenizer: Tokenizer,
) -> None:
    """Every prompt through the engine; each printed, in prompt order, once it and every
    prompt before it are done."""
    report_context_cap(prompt_ids, params.max_tokens, engine.length_limit)
    request_ids = [engine.add_request(ids, params) for ids in prompt_ids]
    done: dict[str, GenerationResult] = {}
    printed = 0
    started = time.perf_counter()
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = as_result(output)
        while printed < len(prompts) and request_ids[printed] in done:
            result = done[request_ids[printed]]
            if args.json:
                print(as_json(prompts[printed], result, tokenizer), flush=True)
            else:
                write(prompts[printed] + tokenizer.decode(result.token_ids) + "\n")
            printed += 1
    elapsed = time.perf_counter() - started
    for request_id in request_ids:
        report(done[request_id])
    stats = engine.stats()
    new_tokens = stats.generation_tokens
    status("engine tokens/s", f"{new_tokens / elapsed:.1f} ({new_tokens} new tokens)")
    status(
        "engine",
        f"{stats.num_kv_blocks} KV blocks of {engine.config.kv_block_size} tokens, "
        f"{stats.num_preemptions} preemptions, prefix cache {stats.prefix_cache_hits}/"
        f"{stats.prefix_cache_queries} blocks hit",
    )
    spec = stats.speculative
    if spec is not None and params.greedy:  # (a sampled run was told it drafts nothing)
        status("speculative decoding", speculative_summary(spec))


def speculative_summary(spec: SpeculativeStats) -> str:
    """What the drafts did, in one line; no step with a draft is said so (no rate of 0/0)."""
    if not spec.num_drafts:
        return "no step had a draft to verify (0 tokens drafted)"
    return (
        f"{spec.num_accepted_tokens}/{spec.num_draft_tokens} drafted tokens accepted "
        f"({spec.acceptance_rate:.1%}), {spec.mean_accepted_length:.2f} tokens per verify "
        f"step ({spec.num_drafts} steps)"
    )


def report_context_cap(prompt_ids: list[list[int]], max_tokens: int, limit: int | None) -> None:
    """One line when the engine will stop prompts before --max-new-tokens: a request's
    last token is sampled, never fed, so it runs until it has fed `limit` tokens (finish
    reason length), as vLLM's offline LLM stops at its context. The server refuses such a
    request instead (roseinfer/serving/checks.py)."""
    over = [ids for ids in prompt_ids if limit is not None and len(ids) + max_tokens - 1 > limit]
    if over:
        which = (
            "the prompt" if len(prompt_ids) == 1 else f"{len(over)} of {len(prompt_ids)} prompts"
        )
        status(
            "context",
            f"{which} + --max-new-tokens {max_tokens} do not fit the model's {limit}-token "
            "context: the engine stops each when the context is full (finish reason length)",
        )


def run(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    if args.batch_size is not None and args.batch_size < 1:
        raise RoseError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.pipeline_parallel_size != 1 or args.micro_batches is not None:
        return run_split(args, params)
    prompts, blank_lines = read_prompts(args)
    engine = None
    if args.onnx:
        model, tokenizer = load_onnx(args)
        prompt_ids = encode_prompts(prompts, tokenizer, model.meta.block_size)
        status("device", "cpu (onnxruntime)")
        status("dtype", args.dtype)
        status("model", f"{args.onnx} (ONNX, exported from {model.meta.source})")
        status("tokenizer", tokenizer.name)
        status("kv cache", "past_key_values in and present out of the graph")
    else:
        engine_settings = engine_config(args) if uses_engine(args, len(prompts)) else None
        if engine_settings is not None and args.batch_size is not None:
            raise RoseError(
                "--batch-size sizes the left-padded batches of --no-kv-cache, --cache, "
                "--compile and --onnx: the engine (several prompts) takes --max-num-seqs"
            )
        device = pick_device(args.device)
        dtype = pick_dtype(args.dtype, device)
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
            args.kv_cache_group_size,
            args.kv_cache_window,
            "channel",
        )
        if engine_settings is not None:
            engine = engine_from_flags(model, tokenizer, args)  # (it packs its own)
        # A cached decode multiplies a few rows by every weight: on a CPU, by weights
        # packed once for oneDNN, as the engine does (roseinfer.engine.packed).
        packing = not (args.no_kv_cache or args.compile or args.no_pack_weights)
        if engine is None and packing and can_pack(model):
            model = packed_linears(model, args.batch_size or len(prompts))
            status("weights", "linear layers packed for oneDNN (--no-pack-weights: as stored)")
        status("device", device)
        status("dtype", args.dtype)
        status("model", f"{source} ({model.num_params(non_embedding=False):,} params)")
        status("tokenizer", tokenizer.name)
        if args.no_kv_cache:
            status("kv cache", "off (uncached reference)")
        elif engine is not None:
            status("kv cache", "paged (engine)")
            spec = speculative_config(args)
            if spec is not None and params.greedy:
                status("speculative decoding", spec.describe())
            elif spec is not None:  # the engine's documented limit, told (never a nan)
                status(
                    "speculative decoding",
                    f"off: --temperature {args.temperature} samples, and {SAMPLED_NOT_DRAFTED}",
                )
        else:
            status("kv cache", kind)
        if args.kv_cache_dtype != "auto":
            status(
                "kv cache dtype",
                f"{args.kv_cache_dtype} (group size {args.kv_cache_group_size}, latest "
                f"{args.kv_cache_window} tokens exact)",
            )
    if args.compile:
        # Compiling happens inside the first decode step, so tokens/s below includes it.
        how_long = "a minute or two" if args.compile == "max-autotune" else "seconds"
        status("compiled decode", f"{args.compile} (the first step compiles: {how_long})")
    report_seed_and_prompts(args, params, blank_lines)

    if engine is not None:
        run_engine(prompts, prompt_ids, args, params, engine, tokenizer)
        return 0
    for batch in batches(len(prompts), args):
        run_batch(prompts[batch], prompt_ids[batch], args, params, model, tokenizer)
    return 0


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

    def run(self, driver: Driver) -> list[list[GenerationResult]]:
        tokenizer = Tokenizer(self.tokenizer_name)
        for batch in batches(len(self.prompts), self.args):
            generate_now = functools.partial(
                driver.generate,
                self.prompt_ids[batch],
                self.params,
                eot_id=tokenizer.eot_id,
                decode=tokenizer.decode,
                micro_batches=self.args.micro_batches,
            )
            print_batch(self.prompts[batch], self.args, tokenizer, generate_now)
        return []


def run_split(args: argparse.Namespace, params: SamplingParams) -> int:
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
        threads=max(1, (os.cpu_count() or 1) // n_stages),
    )
    program = SplitPrinter(args, prompts, prompt_ids, params, tokenizer.name)
    under_torchrun = torchrun_rank()
    if under_torchrun is None or under_torchrun[0] == 0:
        status("device", f"{device} ({'NCCL' if device.type == 'cuda' else 'gloo'})")
        status("dtype", args.dtype)
        status("model", f"{source} ({config.n_layer} layers)")
        split = ", ".join(f"stage {i}: layers {r.start}-{r.stop - 1}" for i, r in enumerate(layers))
        status("pipeline", f"{n_stages} stages ({split})")
        status("tokenizer", tokenizer.name)
        status("kv cache", f"{cache}, one per stage")
        report_seed_and_prompts(args, params, blank_lines)
    if under_torchrun is not None:
        rank, world_size, init_method = under_torchrun
        if world_size != n_stages:
            raise RoseError(
                f"torchrun started {world_size} processes for --pipeline-parallel-size "
                f"{n_stages}: pass --nproc_per_node={n_stages}"
            )
        report = stage_main(rank, setup, program, init_method)
        if report.error is not None:
            raise RoseError(report.error)
        return 0
    run_pipeline(setup, program)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: _main(argv), PROG)


def _main(argv: list[str] | None) -> int:
    try:
        return run(build_parser().parse_args(argv))
    except Terminated as signal:  # SIGTERM or SIGHUP, a split model's stages stopped first
        # (Ctrl-C is run_cli's)
        status("interrupted", f"stopped by {signal}")
        return 128 + signal.signum
    except BrokenPipeError:  # stdout was closed early (e.g. piped into `head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
