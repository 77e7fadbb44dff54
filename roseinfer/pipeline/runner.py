"""What each stage process does: stage 0 drives the generation, the others follow.

Messages go down the pipeline, stage s to stage s + 1, over torch.distributed
point-to-point sends (gloo on CPU, NCCL on GPUs). Each one starts with a `Header` of
nine integers: what kind of message it is, which job and micro-batch, which rows, and
the step's lengths (new tokens, past tokens, cache size). A prefill brings each row's
left padding and the hidden states along; a decode step its hidden states. Every stage
checks its own cache against the step's past length before it runs, so a stage whose
cache is out of step stops with a clear error instead of building a mask of the wrong
length. The last stage samples each row's token with the request's own `Sequence`
(its parameters and random stream) and sends the tokens straight back to stage 0,
which keeps the requests, applies their stopping rules and prints.

Micro-batches: when a batch has at least as many rows as there are stages, stage 0
cuts it into micro-batches (by default one per stage), each with its own cache on
every stage. While stage 1 runs micro-batch 0, stage 0 runs micro-batch 1, and so on.
Two schedules:

* "interleaved" (the default): a micro-batch's next step starts as soon as its tokens
  are back, so with as many micro-batches as stages no stage waits once the pipeline
  is full;
* "lockstep": every micro-batch finishes a step before any starts the next, the
  textbook schedule whose idle share (the bubble) is (N - 1) / (m + N - 1).

Sends are asynchronous (`isend`): a stage never waits for its neighbour to take a
message, only for the message it needs next, so the ring of sends cannot deadlock.
"""

from __future__ import annotations

import dataclasses
import resource
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from roseinfer.cache.dense import DenseKVCache, new_cache
from roseinfer.pipeline.stage import PipelineStage, even_runs
from roseinfer.request.rows import (
    checked_keep,
    left_pad,
    make_sequences,
    slid_starts,
    windows,
)
from roseinfer.request.sampling import SamplingParams, sample_rows
from roseinfer.request.sequence import GenerationResult, Sequence
from roseinfer.request.token_step import TokenCallback, take_tokens
from rosetrainer.errors import RoseError
from rosetrainer.model import LayerPast

# Message kinds
JOB, PREFILL, DECODE, END, STOP = 1, 2, 3, 4, 5
SCHEDULES = ("interleaved", "lockstep")
# Sends still in flight before the oldest are waited for (their tensors must stay alive).
MAX_PENDING_SENDS = 64


@dataclass
class Header:
    kind: int
    job: int = 0
    group: int = 0  # micro-batch
    first_row: int = 0  # the micro-batch's rows are first_row .. first_row + rows
    rows: int = 0
    q_len: int = 0  # new tokens per row
    past_len: int = 0  # positions the stage's cache must hold before this step
    max_len: int = 0  # a prefill: positions the new cache holds
    keep_caches: int = 0  # a job: the stages keep their caches for the report

    SIZE = 9

    def to_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(dataclasses.astuple(self), dtype=torch.long, device=device)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> Header:
        return cls(*tensor.tolist())


@dataclass
class Span:
    """One stretch of compute on one stage, for the timeline (perf_counter seconds: one
    monotonic clock for every process on the machine)."""

    job: int
    group: int
    kind: str  # "prefill" or "decode"
    start: float
    end: float


@dataclass
class StageReport:
    """What a stage tells the launcher when it is done."""

    stage: int
    layers: tuple[int, int]  # global layer numbers start, stop
    num_params: int
    param_bytes: int
    cache_bytes: int = 0  # the most its caches held at the end of a job
    peak_rss_bytes: int = 0
    timeline: list[Span] = field(default_factory=list)
    # job -> one entry per micro-batch: the cache's (k, v) per local layer, filled
    # positions only, and the rows' left padding
    caches: dict[int, list[tuple[list[LayerPast], list[int]]]] = field(default_factory=dict)
    results: list[list[GenerationResult]] | None = None  # stage 0: per job, per prompt
    error: str | None = None  # stage 0: the RoseError a request raised


class Link:
    """Point-to-point messages between this stage and its neighbours."""

    def __init__(self, stage: PipelineStage) -> None:
        self.stage = stage
        self.rank = stage.stage
        self.last = stage.n_stages - 1
        self.device = stage.device
        self.pending: deque[tuple[dist.Work, torch.Tensor]] = deque()

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        tensor = tensor.contiguous()
        self.pending.append((dist.isend(tensor, dst), tensor))
        while len(self.pending) > MAX_PENDING_SENDS:
            self.pending.popleft()[0].wait()

    def send_header(self, header: Header) -> None:
        self.send(header.to_tensor(self.device), self.rank + 1)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(tensor, src)
        return tensor

    def recv_header(self) -> Header:
        return Header.from_tensor(self.recv((Header.SIZE,), torch.long, self.rank - 1))

    def recv_hidden(self, rows: int, q_len: int) -> torch.Tensor:
        shape = (rows, q_len, self.stage.config.n_embd)
        return self.recv(shape, self.stage.dtype, self.rank - 1)

    def flush(self) -> None:
        while self.pending:
            self.pending.popleft()[0].wait()


def cache_contents(cache: DenseKVCache) -> tuple[list[LayerPast], list[int]]:
    """A cache's keys/values per layer (filled positions only, copied) and its rows' padding."""
    pairs = [(k.clone(), v.clone()) for k, v in cache.filled_kv()]
    pads = [] if cache.pad_lengths is None else cache.pad_lengths.tolist()
    return pairs, pads


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def split_micro_batches(rows: int, n_stages: int, requested: int | None) -> list[range]:
    """The rows of each micro-batch: one per stage when there are rows enough, else one."""
    count = (n_stages if rows >= n_stages else 1) if requested is None else requested
    if not isinstance(count, int) or not 1 <= count <= rows:
        raise RoseError(f"micro_batches must be in [1, {rows}] for {rows} row(s), got {count!r}")
    return even_runs(rows, count)


def check_token_ids(prompts: list[list[int]], vocab_size: int) -> None:
    for prompt in prompts:
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise RoseError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")


class Timed:
    """Runs the stage on a cache and records the span on the stage's timeline."""

    def __init__(self, stage: PipelineStage, report: StageReport) -> None:
        self.stage, self.report = stage, report

    def __call__(
        self, x: torch.Tensor, cache: DenseKVCache, job: int, group: int, kind: str
    ) -> torch.Tensor:
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.stage(x, cache)
        if out.device.type == "cuda":
            torch.cuda.synchronize(out.device)
        self.report.timeline.append(Span(job, group, kind, start, time.perf_counter()))
        return out


@dataclass
class Group:
    """Stage 0's view of one micro-batch: its rows, their tokens and windows, its cache."""

    rows: range
    max_len: int
    tokens: list[list[int]]
    starts: list[int]
    cache: DenseKVCache | None = None


class Driver:
    """Stage 0: runs one job (a batch of prompts) at a time through the pipeline."""

    def __init__(self, stage: PipelineStage, link: Link, cache_kind: str, report: StageReport):
        self.stage, self.link, self.cache_kind, self.report = stage, link, cache_kind, report
        self.run_stage = Timed(stage, report)
        self.jobs = 0
        # True while a job's messages are in flight: then no STOP can be sent cleanly
        self.in_job = False

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        *,
        eot_id: int | None = None,
        decode: Callable[[list[int]], str] | None = None,
        on_token: TokenCallback | None = None,
        micro_batches: int | None = None,
        schedule: str = "interleaved",
        keep_caches: bool = False,
        window_keep: int | None = None,
    ) -> list[GenerationResult]:
        """Generate for several prompts through the pipeline; one result per prompt, as
        `roseinfer.loops.generate.generate_batch` gives (each row equals its run alone)."""
        # Every check comes before the first message: a bad request stops nothing midway.
        seqs = make_sequences(self.stage, prompts, params, eot_id, decode)
        check_token_ids(prompts, self.stage.config.vocab_size)
        keep = checked_keep(self.stage, window_keep)
        if schedule not in SCHEDULES:
            raise RoseError(f"schedule is one of {', '.join(SCHEDULES)}, got {schedule!r}")
        block_size = self.stage.config.block_size
        groups = []
        for rows in split_micro_batches(len(seqs), self.stage.n_stages, micro_batches):
            longest = max(len(seqs[r].prompt_ids) for r in rows)
            new_tokens = max(seqs[r].params.max_tokens for r in rows)
            tokens = [list(seqs[r].prompt_ids) for r in rows]
            max_len = min(block_size, longest + new_tokens)
            groups.append(Group(rows, max_len, tokens, [0] * len(rows)))

        job, self.jobs = self.jobs, self.jobs + 1
        self.in_job = True
        self.link.send_header(Header(JOB, job, keep_caches=int(keep_caches)))
        # The last stage samples: it needs each row's parameters (and seed), not its stop strings.
        for_sampling = [(s.prompt_ids, dataclasses.replace(s.params, stop=())) for s in seqs]
        dist.send_object_list([for_sampling], dst=self.link.last)

        started = time.perf_counter()
        for index, group in enumerate(groups):
            self._prefill(job, index, group)
        in_flight = deque(range(len(groups)))
        while in_flight:
            # interleaved: one micro-batch at a time goes round; lockstep: all of them
            taking = 1 if schedule == "interleaved" else len(in_flight)
            arrived = [in_flight.popleft() for _ in range(taking)]
            for index in arrived:
                self._take_tokens(index, groups[index], seqs, on_token)
            for index in arrived:
                group = groups[index]
                if all(seqs[r].is_finished for r in group.rows):
                    continue  # this micro-batch is done; the others go on
                self._next_step(job, index, group, keep)
                in_flight.append(index)
        self.link.send_header(Header(END, job))
        self.in_job = False
        if keep_caches:
            self.report.caches[job] = [cache_contents(g.cache) for g in groups]
        self.report.cache_bytes = max(self.report.cache_bytes, sum(g.cache.nbytes for g in groups))
        return [seq.result(started) for seq in seqs]

    def stop(self) -> None:
        """Tell every stage to exit (only between jobs, when no message is in flight)."""
        if not self.in_job:
            self.link.send_header(Header(STOP))

    def _prefill(self, job: int, index: int, group: Group) -> None:
        padded, pad_lengths = left_pad(windows(group.tokens, group.starts))
        ids = torch.tensor(padded, device=self.stage.device)
        pads = torch.tensor(pad_lengths, device=self.stage.device)
        group.cache = new_cache(self.stage, self.cache_kind, len(padded), group.max_len)
        group.cache.reset(pads if int(pads.max()) > 0 else None)
        hidden = self.run_stage(ids, group.cache, job, index, "prefill")
        rows = group.rows
        header = Header(PREFILL, job, index, rows.start, len(rows), ids.size(1), 0, group.max_len)
        self.link.send_header(header)
        self.link.send(pads, self.link.rank + 1)
        self.link.send(hidden, self.link.rank + 1)

    def _next_step(self, job: int, index: int, group: Group, keep: int) -> None:
        slid = slid_starts(group.starts, group.tokens, self.stage.config.block_size, keep)
        if slid is not None:
            # A window is full: start the caches afresh from the kept tokens (as the
            # single-process loop does), on every stage.
            group.starts = slid
            self._prefill(job, index, group)
            return
        ids = torch.tensor([t[-1] for t in group.tokens], device=self.stage.device)[:, None]
        past_len = group.cache.seq_len
        hidden = self.run_stage(ids, group.cache, job, index, "decode")
        rows = group.rows
        self.link.send_header(Header(DECODE, job, index, rows.start, len(rows), 1, past_len))
        self.link.send(hidden, self.link.rank + 1)

    def _take_tokens(
        self, index: int, group: Group, seqs: list[Sequence], on_token: TokenCallback | None
    ) -> None:
        message = self.link.recv((1 + len(group.rows),), torch.long, self.link.last).tolist()
        if message[0] != index:
            raise RuntimeError(f"stage 0 expected micro-batch {index}'s tokens, got {message[0]}'s")
        tokens = message[1:]
        for row_tokens, token in zip(group.tokens, tokens, strict=True):
            row_tokens.append(token)  # every row rides along, stopped ones too
        stream = None if on_token is None else lambda i, token: on_token(group.rows[i], token)
        take_tokens([seqs[row] for row in group.rows], tokens, on_token=stream)


def follow(stage: PipelineStage, link: Link, cache_kind: str, report: StageReport) -> None:
    """Every stage after the first: run what arrives, pass it on, until told to stop."""
    run_stage = Timed(stage, report)
    for header, hidden, pads in messages(link):
        if stage.is_last and header.kind == JOB:
            objects: list = [None]
            dist.recv_object_list(objects, src=0)
            # Sampling only: a Sequence per row for its parameters and its random stream.
            seqs = [
                Sequence(list(prompt), params, device=stage.device)  # where the logits are
                for prompt, params in objects[0]
            ]
        if header.kind == JOB:
            caches: dict[int, DenseKVCache] = {}
            keep_caches = bool(header.keep_caches)
        elif header.kind == END:
            if keep_caches:
                report.caches[header.job] = [cache_contents(caches[g]) for g in sorted(caches)]
            report.cache_bytes = max(report.cache_bytes, sum(c.nbytes for c in caches.values()))
        elif header.kind in (PREFILL, DECODE):
            if header.kind == PREFILL:
                cache = new_cache(stage, cache_kind, header.rows, header.max_len)
                cache.reset(pads if int(pads.max()) > 0 else None)
                caches[header.group] = cache
            cache = caches[header.group]
            if cache.seq_len != header.past_len:
                raise RuntimeError(
                    f"stage {stage.stage}: micro-batch {header.group}'s cache holds "
                    f"{cache.seq_len} positions but this step follows {header.past_len}"
                )
            kind = "prefill" if header.kind == PREFILL else "decode"
            out = run_stage(hidden, cache, header.job, header.group, kind)
            if stage.is_last:
                rows = seqs[header.first_row : header.first_row + header.rows]
                tokens = sample_rows(out, rows)
                link.send(torch.tensor([header.group, *tokens], device=link.device), 0)
            else:
                link.send_header(header)
                if pads is not None:
                    link.send(pads, link.rank + 1)
                link.send(out, link.rank + 1)
        if not stage.is_last and header.kind in (JOB, END, STOP):
            link.send_header(header)
        if header.kind == STOP:
            return


def messages(link: Link) -> Iterator[tuple[Header, torch.Tensor | None, torch.Tensor | None]]:
    """(header, hidden states, left padding) of each message from the previous stage."""
    while True:
        header = link.recv_header()
        pads = hidden = None
        if header.kind == PREFILL:
            pads = link.recv((header.rows,), torch.long, link.rank - 1)
        if header.kind in (PREFILL, DECODE):
            hidden = link.recv_hidden(header.rows, header.q_len)
        yield header, hidden, pads
