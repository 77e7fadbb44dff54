"""python -m benchmarks.kernel_choices: the measurements behind the kernel choices the code makes.

(Not kernels.py: vllm_runner.py runs as a script from this folder, so the folder is first on
its path, and transformers imports a package named `kernels` there: vLLM failed to start.)

The code says why it takes one form of an operation over another; how much that saved on
one machine belongs here, where it can be measured again. Each row times the two forms
of one operation on GPT-2 small's shapes, interleaved round by round in one process, and
prints their median times and the ratio (the other form's time over rose's):

* argmax: greedy over 32 rows of bfloat16 logits, converted to float32 first (rose,
  roseinfer/request/sampling.py `greedy_ids`) against as they are; and over float32
  logits, the indices of `max` over the rows (rose) against `argmax` (the same ids);
* vocab projection: 32 rows by the output matrix, the weight packed once for oneDNN
  (rose, roseinfer/engine/packed.py) against PyTorch's product on the weight as stored;
* mlp gelu: the MLP's first product with its GELU done by the packed product (rose)
  against the packed product, then the GELU (32 and 500 rows);
* decode attention (float32, bfloat16): one layer of a decode step's attention, 32
  sequences over their blocks in a shuffled paged pool, read in place by the compiled
  kernel (rose, roseinfer/cache/kernels.py) against the blocks gathered, then attended
  in PyTorch (`one_query_attention`; EngineConfig(attention="gather")). Left out, saying
  so, where the kernel cannot be built.

A form this CPU cannot run (oneDNN without bfloat16 kernels) is left out, saying so.
docs/benchmarks.md ("Figures behind the code") holds the figures and their machines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from roseinfer.cache import kernels
from roseinfer.cache.paged import KVPool
from roseinfer.engine.packed import PackedLinear, bfloat16_packing_supported
from rosetrainer.config import GPTConfig
from rosetrainer.errors import ArgumentParser, run_cli
from rosetrainer.model import one_query_attention

PROG = "benchmarks.kernel_choices"


@dataclass
class Shapes:
    rows: int  # decoding sequences in a step
    n_embd: int
    n_head: int
    vocab: int
    context: int  # tokens each sequence holds
    kv_block_size: int  # tokens per block of the paged pool
    wide_rows: int  # the MLP's second row count (a prefill's tokens)


GPT2 = Shapes(
    rows=32, n_embd=768, n_head=12, vocab=50257, context=200, kv_block_size=16, wide_rows=500
)
QUICK = Shapes(rows=4, n_embd=64, n_head=4, vocab=512, context=20, kv_block_size=4, wide_rows=16)


@dataclass
class Row:
    name: str
    rose: str  # the form the code takes
    other: str
    rose_ms: float
    other_ms: float

    @property
    def ratio(self) -> float:
        return self.other_ms / self.rose_ms


Pair = tuple[str, str, str, Callable[[], object], Callable[[], object]]


def pairs(shapes: Shapes, generator: torch.Generator) -> tuple[list[Pair], list[str]]:
    """(name, rose's form, the other, rose's call, the other's call) for each measurement,
    and a note for each left out."""

    def randn(*size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(dtype)

    s, found, left_out = shapes, [], []
    head_dim = s.n_embd // s.n_head

    logits = randn(s.rows, s.vocab, dtype=torch.bfloat16)
    found.append(
        ("argmax (bfloat16 logits)", "to float32 first", "as they are",
         lambda: torch.argmax(logits.float(), dim=-1), lambda: torch.argmax(logits, dim=-1))
    )  # fmt: skip
    logits32 = logits.float()
    found.append(
        ("argmax (float32 logits)", "max's indices", "argmax",
         lambda: logits32.max(dim=-1).indices, lambda: torch.argmax(logits32, dim=-1))
    )  # fmt: skip

    packable = torch.backends.mkldnn.is_available()
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        if not packable or (dtype == torch.bfloat16 and not bfloat16_packing_supported()):
            left_out.append(f"packed products in {name}: this CPU's oneDNN cannot run them")
            continue
        head = nn.Linear(s.n_embd, s.vocab, bias=False).to(dtype)
        packed_head = PackedLinear(head, s.rows)
        x = randn(s.rows, s.n_embd, dtype=dtype)
        found.append(
            (f"vocab projection, {s.rows} rows ({name})", "packed", "as stored",
             lambda x=x, p=packed_head: p(x), lambda x=x, h=head: h(x))
        )  # fmt: skip
        fc, gelu = nn.Linear(s.n_embd, 4 * s.n_embd).to(dtype), nn.GELU(approximate="tanh")
        for rows in (s.rows, s.wide_rows):
            fused, plain = PackedLinear(fc, rows, gelu), PackedLinear(fc, rows)
            x = randn(rows, s.n_embd, dtype=dtype)
            found.append(
                (f"mlp gelu, {rows} rows ({name})", "fused", "packed, then GELU",
                 lambda x=x, f=fused: f(x), lambda x=x, p=plain, g=gelu: g(p(x)))
            )  # fmt: skip

    blocks_each = -(-s.context // s.kv_block_size)
    order = torch.randperm(s.rows * blocks_each, generator=generator)
    tables = order.view(s.rows, blocks_each)  # each sequence's blocks, anywhere in the pool
    lens = torch.full((s.rows,), s.context)
    mask = torch.ones(s.rows, 1, 1, blocks_each * s.kv_block_size, dtype=torch.bool)
    mask[..., s.context :] = False
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        pool = KVPool(
            GPTConfig(n_layer=1, n_head=s.n_head, n_embd=s.n_embd),
            len(order),
            s.kv_block_size,
            dtype,
            torch.device("cpu"),
        )
        pool.k[0].copy_(randn(*pool.k[0].shape, dtype=dtype))
        pool.v[0].copy_(randn(*pool.v[0].shape, dtype=dtype))
        if not kernels.runs_on(pool):
            left_out.append(f"decode attention in {name}: the kernel cannot be built here")
            continue
        q = randn(s.rows, s.n_head, head_dim, dtype=dtype)

        def in_place(q=q, pool=pool) -> torch.Tensor:
            return kernels.paged_decode_attention(q, pool.k[0], pool.v[0], tables, lens, None, 0)

        def gathered(q=q, pool=pool) -> torch.Tensor:
            keys, values = pool.read_tables(0, tables)
            return one_query_attention(q[:, :, None], keys, values, mask)

        found.append((f"decode attention ({name})", "in place", "gathered", in_place, gathered))
    return found, left_out


def median_ms(call: Callable[[], object], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - started) * 1000 / calls


def measure(found: list[Pair], rounds: int, calls: int) -> list[Row]:
    rows = []
    for name, rose, other, rose_call, other_call in found:
        rose_call(), other_call()  # warm up: first-call allocations, oneDNN's primitives
        rose_ms, other_ms = [], []
        for _ in range(rounds):  # interleaved, so a busy moment falls on both
            rose_ms.append(median_ms(rose_call, calls))
            other_ms.append(median_ms(other_call, calls))
        rows.append(Row(name, rose, other, statistics.median(rose_ms), statistics.median(other_ms)))
    return rows


def print_table(rows: list[Row], left_out: list[str], threads: int) -> None:
    print(f"torch {torch.__version__}, {threads} thread(s); ms per call, median of the rounds")
    print(f"{'measurement':<36} {'rose':<20} {'ms':>8}  {'other':<22} {'ms':>8} {'other/rose':>10}")
    for r in rows:
        print(
            f"{r.name:<36} {r.rose:<20} {r.rose_ms:8.3f}  {r.other:<22} {r.other_ms:8.3f} "
            f"{r.ratio:9.2f}x"
        )
    for note in left_out:
        print(f"left out: {note}")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=f"python -m {PROG}", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes, one round: a smoke test")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--calls", type=int, default=20, help="calls timed per round (default 20)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead")
    return p


def bench(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = QUICK if args.quick else GPT2
    rounds, calls = (1, 2) if args.quick else (args.rounds, args.calls)
    with torch.inference_mode():
        found, left_out = pairs(shapes, torch.Generator().manual_seed(0))
        rows = measure(found, rounds, calls)
    if args.json:
        results = [{**asdict(r), "ratio": r.ratio} for r in rows]
        print(json.dumps({"shapes": asdict(shapes), "results": results, "left_out": left_out}))
    else:
        print_table(rows, left_out, torch.get_num_threads())
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: bench(argv), PROG)


if __name__ == "__main__":
    sys.exit(main())
