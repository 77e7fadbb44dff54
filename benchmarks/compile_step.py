"""python -m benchmarks.compile_step: torch.compile of the engine's decode step against
eager (issue 44, item 6: "compiled where it pays"), on a CPU.

    python -m benchmarks.compile_step                  # both parts, float32 and bfloat16
    python -m benchmarks.compile_step --part products  # only the products
    python -m benchmarks.compile_step --part step --dtypes float32 --seqs 32
    python -m benchmarks.compile_step --quick          # a tiny model (a smoke test)

Two parts, each timing its variants interleaved round by round in one process (the
medians are printed, so a neighbour's load falls on every variant alike):

* products: GPT-2 124M's products for a decode batch of M rows (x (M, 768) times the
  weights of 12 layers, distinct so that none stays in cache: 768x2304, 768x768,
  768x3072, 3072x768, and the 768x50257 vocabulary projection once), in GFLOP/s: the
  weight packed once for oneDNN (what the engine runs, roseinfer/engine/packed.py),
  PyTorch's product on the weight as stored, and `F.linear` compiled by inductor with
  its weights frozen (`torch._inductor.config.freezing`) in the "default" and
  "max-autotune" modes (the latter picks between its own generated C++ GEMM and the
  library's, by timing both), with each compile's seconds.
* step: the engine's decode step at 32 and 64 running sequences (prompts of 200 random
  tokens, as benchmarks.engine's decode floor builds them), eager as the engine runs it
  against the whole model forward compiled into one graph. The step's bookkeeping
  (positions, pool slots, block tables) is done in Python before the compiled region,
  the decode batch padded to a bucket (a multiple of --bucket, default 8: padded rows
  write their keys to one reserved scratch block and are dropped), the block tables to
  the model's whole context (so neither a new batch size inside a bucket nor a sequence
  growing a block recompiles); the paged attention kernel (roseinfer/cache/kernels.py)
  and the pool write before it run as one custom op (`rose_bench::paged_write_attend`,
  defined here, with a fake implementation for tracing). Compiled variants: the plain
  model (inductor's own products) in "default" and "max-autotune" mode, and the model
  with its linears packed for oneDNN as the engine's are (inductor fusing everything
  between the products), in "default" mode; all with freezing. It prints the median
  engine step and model time of each, the ratio to eager, each variant's compile
  seconds, then whether a batch size inside the bucket, and one in the next bucket,
  recompile, and what a padded step costs beside eager at the real size.

Equality (float32): over several steps, each compiled variant's greedy next tokens are
compared with eager's on the same state, and its logits with the uncached model's (the
whole sequence through `GPT.forward` with no cache) within rosetrainer.numerics'
tolerance.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from benchmarks.engine import add
from rosecourse.demo import wide_random_init
from roseinfer.cache import kernels
from roseinfer.cache.paged import write_slots
from roseinfer.engine.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.engine.model_runner import ModelRunner
from roseinfer.engine.packed import bfloat16_packing_supported, can_pack, packed_linears
from roseinfer.engine.sequence import EngineSequence
from rosetrainer.config import GPTConfig
from rosetrainer.errors import ArgumentParser, RoseError, run_cli
from rosetrainer.model import GPT
from rosetrainer.numerics import logit_tolerance
from rosetrainer.tokenizer import Tokenizer

PROG = "benchmarks.compile_step"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QUICK_CONFIG = GPTConfig(vocab_size=50257, block_size=128, n_layer=2, n_head=2, n_embd=64)


def allow_many_graphs() -> None:
    """Every variant, dtype and bucket compiles the same Python functions again: lift
    dynamo's per-function limit (8), past which it would quietly run eager."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, 256)
    if hasattr(dynamo_config, "accumulated_recompile_limit"):
        dynamo_config.accumulated_recompile_limit = 4096


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compiled(module: nn.Module, mode: str) -> nn.Module:
    """The module compiled by inductor with its weights frozen into the graph, one graph
    per input shape (no dynamic shapes)."""
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    return torch.compile(module, mode=mode, dynamic=False, fullgraph=True)


def median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


# ---------------------------------------------------------------------------
# Part 1: the products
# ---------------------------------------------------------------------------

# (name, in_features, out_features, how many distinct weights): GPT-2 124M's
PRODUCTS = [
    ("qkv", 768, 2304, 12),
    ("attn proj", 768, 768, 12),
    ("mlp fc", 768, 3072, 12),
    ("mlp proj", 3072, 768, 12),
    ("lm head", 768, 50257, 1),
]
QUICK_PRODUCTS = [("qkv", 64, 192, 2), ("lm head", 64, 512, 1)]


class Linears(nn.Module):
    """Several weights of one shape, each multiplying the same rows (as F.linear)."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> None:
        super().__init__()
        self.w = nn.ParameterList([nn.Parameter(w, requires_grad=False) for w in weights])
        self.b = [None if b is None else nn.Parameter(b, requires_grad=False) for b in biases]
        for i, b in enumerate(self.b):
            if b is not None:
                self.register_parameter(f"b{i}", b)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [F.linear(x, w, b) for w, b in zip(self.w, self.b, strict=True)]


def products(rows: list[int], dtypes: list[str], rounds: int, quick: bool) -> None:
    shapes = QUICK_PRODUCTS if quick else PRODUCTS
    say(
        "products: GFLOP/s of x (rows, in) times every weight of one shape (distinct weights: "
        "nothing stays in cache); compile s: default / max-autotune"
    )
    header = f"{'product':<10}{'shape':>11}{'rows':>6}{'dtype':>10}"
    header += f"{'packed':>8}{'plain':>8}{'default':>9}{'autotune':>10}{'best/packed':>13}{'compile s':>12}"
    say(header)
    generator = torch.Generator().manual_seed(0)
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        if dtype == torch.bfloat16 and not bfloat16_packing_supported():
            say("  (bfloat16 left out: this CPU's oneDNN has no bfloat16 kernels)")
            continue
        for m in rows:
            for name, k, n, count in shapes:
                weights = [
                    (torch.randn(n, k, generator=generator) * k**-0.5).to(dtype)
                    for _ in range(count)
                ]
                biases = [
                    None
                    if name == "lm head"
                    else (torch.randn(n, generator=generator) * 0.02).to(dtype)
                    for _ in range(count)
                ]
                packed = [torch.ops.mkldnn._reorder_linear_weight(w, m) for w in weights]
                x = torch.randn(m, k, generator=generator).to(dtype)

                def oneDNN(x, packed=packed, biases=biases):
                    return [
                        torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], "")
                        for p, b in zip(packed, biases, strict=True)
                    ]

                def plain(x, weights=weights, biases=biases):
                    return [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]

                variants: dict[str, Callable] = {"packed": oneDNN, "plain": plain}
                seconds = {}
                for mode in ("default", "max-autotune"):
                    started = time.perf_counter()
                    variants[mode] = compiled(Linears(weights, biases).eval(), mode)
                    variants[mode](x)
                    seconds[mode] = time.perf_counter() - started
                times = {key: [] for key in variants}
                for _ in range(rounds):
                    for key, fn in variants.items():
                        started = time.perf_counter()
                        fn(x)
                        times[key].append(time.perf_counter() - started)
                flops = 2 * m * k * n * count
                rate = {key: flops / statistics.median(t[1:]) / 1e9 for key, t in times.items()}
                best = max(rate["default"], rate["max-autotune"])
                say(
                    f"{name:<10}{f'{k}x{n}':>11}{m:>6}{dtype_name:>10}"
                    f"{rate['packed']:>8.0f}{rate['plain']:>8.0f}{rate['default']:>9.0f}"
                    f"{rate['max-autotune']:>10.0f}{best / rate['packed']:>12.2f}x"
                    f"{seconds['default']:>6.1f} /{seconds['max-autotune']:>4.1f}"
                )


# ---------------------------------------------------------------------------
# Part 2: the whole decode step
# ---------------------------------------------------------------------------


@torch.library.custom_op("rose_bench::paged_write_attend", mutates_args=("k_pool", "v_pool"))
def paged_write_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    window: int,
    sinks: int,
) -> torch.Tensor:
    """One layer of a decode batch's attention, as PagedKVCache.attend does it for decode
    rows: the new keys and values (rows, n_head, head_dim) written at their pool slots,
    then each row's query over its own blocks, read in place by the C kernel. window 0:
    none."""
    write_slots(k_pool, slots, k)
    write_slots(v_pool, slots, v)
    return kernels.paged_decode_attention(q, k_pool, v_pool, tables, lens, window or None, sinks)


@paged_write_attend.register_fake
def _(q, k, v, k_pool, v_pool, slots, tables, lens, window, sinks):
    return q.new_empty(q.shape)  # (the kernel returns a contiguous tensor)


class DecodeCache:
    """A `rosetrainer.model.AttendingKVCache` for one decode step whose bookkeeping was
    done before the compiled region: every row feeds one token, its position, pool slot,
    block table and length given."""

    def __init__(self, positions, slots, tables, lens, k_pools, v_pools, window, sinks) -> None:
        self.positions, self.slots, self.tables, self.lens = positions, slots, tables, lens
        self.k_pools, self.v_pools = k_pools, v_pools
        self.window, self.sinks = window, sinks

    def prepare(self, batch: int, q_len: int, device: torch.device):
        return self.positions, None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # (rows, n_head, head_dim)
        y = torch.ops.rose_bench.paged_write_attend(
            q, k, v, self.k_pools[layer], self.v_pools[layer],
            self.slots, self.tables, self.lens, self.window, self.sinks,
        )  # fmt: skip
        return y.transpose(0, 1)[None]


class DecodeStep(nn.Module):
    """The model's forward over one decode step (the unit compiled): logits, (rows, vocab)."""

    def __init__(self, model: GPT, window: int, sinks: int) -> None:
        super().__init__()
        self.model, self.window, self.sinks = model, window, sinks

    def forward(self, idx, positions, slots, tables, lens, k_pools, v_pools) -> torch.Tensor:
        cache = DecodeCache(
            positions, slots, tables, lens, k_pools, v_pools, self.window, self.sinks
        )
        return self.model(idx, cache=cache, validate=False).logits[0]


class CompiledRunner(ModelRunner):
    """A ModelRunner whose pure decode steps run the compiled DecodeStep, the batch padded
    up to a multiple of `bucket`; any other step (prompt chunks, drafts) runs eager, as
    the engine's runner would (weights packed)."""

    def __init__(
        self,
        model: GPT,
        engine: LLMEngine,
        mode: str,
        packed: bool,
        max_num_seqs: int,
        bucket: int,
        scratch_block: int,
    ) -> None:
        super().__init__(model, engine.pool, "kernel", max_num_seqs=max_num_seqs, pack_weights=True)
        assert self.in_place, "the paged attention kernel must run on this pool"
        body = packed_linears(model, max_num_seqs) if packed and can_pack(model) else model
        window = model.config.sliding_window or 0
        self.step_module = compiled(DecodeStep(body, window, model.config.attention_sinks), mode)
        self.bucket, self.scratch_block = bucket, scratch_block
        self.kv_block_size = engine.pool.kv_block_size
        self.table_width = -(-model.config.block_size // self.kv_block_size)

    def padded(self, rows: int) -> int:
        return -(-rows // self.bucket) * self.bucket

    def decode_inputs(self, seqs: list[EngineSequence]) -> tuple[torch.Tensor, ...]:
        """The compiled step's inputs for these decoding sequences, padded to the bucket."""
        bs, width = self.kv_block_size, self.table_width
        pad = self.padded(len(seqs)) - len(seqs)
        ids = [
            seq.fed_slice(seq.num_computed_tokens, seq.num_computed_tokens + 1)[0] for seq in seqs
        ]
        positions = [seq.num_computed_tokens for seq in seqs]
        slots = [
            seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, positions, strict=True)
        ]
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs]
        ids += [0] * pad
        positions += [0] * pad
        slots += [self.scratch_block * bs] * pad
        tables += [[self.scratch_block] + [0] * (width - 1)] * pad
        lens = [p + 1 for p in positions]
        return (
            torch.tensor([ids]),
            torch.tensor([positions]),
            torch.tensor(slots),
            torch.tensor(tables).clamp_(min=0),
            torch.tensor(lens),
        )

    @torch.inference_mode()
    def run(self, seqs: list[EngineSequence], num_new: list[int]):
        if any(n != 1 for n in num_new) or any(seq.draft_ids for seq in seqs):
            return super().run(seqs, num_new)
        inputs = self.decode_inputs(seqs)
        started = time.perf_counter()
        logits = self.step_module(*inputs, self.pool.k, self.pool.v)
        self.seconds = {"model": time.perf_counter() - started}
        self.num_decode = len(seqs)
        if self.record_writes:
            self.written_slots = inputs[2][: len(seqs)].tolist()
        return seqs, logits[: len(seqs)]


def running_engine(
    model: GPT, tokenizer: Tokenizer, seqs: int, context: int, seed: int
) -> LLMEngine:
    """An engine (weights packed, the kernel's attention: its defaults) with `seqs`
    sequences running, each past a prompt of `context` random tokens."""
    settings = dict(kv_block_size=16, max_num_seqs=seqs, max_num_batched_tokens=512)
    engine = LLMEngine(model, tokenizer, EngineConfig(**settings))
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    for _ in range(seqs):
        prompt = [rng.randrange(vocab - 1) for _ in range(context)]
        add(engine, prompt, model.config.block_size - context)  # none finishes meanwhile
    while any(not seq.output_ids for seq in engine.requests.values()):  # read the prompts
        engine.step()
    return engine


def decoding(engine: LLMEngine) -> list[EngineSequence]:
    """The running sequences, each with a slot for its next token (as the scheduler would
    give it), for calling runners directly without stepping the engine."""
    running = list(engine.scheduler.running)
    for seq in running:
        engine.block_manager.grow(seq, seq.num_computed_tokens + 1)
    return running


def uncached_last_logits(model: GPT, seqs: list[EngineSequence]) -> torch.Tensor:
    """The oracle: each sequence's whole tokens through the model without a cache, the
    logits after its last one, (rows, vocab)."""
    rows = []
    for seq in seqs:
        ids = torch.tensor([seq.prompt_ids + seq.output_ids])
        rows.append(model(ids).logits[0, -1])
    return torch.stack(rows)


def check_equal(
    engine: LLMEngine,
    eager: ModelRunner,
    runners: dict[str, CompiledRunner],
    model: GPT,
    steps: int,
) -> dict[str, str]:
    """Over `steps` steps: each variant's greedy tokens against eager's on the same state,
    and (first step) its logits against the uncached model's within the tolerance. The
    engine advances through the eager runner between checks."""
    verdict = {name: [0, 0, 0.0, 0.0] for name in runners}  # same tokens, rows, worst gap, tol
    for step in range(steps):
        seqs = decoding(engine)
        ones = [1] * len(seqs)
        _, want = eager.run(seqs, ones)  # (writes the same slots each run: harmless)
        want_tokens = want.float().argmax(-1)
        oracle = uncached_last_logits(model, seqs) if step == 0 else None
        for name, runner in runners.items():
            _, got = runner.run(seqs, ones)
            row = verdict[name]
            row[0] += int((got.float().argmax(-1) == want_tokens).sum())
            row[1] += len(seqs)
            if oracle is not None:
                row[2] = float((got.float() - oracle.float()).abs().max())
                row[3] = logit_tolerance(oracle.float())
        engine.runner = eager
        engine.step()
    out = {}
    for name, (same, total, gap, tol) in verdict.items():
        within = "within" if gap <= tol else "OUTSIDE"
        out[name] = (
            f"{same}/{total} tokens as eager; logits vs uncached {gap:.2e} ({within} tolerance {tol:.2e})"
        )
    return out


def step_part(args: argparse.Namespace, tokenizer: Tokenizer) -> None:
    config = QUICK_CONFIG if args.quick else GPTConfig.from_preset("gpt2")
    context = 24 if args.quick else args.context
    modes = [("default", False), ("max-autotune", False), ("default", True)]
    if args.autotune_packed:
        modes.append(("max-autotune", True))
    say()
    say(
        f"decode step: prompts of {context} tokens, median of {args.steps} steps per variant, "
        f"interleaved; batch padded to a multiple of {args.bucket}; {torch.get_num_threads()} threads"
    )
    torch.manual_seed(args.seed)
    base = wide_random_init(GPT(config), args.seed)
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        model = copy.deepcopy(base).to(dtype)
        for n in args.seqs:
            engine = running_engine(model, tokenizer, n, context, args.seed + n)
            eager = engine.runner
            scratch = engine.block_manager._take_block()  # the padded rows' slot (never read)
            runners: dict[str, ModelRunner] = {"eager (packed)": eager}
            compile_s = {}
            with torch.inference_mode():
                for mode, packed in modes:
                    name = f"{mode}{' packed' if packed else ''}"
                    runner = CompiledRunner(model, engine, mode, packed, n, args.bucket, scratch)
                    before, started = graphs_compiled(), time.perf_counter()
                    runner.run(decoding(engine), [1] * n)  # compiles
                    compile_s[name] = (time.perf_counter() - started, graphs_compiled() - before)
                    runners[name] = runner
            if dtype == torch.float32:
                compiled_runners = {k: r for k, r in runners.items() if k != "eager (packed)"}
                with torch.inference_mode():
                    verdicts = check_equal(engine, eager, compiled_runners, model, args.check_steps)
            times = {name: [] for name in runners}
            model_times = {name: [] for name in runners}
            for _ in range(args.steps + 1):
                for name, runner in runners.items():
                    engine.runner = runner
                    started = time.perf_counter()
                    engine.step()
                    times[name].append(time.perf_counter() - started)
                    model_times[name].append(runner.seconds["model"])
            say()
            say(f"{n} sequences, {dtype_name}")
            say(
                f"  {'variant':<22}{'step ms':>9}{'model ms':>10}{'vs eager':>10}{'compile s':>11}{'graphs':>8}"
            )
            eager_ms = median_ms(times["eager (packed)"][1:])
            for name in runners:
                step_ms = median_ms(times[name][1:])
                seconds, graphs = compile_s.get(name, (0.0, 0))
                say(
                    f"  {name:<22}{step_ms:>9.1f}{median_ms(model_times[name][1:]):>10.1f}"
                    f"{eager_ms / step_ms:>9.2f}x{seconds:>11.1f}{graphs:>8}"
                )
            if dtype == torch.float32:
                for name, verdict in verdicts.items():
                    say(f"  equality, {name}: {verdict}")
            recompiles(engine, eager, runners, args)


def recompiles(
    engine: LLMEngine, eager: ModelRunner, runners: dict, args: argparse.Namespace
) -> None:
    """Whether a smaller batch inside the bucket, and one a bucket down, compile again;
    and a padded step's model time beside eager's at the real size."""
    seqs = decoding(engine)
    n = len(seqs)
    inside = n - args.bucket // 2  # (padded up to n)
    name = next(k for k in runners if k != "eager (packed)")
    runner = runners[name]
    with torch.inference_mode():
        before = graphs_compiled()
        runner.run(seqs[:inside], [1] * inside)
        inside_graphs = graphs_compiled() - before
        times = {"eager": [], "padded": [], "full": []}
        for _ in range(args.steps):
            for key, r, rows in (
                ("eager", eager, inside),
                ("padded", runner, inside),
                ("full", runner, n),
            ):
                r.run(seqs[:rows], [1] * rows)
                times[key].append(r.seconds["model"])
    say(
        f"  {inside} sequences in the bucket of {n} ({name}): {inside_graphs} new graphs; model "
        f"{median_ms(times['padded']):.1f} ms padded to {n}, {median_ms(times['full']):.1f} ms "
        f"at {n} real rows; eager at {inside}: {median_ms(times['eager']):.1f} ms"
    )
    rows = n - args.bucket  # one bucket down: a new shape
    if rows > 0:
        with torch.inference_mode():
            before, started = graphs_compiled(), time.perf_counter()
            runner.run(seqs[:rows], [1] * rows)
            took = time.perf_counter() - started
        say(
            f"  {rows} sequences (one bucket down): {graphs_compiled() - before} new graphs, "
            f"first call {took:.1f} s"
        )


# ---------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------


def say(text: str = "") -> None:
    print(text, flush=True)


def ints(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise RoseError(f"expected comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=f"python -m {PROG}", description=__doc__)
    p.add_argument("--part", choices=("products", "step", "all"), default="all")
    p.add_argument("--quick", action="store_true", help="a tiny model, few rounds (a smoke test)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default: both)")
    p.add_argument("--rows", default="32,64", help="product rows (default: 32,64)")
    p.add_argument("--seqs", default="32,64", help="running sequences (default: 32,64)")
    p.add_argument("--context", type=int, default=200, help="prompt tokens (default: 200)")
    p.add_argument("--bucket", type=int, default=8, help="pad decode batches to a multiple")
    p.add_argument("--steps", type=int, default=10, help="decode steps timed per variant")
    p.add_argument("--rounds", type=int, default=30, help="product rounds (default: 30)")
    p.add_argument("--check-steps", type=int, default=3, help="equality steps (float32)")
    p.add_argument(
        "--autotune-packed", action="store_true", help="also max-autotune around packed products"
    )
    p.add_argument("--threads", type=int, help="torch threads (default: PyTorch's)")
    p.add_argument("--seed", type=int, default=0)
    return p


def bench(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",")]
    for d in args.dtypes:
        if d not in DTYPES:
            raise RoseError(f"unknown dtype {d!r}: float32 or bfloat16")
    args.rows, args.seqs = ints(args.rows), ints(args.seqs)
    if args.quick:
        args.rows, args.seqs, args.rounds, args.steps, args.check_steps = [4], [8], 3, 2, 1
        args.bucket = 4
    if args.threads:
        torch.set_num_threads(args.threads)
    allow_many_graphs()
    if args.part in ("products", "all"):
        with torch.no_grad():
            products(args.rows, args.dtypes, args.rounds, args.quick)
    if args.part in ("step", "all"):
        step_part(args, Tokenizer("gpt2"))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: bench(argv), PROG)


if __name__ == "__main__":
    sys.exit(main())
