"""python -m roseinfer.cli_generate: generate text with a rose checkpoint or a Hugging Face GPT-2.

    python -m roseinfer.cli_generate --prompt "ROMEO:" --max-new-tokens 100
    python -m roseinfer.cli_generate --onnx onnx/tiny --prompt "ROMEO:"   # onnxruntime

Reading order: parse the flags; `build_generator` (roseinfer/cli/generator.py) checks
them (bad values fail before anything loads), picks the device and dtype, loads the
model and its tokenizer, encodes the prompts and returns the generator of the path they
ask for; this module prints what it generates, and reports. Every check runs before the
first status line, so a mistake is told in exactly one line (`[roseinfer] error: ...`,
exit code 2).

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
import sys
import time
from collections.abc import Callable

from roseinfer.cli.engine_flags import add_engine_flags
from roseinfer.cli.generator import DEFAULT_BATCH_SIZE, Batch, build_generator
from roseinfer.loops.generate import COMPILE_MODES, GenerationResult
from roseinfer.pipeline.launch import Terminated
from rosetrainer.errors import ArgumentParser, run_cli
from rosetrainer.runtime import DTYPES
from rosetrainer.tokenizer import Tokenizer

PROG = "roseinfer"


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


def write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


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


def print_batch(batch: Batch, json_lines: bool) -> None:
    """Generate one batch and print it: one prompt's text streamed as it is made, several
    prompts' each in prompt order as soon as it and every prompt before it are done (or one
    JSON line each); then each prompt's status lines and the batch's."""
    prompts, tokenizer = batch.prompts, batch.tokenizer
    printed: list[str] = []
    ready: dict[int, str] = {}

    def on_done(index: int, result: GenerationResult) -> None:
        ready[index] = (
            as_json(prompts[index], result, tokenizer) + "\n"
            if json_lines
            else prompts[index] + tokenizer.decode(result.token_ids) + "\n"
        )
        while len(printed) in ready:
            printed.append(ready.pop(len(printed)))
            write(printed[-1])

    started = time.perf_counter()
    if len(prompts) == 1 and batch.streams and not json_lines:
        results = [generate_streaming(prompts[0], batch.generate, tokenizer)]
    else:
        results = batch.generate(on_done=on_done)
    elapsed = time.perf_counter() - started
    for result in results:
        report(result)
    for what, value in batch.summary(results, elapsed):
        status(what, value)


def run(args: argparse.Namespace) -> int:
    """Parse, build the generator the flags ask for, print what it generates."""
    build_generator(args, status).run(functools.partial(print_batch, json_lines=args.json))
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
