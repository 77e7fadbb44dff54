"""python -m benchmarks.serving_compare: rose's server next to `transformers serve` and
`vllm serve`, one run.

    flock /tmp/rose-bench.lock python -m benchmarks.serving_compare
    python -m benchmarks.serving_compare --servers rose,vllm

On one randomly initialised GPT-2 small (124M) saved as a Hugging Face directory (with
GPT-2's own tokenizer, built from tiktoken's BPE files, so it needs no download), it
starts each server in turn, sends the same prompts at the same Poisson arrival times
with bench_serving, stops it, and prints one table and the ratios that matter:

* rose (continuous batching, paged KV, prefix caching) vs
  `transformers serve --continuous-batching` on the same directory, rates light to
  saturating: output tokens/s at saturation, TTFT p99 at every rate;
* rose vs `vllm serve` (--servers ...,vllm; vLLM's CPU build in its own venv, made by
  .ci/vllm-venv, float32 as rose serves, its threads bound as benchmarks/vllm_venv.py
  says): output tokens/s at saturation, TTFT p99 at every rate;
* rose with one request at a time (--max-num-seqs 1): the floor batching lifts;
* rose with a long shared prefix (--shared-prefix-len), prefix caching on vs off:
  TTFT p50.

Needs the [bench] extra (transformers with its serving extra, tokenizers, matplotlib).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

from benchmarks import serving as bench_serving
from benchmarks import vllm_venv
from benchmarks.serving import RateResult
from rosetrainer.errors import ArgumentParser, RoseError, run_cli

PROG = "bench_serving_compare"
# Where tiktoken reads GPT-2's BPE: the same two files Hugging Face calls
# vocab.json (encoder.json here) and merges.txt (vocab.bpe here).
GPT2_BPE_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
READY_TIMEOUT_S = 300
VLLM_KV_CACHE_GIB = 4  # vLLM's KV pool (VLLM_CPU_KVCACHE_SPACE), allocated whole at startup


def make_hf_gpt2_dir(directory: Path) -> Path:
    """A random GPT-2 small and GPT-2's tokenizer, saved by save_pretrained (kept for reuse)."""
    if (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file():
        return directory
    from tiktoken.load import read_file_cached
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config()).save_pretrained(directory)
    with tempfile.TemporaryDirectory() as tmp:
        vocab, merges = Path(tmp, "vocab.json"), Path(tmp, "merges.txt")
        try:
            vocab.write_bytes(read_file_cached(GPT2_BPE_URL + "encoder.json"))
            merges.write_bytes(read_file_cached(GPT2_BPE_URL + "vocab.bpe"))
        except Exception as err:  # tiktoken tried to download them
            raise RoseError(
                f"GPT-2's BPE files are not in tiktoken's cache ({type(err).__name__}): "
                f"export TIKTOKEN_CACHE_DIR=$PWD/../shared/tiktoken_cache"
            ) from None
        bpe = ByteLevelBPETokenizer(str(vocab), str(merges), add_prefix_space=False)
    eot = "<|endoftext|>"
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token=eot, eos_token=eot, unk_token=eot
    )
    tokenizer.save_pretrained(directory)
    return directory


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def server_process(
    command: list[str],
    log: Path,
    base_url: str | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """Start a server, wait until GET /health answers 200, yield its /v1 URL, always stop it.

    base_url None: the command is rose's, which prints its URL when ready; otherwise its
    stdout goes to the log too (vLLM logs there: an unread pipe would fill and stall it).
    env: the server's environment (default: this process's)."""
    with open(log, "wb") as out:
        stdout = subprocess.PIPE if base_url is None else out
        process = subprocess.Popen(
            command, stdout=stdout, stderr=out, start_new_session=True, env=env
        )
    # A benchmark stopped by SIGTERM (`timeout`, a CI job's end) stops its server too: the
    # server runs in a session of its own, so nothing else would, and Python's default for
    # SIGTERM ends this process without running the `finally` below.
    previous = signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        if base_url is None:
            line = process.stdout.readline().decode()
            if " at http" not in line:
                raise RoseError(f"{command[2]} did not start; see {log}")
            base_url = line.split(" at ")[1].split()[0]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RoseError(f"{' '.join(command[:3])} exited early; see {log}")
            try:
                health = base_url.removesuffix("/v1") + "/health"
                if httpx.get(health, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RoseError(f"{' '.join(command[:3])} not ready after {READY_TIMEOUT_S} s")
            time.sleep(0.5)
        yield base_url
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if process.stdout is not None:
            process.stdout.close()
        signal.signal(signal.SIGTERM, previous)


def stop_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def rose_command(model_dir: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "roseinfer.cli.serve", "--hf-model", str(model_dir), "--port", "0",
            "--served-model-name", "gpt2-random", "--device", "cpu", *flags]  # fmt: skip


def run_load(base_url: str, args: argparse.Namespace, **changes: object) -> list[RateResult]:
    settings = {**vars(args), "base_url": base_url, "model": None, **changes}
    load = argparse.Namespace(**settings)
    print(f"[{PROG}] {load.label}: {base_url}", flush=True)
    return bench_serving.benchmark(load)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 and not math.isnan(a) else "n/a"


# The servers rose is held against, each with its name in the table and its target
# (rose's output tokens/s at saturation over the peer's).
PEERS = {"transformers": ("transformers serve", 2.0), "vllm": ("vllm serve", 1.3)}


def report(results: dict[str, list[RateResult]], prefix: dict[str, list[RateResult]]) -> str:
    lines = [bench_serving.table(results), ""]
    rose, floor = results.get("rose"), results.get("rose-1-seq")
    for peer, (name, target) in PEERS.items():
        theirs = results.get(peer)
        if not (rose and theirs):
            continue
        sat_rose, sat_peer = rose[-1].output_throughput, theirs[-1].output_throughput
        lines.append(
            f"saturation (rate {rose[-1].request_rate:g}): rose {sat_rose:.1f} out tok/s, "
            f"{name} {sat_peer:.1f}: {ratio(sat_rose, sat_peer)} (target >= {target:g}x)"
        )
        for r, p in zip(rose, theirs, strict=True):
            lower = "lower" if r.ttft_ms["p99"] < p.ttft_ms["p99"] else "NOT lower"
            lines.append(
                f"rate {r.request_rate:g}: TTFT p99 rose {r.ttft_ms['p99']:.0f} ms vs {peer} "
                f"{p.ttft_ms['p99']:.0f} ms ({ratio(r.ttft_ms['p99'], p.ttft_ms['p99'])}, {lower})"
            )
    if rose and floor:
        lines.append(
            f"batching: rose {rose[-1].output_throughput:.1f} vs one at a time "
            f"{floor[-1].output_throughput:.1f} out tok/s at saturation: "
            f"{ratio(rose[-1].output_throughput, floor[-1].output_throughput)}"
        )
    if len(prefix) == 2:
        on, off = prefix["prefix cache on"][0], prefix["prefix cache off"][0]
        lines.append(
            f"shared prefix: TTFT p50 with prefix caching {on.ttft_ms['p50']:.0f} ms, without "
            f"{off.ttft_ms['p50']:.0f} ms: {ratio(on.ttft_ms['p50'], off.ttft_ms['p50'])} "
            f"(target <= 0.3x)"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m benchmarks.serving_compare", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--model-dir",
        default="checkpoints/hf-gpt2-random",
        help="the Hugging Face directory (made on first use; default: %(default)s)",
    )
    p.add_argument(
        "--servers",
        default="rose,transformers,rose-1-seq,prefix",
        help="which runs, comma-separated, of rose, transformers, vllm, rose-1-seq, prefix "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--shared-prefix-len",
        type=int,
        default=512,
        help="the prefix run's shared prefix, tokens (default: 512)",
    )
    p.add_argument(
        "--prefix-rate",
        type=float,
        default=1.0,
        help="the prefix run's request rate (default: 1/s: TTFT without queueing)",
    )
    p.add_argument("--out-dir", default="bench_serving_results", help="JSON, plot and logs")
    bench_serving.add_load_arguments(p)
    p.set_defaults(request_rate=[0.5, 2.0, math.inf], num_prompts=16, input_len=64,
                   output_len=32, quiet=False)  # fmt: skip
    return p


def run(args: argparse.Namespace) -> int:
    bench_serving.check(args)
    runs = args.servers.split(",")
    unknown = set(runs) - {"rose", "transformers", "vllm", "rose-1-seq", "prefix"}
    if unknown:
        raise RoseError(f"--servers: unknown run(s) {', '.join(sorted(unknown))}")
    if "transformers" in runs and shutil.which("transformers") is None:
        raise RoseError("no `transformers` command: pip install -e '.[bench]'")
    vllm_python = vllm_venv.require_vllm_python() if "vllm" in runs else None
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = make_hf_gpt2_dir(Path(args.model_dir))
    # The servers decode with the same tokenizer the prompts were made with (GPT-2's).
    args.api_key = None
    results: dict[str, list[RateResult]] = {}
    prefix: dict[str, list[RateResult]] = {}
    started = time.perf_counter()
    if "rose" in runs:
        with server_process(rose_command(model_dir), out / "rose.log") as url:
            results["rose"] = run_load(url, args, label="rose", ignore_eos=True)
    if "transformers" in runs:
        port = free_port()
        command = ["transformers", "serve", "--continuous-batching", "--port", str(port),
                   "--host", "127.0.0.1", "--device", "cpu", str(model_dir)]  # fmt: skip
        url = f"http://127.0.0.1:{port}/v1"
        with server_process(command, out / "transformers.log", base_url=url):
            # transformers serve knows no ignore_eos; a random GPT-2 rarely ends its text
            # anyway, and output tokens are counted from what each server reports.
            # Its /v1/models fails without a Hub cache; the model is named by its directory.
            results["transformers"] = run_load(
                url, args, label="transformers", ignore_eos=False, model=str(model_dir)
            )
    if vllm_python is not None:
        port = free_port()
        command = vllm_venv.serve_command(vllm_python, model_dir, port, "--dtype", "float32",
                                          "--served-model-name", "gpt2-random")  # fmt: skip
        url = f"http://127.0.0.1:{port}/v1"
        env = vllm_venv.vllm_env(vllm_python, VLLM_KV_CACHE_GIB)
        with server_process(command, out / "vllm.log", base_url=url, env=env):
            results["vllm"] = run_load(url, args, label="vllm", ignore_eos=True)
    if "rose-1-seq" in runs:
        with server_process(rose_command(model_dir, "--max-num-seqs", "1"), out / "1seq.log") as u:
            results["rose-1-seq"] = run_load(u, args, label="rose-1-seq", ignore_eos=True)
    if "prefix" in runs:
        for name, flags in (
            ("prefix cache on", ()),
            ("prefix cache off", ("--no-prefix-caching",)),
        ):
            with server_process(rose_command(model_dir, *flags), out / "prefix.log") as url:
                prefix[name] = run_load(
                    url, args, label=name, prefix_len=args.shared_prefix_len, input_len=32, range_ratio=0.25,
                    output_len=16, request_rate=[args.prefix_rate], ignore_eos=True,
                )  # fmt: skip
    print(report(results, prefix))
    print(f"[{PROG}] {time.perf_counter() - started:.0f} s in all")
    bench_serving.save_json({**results, **prefix}, out / "results.json", args)
    if results:
        bench_serving.plot(results, out / "latency_vs_rate.png")
    print(f"[{PROG}] wrote {out}/results.json, latency_vs_rate.png and the servers' logs")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: run(build_parser().parse_args(argv)), PROG)


if __name__ == "__main__":
    sys.exit(main())
