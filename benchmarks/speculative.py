"""python -m benchmarks.speculative: speculative decoding against plain decoding, in one run.

One process times, interleaved round by round, greedy decoding of the same prompts
without drafts and with each drafter (a draft model when --draft-path is given, prompt
lookup, the target's own first --self-layers layers), and prints side by side:

1. single stream (the teaching loop on a static cache, batch 1): tokens/s without and
   with each drafter, the speedup, the acceptance rate, the mean accepted length (tokens
   a verify step makes), and whether the tokens are the plain run's (they must be);
   on two workloads: `continue` (a passage of --text-file, the model continues it) and
   `grounded` (the passage, then its first line again: a model that copies what it was
   given lets prompt lookup draft the rest);
2. the speedup and acceptance over k = 1 .. 8 for each drafter (continue workload);
3. the engine (`LLM`, paged pool, continuous batching) at batch 1, 4 and 16: generated
   tokens/s without and with each drafter;
4. why: the target's verify call of k + 1 tokens against its one-token step over the same
   cache, and the drafter's cost per drafted token, each as a multiple of that step;
5. beside it, Hugging Face `transformers` on the same weights (when installed): plain
   greedy `generate`, assisted generation with the draft model (`assistant_model=`) and
   prompt lookup (`prompt_lookup_num_tokens=`), single stream, both workloads.

With acceptance a and k drafts, a verify step makes (1 - a^(k+1)) / (1 - a) tokens in
about (verify cost + k * draft cost) one-token steps; section 4 gives those costs, so
a missed speedup can be read off them. --quick runs tiny random models (a smoke test:
its figures mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from roseinfer.cache.dense import StaticKVCache
from roseinfer.engine.llm import LLM
from roseinfer.loading import load_model_and_tokenizer
from roseinfer.loops.generate import generate
from roseinfer.loops.speculative import speculative_generate
from roseinfer.request.sampling import SamplingParams
from roseinfer.request.sequence import Sequence
from roseinfer.speculative.drafters import (
    Drafter,
    ModelDrafter,
    NgramDrafter,
    SpeculativeConfig,
    first_layers,
)
from roseinfer.speculative.verify import SpeculativeStats
from rosetrainer.config import GPTConfig
from rosetrainer.errors import ArgumentParser, RoseError, run_cli
from rosetrainer.model import GPT
from rosetrainer.tokenizer import Tokenizer

QUICK_TEXT = "ROMEO: But soft, what light through yonder window breaks? " * 8


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="benchmarks.speculative", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-path", help="the target: a rose checkpoint or run directory")
    p.add_argument("--draft-path", help="a smaller draft model sharing the target's tokenizer")
    p.add_argument("--self-layers", type=int, help="self-draft layers (default: a quarter)")
    p.add_argument("--text-file", help="the text the prompts are cut from (TinyShakespeare)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="k (default: 4)")
    p.add_argument("--ngram-max", type=int, default=4, help="prompt lookup's longest n-gram")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", default="1,4,16", help="the engine's batches")
    p.add_argument("--max-k", type=int, default=8, help="the k curve runs k = 1 .. this")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians reported")
    p.add_argument("--quick", action="store_true", help="tiny random models: a smoke test")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.prompt_tokens, args.new_tokens, args.rounds = 24, 12, 1
        args.batch_sizes, args.max_k = "1,2", 2
    elif args.checkpoint_path is None or args.text_file is None:
        raise RoseError("give --checkpoint-path (the target) and --text-file, or --quick")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    return args


def load(args: argparse.Namespace) -> tuple[GPT, GPT | None, Tokenizer, str]:
    """The target, the draft model (or None), the tokenizer and the text."""
    tokenizer = Tokenizer("gpt2")
    if args.quick:
        torch.manual_seed(0)
        shape = dict(vocab_size=tokenizer.n_vocab, block_size=128, n_head=2, n_embd=32)
        target = GPT(GPTConfig(n_layer=4, **shape)).eval()
        draft = GPT(GPTConfig(n_layer=1, **shape)).eval()
        return target, draft, tokenizer, QUICK_TEXT
    target, tokenizer, _ = load_model_and_tokenizer(args.checkpoint_path)
    draft = None
    if args.draft_path is not None:
        draft, _, _ = load_model_and_tokenizer(args.draft_path)
    with open(args.text_file, encoding="utf-8") as f:
        return target, draft, tokenizer, f.read()


def prompts(tokenizer: Tokenizer, text: str, n: int, length: int) -> dict[str, list[list[int]]]:
    """n prompts per workload, from passages spread through the text."""
    ids = tokenizer.encode(text)
    step = max(1, (len(ids) - length) // n)
    passages = [ids[i * step : i * step + length] for i in range(n)]
    newline = tokenizer.encode("\n\n")
    return {
        "continue": passages,
        "grounded": [p + newline + p[: max(1, length // 8)] for p in passages],
    }


@dataclass
class Run:
    tokens_per_s: float
    tokens: list[list[int]]
    stats: SpeculativeStats | None


def median_run(runs: list[Run]) -> Run:
    speeds = [r.tokens_per_s for r in runs]
    return Run(statistics.median(speeds), runs[0].tokens, runs[0].stats)


def timed(fn: Callable[[], tuple[list[list[int]], SpeculativeStats | None]]) -> Run:
    started = time.perf_counter()
    tokens, stats = fn()
    elapsed = time.perf_counter() - started
    return Run(sum(map(len, tokens)) / elapsed, tokens, stats)


def single_stream(
    target: GPT, drafter: Drafter | None, prompt: list[int], new_tokens: int, k: int
) -> Run:
    params = SamplingParams(max_tokens=new_tokens)
    cache = StaticKVCache(target)

    def run() -> tuple[list[list[int]], SpeculativeStats | None]:
        if drafter is None:
            return [generate(target, prompt, params, cache=cache).token_ids], None
        stats = SpeculativeStats()
        result = speculative_generate(
            target, drafter, prompt, params, num_speculative_tokens=k, cache=cache, stats=stats
        )
        return [result.token_ids], stats

    return timed(run)


def drafters(target: GPT, draft: GPT | None, args: argparse.Namespace) -> dict[str, Drafter]:
    found: dict[str, Drafter] = {}
    if draft is not None:
        found["draft model"] = ModelDrafter(draft)
    found["prompt lookup"] = NgramDrafter(1, args.ngram_max)
    layers = args.self_layers or max(1, target.config.n_layer // 4)
    found[f"self, {layers} of {target.config.n_layer}"] = ModelDrafter(first_layers(target, layers))
    return found


def row(cells: list[object], widths: list[int]) -> str:
    return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True))


def rate(stats: SpeculativeStats | None) -> tuple[str, str]:
    if stats is None or not stats.num_drafts:
        return "-", "-"
    return f"{stats.acceptance_rate:.0%}", f"{stats.mean_accepted_length:.2f}"


def single_stream_table(target, kinds, workloads, args) -> None:
    widths = [10, 20, 10, 8, 8, 8, 6]
    print(
        f"\n1. single stream, k = {args.num_speculative_tokens} (tokens/s, medians of {args.rounds})"
    )
    print(
        row(["workload", "drafts", "tokens/s", "speedup", "accepted", "mean len", "same"], widths)
    )
    for workload, (prompt, *_) in workloads.items():
        results: dict[str, list[Run]] = {name: [] for name in ["none", *kinds]}
        for _ in range(args.rounds):  # interleaved: a slow moment hurts every column alike
            for name in results:
                drafter = kinds.get(name)
                k = args.num_speculative_tokens
                results[name].append(single_stream(target, drafter, prompt, args.new_tokens, k))
        base = median_run(results["none"])
        for name, runs in results.items():
            run = median_run(runs)
            accepted, mean = rate(run.stats)
            speedup = f"{run.tokens_per_s / base.tokens_per_s:.2f}x"
            same = run.tokens == base.tokens
            print(
                row(
                    [workload, name, f"{run.tokens_per_s:.1f}", speedup, accepted, mean, same],
                    widths,
                )
            )


def k_curve_table(target, kinds, workloads, args) -> None:
    prompt = workloads["continue"][0]
    widths = [20, 4, 10, 8, 8, 8]
    print("\n2. over k (continue workload)")
    print(row(["drafts", "k", "tokens/s", "speedup", "accepted", "mean len"], widths))
    base = median_run(
        [single_stream(target, None, prompt, args.new_tokens, 1) for _ in range(args.rounds)]
    )
    for name, drafter in kinds.items():
        for k in range(1, args.max_k + 1):
            runs = [
                single_stream(target, drafter, prompt, args.new_tokens, k)
                for _ in range(args.rounds)
            ]
            run = median_run(runs)
            accepted, mean = rate(run.stats)
            speedup = f"{run.tokens_per_s / base.tokens_per_s:.2f}x"
            print(row([name, k, f"{run.tokens_per_s:.1f}", speedup, accepted, mean], widths))


def engine_table(target, draft, tokenizer, workloads, args) -> None:
    k = args.num_speculative_tokens
    configs = {"none": None}
    if draft is not None:
        configs["draft model"] = SpeculativeConfig(k, "draft", model="(in memory)")
    configs["prompt lookup"] = SpeculativeConfig(k, "ngram", ngram_max=args.ngram_max)
    layers = args.self_layers or max(1, target.config.n_layer // 4)
    configs[f"self, {layers} of {target.config.n_layer}"] = SpeculativeConfig(
        k, "self", self_layers=layers
    )
    widths = [8, 20, 10, 8, 8, 8]
    print(f"\n3. the engine, continue workload, k = {k} (generated tokens/s)")
    print(row(["batch", "drafts", "tokens/s", "speedup", "accepted", "mean len"], widths))
    params = SamplingParams(max_tokens=args.new_tokens)
    for batch in args.batch_sizes:
        batch_prompts = workloads["continue"][:batch]
        base = None
        for name, spec in configs.items():
            llm = LLM.from_model(target, tokenizer, spec, draft, max_num_seqs=max(batch, 1))
            run = functools.partial(engine_run, llm, batch_prompts, params)
            result = median_run([timed(run) for _ in range(args.rounds)])
            base = base or result
            accepted, mean = rate(result.stats)
            speedup = f"{result.tokens_per_s / base.tokens_per_s:.2f}x"
            print(row([batch, name, f"{result.tokens_per_s:.1f}", speedup, accepted, mean], widths))


def engine_run(
    llm: LLM, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[list[int]], SpeculativeStats | None]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.token_ids for o in outputs], llm.engine.stats().speculative


@torch.inference_mode()
def cost_table(target, kinds, workloads, args) -> None:
    """The target's verify call against its one-token step, and each drafter's cost per
    drafted token, as multiples of that step (median of many calls over one cache)."""
    prompt = workloads["continue"][0]
    k = args.num_speculative_tokens
    cache = StaticKVCache(target)

    def step_seconds(q_len: int) -> float:
        times = []
        for _ in range(max(5, 5 * args.rounds)):
            cache.reset()
            target(torch.tensor([prompt]), cache=cache)
            ids = torch.tensor([prompt[:q_len]])
            started = time.perf_counter()
            target(ids, cache=cache, last_only=q_len == 1)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    one = step_seconds(1)
    print(f"\n4. costs, in one-token target steps ({one * 1000:.2f} ms over {len(prompt)} tokens)")
    print(f"verify call of k + 1 = {k + 1} tokens: {step_seconds(k + 1) / one:.2f}")
    for name, drafter in kinds.items():
        seq_runs = []
        for _ in range(max(3, args.rounds)):
            seq = Sequence(list(prompt), SamplingParams(max_tokens=k + 1))
            drafter.propose([seq], [k])  # (the first call reads the prompt)
            seq.output_ids.append(prompt[0])  # one more token: the next call drafts anew
            started = time.perf_counter()
            drafter.propose([seq], [k])
            seq_runs.append(time.perf_counter() - started)
            drafter.release(seq)
        print(f"{name}: {statistics.median(seq_runs) / k / one:.2f} per drafted token")


def hf_table(target, draft, workloads, args) -> None:
    """transformers' generate on the same weights: plain, assisted by the draft model,
    prompt lookup; tokens/s and whether its tokens are rose's plain greedy ones."""
    try:
        from transformers.utils import logging as hf_logging

        from rosetrainer.hf import to_hf_gpt2
    except ImportError:
        print("\n5. Hugging Face: transformers is not installed, skipped")
        return
    hf_logging.set_verbosity_error()  # (its notes on how generate's arguments combine)
    k = args.num_speculative_tokens
    hf_target = to_hf_gpt2(target).eval()
    ways: dict[str, dict[str, object]] = {"none": {}}
    if draft is not None:
        ways["assistant model"] = {"assistant_model": to_hf_gpt2(draft).eval()}
    ways["prompt lookup"] = {"prompt_lookup_num_tokens": k}
    widths = [10, 20, 10, 8, 6]
    print(f"\n5. Hugging Face transformers, single stream, k = {k} (tokens/s)")
    print(row(["workload", "drafts", "tokens/s", "speedup", "same"], widths))
    for workload, (prompt, *_) in workloads.items():
        want = single_stream(target, None, prompt, args.new_tokens, 1).tokens
        base = None
        for name, extra in ways.items():
            run = functools.partial(hf_generate, hf_target, prompt, args.new_tokens, extra)
            result = median_run([timed(run) for _ in range(args.rounds)])
            base = base or result
            speedup = f"{result.tokens_per_s / base.tokens_per_s:.2f}x"
            same = result.tokens == want
            print(row([workload, name, f"{result.tokens_per_s:.1f}", speedup, same], widths))


@torch.inference_mode()
def hf_generate(
    hf_model: torch.nn.Module, prompt: list[int], n: int, extra: dict[str, object]
) -> tuple[list[list[int]], None]:
    """Greedy, exactly n new tokens (end-of-text does not stop it, as in rose's runs here)."""
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
        do_sample=False, pad_token_id=0, **extra,
    )  # fmt: skip
    return [out[0, len(prompt) :].tolist()], None


def bench(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    target, draft, tokenizer, text = load(args)
    n = max(args.batch_sizes)
    workloads = prompts(tokenizer, text, n, args.prompt_tokens)
    if args.prompt_tokens * 2 + args.new_tokens > target.config.block_size:
        raise RoseError(
            f"the grounded prompt (about 2 x {args.prompt_tokens} tokens) and {args.new_tokens} "
            f"new tokens exceed the context ({target.config.block_size}): shorten them"
        )
    kinds = drafters(target, draft, args)
    single_stream(target, None, workloads["continue"][0], args.new_tokens, 1)  # warm-up
    print(f"target: {target.config.n_layer} layers x {target.config.n_embd}; threads: "
          f"{torch.get_num_threads()}; {args.new_tokens} new tokens per prompt")  # fmt: skip
    single_stream_table(target, kinds, workloads, args)
    k_curve_table(target, kinds, workloads, args)
    engine_table(target, draft, tokenizer, workloads, args)
    cost_table(target, kinds, workloads, args)
    hf_table(target, draft, workloads, args)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: bench(argv), "benchmarks.speculative")


if __name__ == "__main__":
    raise SystemExit(main())
