"""rose's inference on a GPU, stage by stage: python -m benchmarks.gpu_inference STAGE

Run by benchmarks/gpu.sh, one stage a process (each with its own time limit), every
figure appended to --results (one JSON object a line) the moment it is measured, so a
run cut short keeps what it measured. --tiny runs the same stages with tiny shapes (on
the CPU: gpu.sh --dry-run, and the smoke test).

* bandwidth: the card's memory bandwidth, measured (a large device-to-device copy).
* decode: batch-1 decode of GPT-2 124M (random weights) from a 128-token prompt to a
  1,024-token context through rose-generate's --compile path (`generate(...,
  cache=StaticKVCache, compile="default")`, which on CUDA replays each step as a CUDA
  graph), float32 and bfloat16: tokens/s after a warm-up run, as a fraction of the
  memory roofline (bandwidth / bytes read per token: every weight, and the keys and
  values of the average context), and whether its tokens equal the uncached oracle's.
* engine: the engine offline, 256 requests x 128 new tokens, float32 with TF32 off:
  rose with FlexAttention and CUDA graphs (the GPU default), rose as it ran before
  (gathered decode attention, every step eager), and transformers' continuous batching
  (`generate_batch`) on the same weights; tok/s each, and how many requests' tokens
  equal the eager engine's.
* serve: rose-serve with and without CUDA graphs (--enforce-eager), 64 clients at once
  x 128 tokens through benchmarks.serving: output tok/s and TTFT p99.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rosetrainer.checkpoint import save_checkpoint
from rosetrainer.config import GPTConfig
from rosetrainer.errors import ArgumentParser, RoseError, one_line, run_cli
from rosetrainer.model import GPT
from rosetrainer.runtime import pick_device, pick_dtype
from rosetrainer.tokenizer import Tokenizer

PROG = "benchmarks.gpu_inference"
STAGES = ("bandwidth", "decode", "engine", "serve")
TINY = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=128)
READY = re.compile(r"serving \S+ at (http://\S+)/v1")


class Results:
    """Figures appended to a file, one JSON object a line, as they come (and printed)."""

    def __init__(self, path: Path, device: torch.device) -> None:
        self.path, self.device = path, device

    def add(self, stage: str, **figures: object) -> None:
        line = json.dumps({"stage": stage, "device": str(self.device), **figures})
        print(line, flush=True)
        with self.path.open("a") as out:
            out.write(line + "\n")

    def read(self, stage: str) -> list[dict]:
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        return [row for row in map(json.loads, lines) if row["stage"] == stage]


def model_config(tiny: bool) -> GPTConfig:
    return TINY if tiny else GPTConfig.from_preset("gpt2")


def random_model(config: GPTConfig, device: torch.device, dtype: torch.dtype) -> GPT:
    torch.manual_seed(0)
    return GPT(config).to(device=device, dtype=dtype).eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- stages --


def bandwidth(args: argparse.Namespace, results: Results) -> None:
    """Device memory bandwidth: bytes read and written by a large copy, per second."""
    size = (64 if args.tiny else 1024) * 2**20
    source = torch.empty(size, dtype=torch.uint8, device=args.device)
    target = torch.empty_like(source)
    target.copy_(source)
    synchronize(args.device)
    repeats = 3 if args.tiny else 20
    started = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source)
    synchronize(args.device)
    seconds = (time.perf_counter() - started) / repeats
    results.add("bandwidth", bytes=size, gb_per_s=round(2 * size / seconds / 1e9, 1))


def decode(args: argparse.Namespace, results: Results) -> None:
    """Batch-1 decode through the static cache's compiled step, against the roofline."""
    from roseinfer.cache.dense import StaticKVCache
    from roseinfer.loops.generate import generate
    from roseinfer.request.sampling import SamplingParams

    measured = results.read("bandwidth")
    gb_per_s = measured[-1]["gb_per_s"] if measured else None
    config = model_config(args.tiny)
    prompt_len = config.block_size // 8  # 128 of GPT-2's 1,024
    prompt = [random.Random(0).randrange(config.vocab_size) for _ in range(prompt_len)]
    new = config.block_size - prompt_len
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    dtypes = ["float32"] if args.tiny else ["float32", "bfloat16"]
    for name in dtypes:
        model = random_model(config, args.device, pick_dtype(name, args.device))
        oracle = generate(model, prompt, params, use_cache=False).token_ids
        runs = []
        for _ in range(2):  # the first compiles (and captures), the second is timed
            cache = StaticKVCache(model, batch_size=1, max_len=config.block_size)
            synchronize(args.device)
            started = time.perf_counter()
            result = generate(model, prompt, params, cache=cache, compile="default")
            synchronize(args.device)
            runs.append((time.perf_counter() - started, result))
        seconds, result = runs[-1]
        tok_s = len(result.token_ids) / seconds
        itemsize = next(model.parameters()).element_size()
        weights = model.num_params(non_embedding=False) * itemsize
        kv_per_position = 2 * config.n_layer * config.n_embd * itemsize
        mean_context = (prompt_len + config.block_size) / 2
        bytes_per_token = weights + kv_per_position * mean_context
        roofline = gb_per_s * 1e9 / bytes_per_token if gb_per_s else None
        results.add(
            "decode",
            dtype=name,
            tokens=len(result.token_ids),
            tok_s=round(tok_s, 1),
            bytes_per_token=int(bytes_per_token),
            roofline_tok_s=round(roofline, 1) if roofline else None,
            fraction_of_roofline=round(tok_s / roofline, 3) if roofline else None,
            tokens_equal_oracle=result.token_ids == oracle,
        )


def engine(args: argparse.Namespace, results: Results) -> None:
    """The engine offline: FlexAttention + CUDA graphs, the old eager engine, transformers."""
    from roseinfer.engine import LLM
    from roseinfer.request.sampling import SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 as the CPU computes it
    torch.backends.cudnn.allow_tf32 = False
    config = model_config(args.tiny)
    num, new = (4, 4) if args.tiny else (256, 128)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(config.vocab_size) for _ in range(rng.randrange(16, 64))] for _ in range(num)
    ]
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    model = random_model(config, args.device, torch.float32)
    tokenizer = Tokenizer("gpt2")
    max_num_seqs = num
    # The quick figures first (a run cut short keeps them): the engine as it ran before,
    # transformers, then the GPU default (attention "auto" is flex on CUDA, with decode
    # CUDA graphs), which compiles and captures first.
    setups = {
        "rose eager (before)": dict(attention="gather", enforce_eager=True),
        "rose": dict(attention="flex"),
    }
    tokens = {}
    for label, settings in setups.items():
        if label == "rose":
            try:  # (a failure there is one figure lost: rose's own still comes)
                hf_generate_batch(model, prompts, new, args, results)
            except Exception as error:  # noqa: BLE001
                results.add("engine", run="transformers generate_batch", failed=one_line(error))
        started = time.perf_counter()
        llm = LLM.from_model(model, tokenizer, max_num_seqs=max_num_seqs, **settings)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up (compiles, captures)
        warm_s = time.perf_counter() - started
        synchronize(args.device)
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        synchronize(args.device)
        seconds = time.perf_counter() - started
        tokens[label] = [out.token_ids for out in outputs]
        made = sum(map(len, tokens[label]))
        results.add(
            "engine", run=label, requests=num, tok_s=round(made / seconds, 1),
            seconds=round(seconds, 2), startup_and_warmup_s=round(warm_s, 1),
        )  # fmt: skip
        del llm
    same = sum(a == b for a, b in zip(*tokens.values(), strict=True))
    results.add("engine", run="tokens", requests_equal_to_eager=same, requests=num)


def hf_generate_batch(
    model: GPT, prompts: list[list[int]], new: int, args: argparse.Namespace, results: Results
) -> None:
    """transformers' continuous batching on the same weights, where it is installed."""
    try:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        from rosetrainer.hf import to_hf_gpt2
    except ImportError as error:
        results.add("engine", run="transformers generate_batch", skipped=str(error))
        return
    hf = to_hf_gpt2(model).eval()
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # Its own sizing on a GPU; tiny, a small cache (sized for a GPU, one CPU call takes ~35 s).
    small = ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=256)
    options = dict(
        generation_config=config, continuous_batching_config=small if args.tiny else None
    )
    hf.generate_batch(prompts[:2], **options)  # warm-up
    synchronize(args.device)
    started = time.perf_counter()
    outputs = hf.generate_batch(prompts, **options)
    synchronize(args.device)
    seconds = time.perf_counter() - started
    made = sum(len(out.generated_tokens) for out in outputs.values())
    results.add(
        "engine", run="transformers generate_batch", requests=len(prompts),
        tok_s=round(made / seconds, 1), seconds=round(seconds, 2),
    )  # fmt: skip


def serve(args: argparse.Namespace, results: Results) -> None:
    """rose-serve with and without decode CUDA graphs, 64 clients x 128 tokens at once."""
    config = model_config(args.tiny)
    clients, new = (4, 8) if args.tiny else (64, 128)
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = Path(scratch) / "gpt2.pt"
        model = random_model(config, torch.device("cpu"), torch.float32)
        state = {"model": model.state_dict(), "model_config": model.config.to_dict()}
        save_checkpoint(checkpoint, {**state, "tokenizer_name": "gpt2"})
        # (the default replays decode steps as CUDA graphs on a GPU; a CPU has none)
        for label, flags in (("default", []), ("enforce-eager", ["--enforce-eager"])):
            lengths = (config.block_size // 8, new)  # prompt (about), output
            figures = serve_run(checkpoint, flags, clients, lengths, args, Path(scratch) / label)
            results.add("serve", run=label, clients=clients, max_tokens=new, **figures)


def serve_run(
    checkpoint: Path, flags: list[str], clients: int, lengths: tuple[int, int],
    args: argparse.Namespace, scratch: Path,
) -> dict[str, object]:  # fmt: skip
    """One server up, one burst of `clients` streaming requests through benchmarks.serving."""
    scratch.mkdir()
    command = [
        sys.executable, "-m", "roseinfer.cli.serve", "--checkpoint-path", str(checkpoint),
        "--port", "0", "--device", str(args.device), "--max-num-seqs", str(clients), *flags,
    ]  # fmt: skip
    log = (scratch / "server.log").open("wb")
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log)
    try:
        started, url = time.perf_counter(), None
        for line in server.stdout:
            match = READY.search(line.decode(errors="replace"))
            if match:
                url = match.group(1)
                break
        if url is None:
            raise RoseError(f"rose-serve did not start: {(scratch / 'server.log').read_text()}")
        ready_s = time.perf_counter() - started
        out = scratch / "serving.json"
        bench = [
            sys.executable, "-m", "benchmarks.serving", "--base-url", url + "/v1", "--random",
            "--request-rate", "inf", "--num-prompts", str(clients), "--input-len",
            str(lengths[0]), "--output-len", str(lengths[1]), "--json", str(out), "--plot", "",
            "--quiet",
        ]  # fmt: skip
        subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
        (rate,) = json.loads(out.read_text())["results"]["server"]
        return dict(
            startup_s=round(ready_s, 1),
            completed=rate["completed"],
            output_tok_s=round(rate["output_throughput"], 1),
            ttft_p99_ms=round(rate["ttft_ms"]["p99"], 1),
        )
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=STAGES)
    p.add_argument("--results", required=True, help="the file each figure is appended to")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a dry run on the CPU)")
    return p


def run(args: argparse.Namespace) -> int:
    args.device = pick_device(args.device)
    if args.device.type == "cuda" and args.device.index is None:
        args.device = torch.device("cuda", torch.cuda.current_device())
    results = Results(Path(args.results), args.device)
    {"bandwidth": bandwidth, "decode": decode, "engine": engine, "serve": serve}[args.stage](
        args, results
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: run(build_parser().parse_args(argv)), PROG)


if __name__ == "__main__":
    sys.exit(main())
