"""Starting the stage processes, and making sure none outlives the run.

`run_pipeline` starts one process per stage with torch.multiprocessing (spawn: a
fresh interpreter each, as torch.distributed wants) on a free loopback port, waits
for them, and gathers what each reports. Under `torchrun` the processes exist
already: `torchrun_rank` says which stage this process is, and `stage_main` runs it.

Whatever happens, the launcher leaves no stage behind: a request that fails its
checks makes stage 0 tell every stage to stop, then report the error; a stage that
crashes makes torch stop the others; Ctrl-C, SIGTERM or SIGHUP (an exception in the
launcher, `Terminated` for the last two, also when a shell started it in the
background with SIGINT ignored) terminates every stage that is still running, then
goes on as an interrupt. A stage ignores Ctrl-C itself (the launcher stops it, with no
traceback of its own) and asks the kernel to kill it if the launcher dies any other
way (SIGKILL included).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from roseinfer.cache.dense import CACHE_KINDS
from roseinfer.pipeline.runner import Driver, Link, StageReport, follow, peak_rss_bytes
from roseinfer.pipeline.stage import load_stage
from roseinfer.request.sampling import SamplingParams
from roseinfer.request.sequence import GenerationResult
from rosetrainer.errors import RoseError
from rosetrainer.runtime import DTYPES

# A step that takes longer than this on one stage is a hang, not a slow step.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
STOP_GRACE_S = 1.5  # after terminate(), how long a stage may take before it is killed
JOIN_POLL_S = 0.5  # how often the launcher, waiting on its stages, looks for a signal


@dataclass
class PipelineSetup:
    """Which model, split how, where: the same for every stage process."""

    source: str  # a rose checkpoint (.pt), or a Hugging Face GPT-2 directory with hf=True
    n_stages: int
    hf: bool = False
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (NCCL, one GPU per stage)
    dtype: str = "float32"
    cache: str = "static"
    threads: int = 1  # torch threads per stage process

    def __post_init__(self) -> None:
        if self.cache not in CACHE_KINDS:
            raise RoseError(f"cache is one of {', '.join(CACHE_KINDS)}, got {self.cache!r}")
        if self.dtype not in DTYPES:
            raise RoseError(f"dtype is one of {', '.join(DTYPES)}, got {self.dtype!r}")


@dataclass
class PipelineJob:
    """One batch of prompts; the keyword arguments of `Driver.generate`."""

    prompts: list[list[int]]
    params: SamplingParams | list[SamplingParams]
    options: dict = field(default_factory=dict)  # eot_id, micro_batches, schedule, keep_caches...


class StageProgram(Protocol):
    """What stage 0 does with the pipeline: generate through `driver`, print or return."""

    def run(self, driver: Driver) -> list[list[GenerationResult]]: ...


@dataclass
class RunJobs:
    """A StageProgram that runs a list of jobs and returns their results."""

    jobs: list[PipelineJob]

    def run(self, driver: Driver) -> list[list[GenerationResult]]:
        return [driver.generate(job.prompts, job.params, **job.options) for job in self.jobs]


@dataclass
class PipelineRun:
    results: list[list[GenerationResult]]  # per job, per prompt
    stages: list[StageReport]


def stage_main(
    rank: int, setup: PipelineSetup, program: StageProgram, init_method: str
) -> StageReport:
    """Be stage `rank`: join the process group, load this stage's weights, run, report."""
    torch.set_num_threads(setup.threads)
    device = torch.device("cpu")
    if setup.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=setup.n_stages,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        stage = load_stage(
            setup.source,
            rank,
            setup.n_stages,
            hf=setup.hf,
            device=device,
            dtype=DTYPES[setup.dtype],
        )
        report = StageReport(
            rank, (stage.layers.start, stage.layers.stop), stage.num_params(), stage.param_bytes()
        )
        link = Link(stage)
        if stage.is_first:
            driver = Driver(stage, link, setup.cache, report)
            try:
                report.results = program.run(driver)
            except RoseError as err:
                report.error = str(err)
            finally:
                driver.stop()  # every other stage exits its loop
        else:
            follow(stage, link, setup.cache, report)
        link.flush()
        report.peak_rss_bytes = peak_rss_bytes()
        return report
    finally:
        dist.destroy_process_group()


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP reached the launcher: it ends as Ctrl-C would."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def signals_stop_the_run() -> Iterator[None]:
    """While the stages run, SIGTERM and SIGHUP raise `Terminated` in the launcher, so
    its cleanup stops every stage (Python's default would end the launcher at once and
    leave the stages running)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; its own stay as they are
        return

    def handle(signum: int, frame: object) -> None:
        raise Terminated(signum)

    previous = {s: signal.signal(s, handle) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _follow_the_launcher(launcher_pid: int) -> None:
    """In a stage: leave Ctrl-C to the launcher, and die with it whatever kills it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != launcher_pid:  # it died before the line above took effect
        os._exit(1)


def _spawned_stage(
    rank: int,
    setup: PipelineSetup,
    program: StageProgram,
    init_method: str,
    report_dir: str,
    launcher_pid: int,
) -> None:
    _follow_the_launcher(launcher_pid)
    report = stage_main(rank, setup, program, init_method)
    path = Path(report_dir) / f"stage{rank}.pkl"
    path.write_bytes(pickle.dumps(report))
    # Done, and nothing is left to save: skip the interpreter's teardown, which for a process
    # that loaded torch takes seconds on a busy machine (the launcher waits for it).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_pipeline(setup: PipelineSetup, program: StageProgram | list[PipelineJob]) -> PipelineRun:
    """Start one process per stage, run `program` (or these jobs) at stage 0, gather reports.

    A request that fails its checks raises its RoseError here, after every stage stopped.
    """
    if setup.n_stages < 2:
        raise RoseError(
            f"a pipeline needs at least 2 stages, got {setup.n_stages}: one stage is the "
            f"ordinary single-process generate"
        )
    if isinstance(program, list):
        program = RunJobs(program)
    init_method = f"tcp://127.0.0.1:{free_port()}"  # stage 0 hosts the rendezvous there
    with tempfile.TemporaryDirectory(prefix="rose-pipeline-") as report_dir, signals_stop_the_run():
        # Daemonic stages: if the launcher leaves by a path that skips the `finally` below
        # (Ctrl-C while they are still being started), its exit terminates them instead of
        # waiting for stages that ignore Ctrl-C and would generate on.
        context = mp.start_processes(
            _spawned_stage,
            args=(setup, program, init_method, report_dir, os.getpid()),
            nprocs=setup.n_stages,
            join=False,
            daemon=True,
            start_method="spawn",
        )
        try:
            # A crashed stage raises here, after torch stopped the others. The timeout
            # wakes this thread now and then: a signal the kernel hands to another of its
            # threads only raises here once this thread runs Python again.
            while not context.join(timeout=JOIN_POLL_S, grace_period=STOP_GRACE_S):
                pass
        finally:
            stop_processes(context.processes)  # on Ctrl-C too: none is left running
        reports = [
            pickle.loads((Path(report_dir) / f"stage{rank}.pkl").read_bytes())
            for rank in range(setup.n_stages)
        ]  # our own children's reports, in a directory only this run knows
    if reports[0].error is not None:
        raise RoseError(reports[0].error)
    return PipelineRun(reports[0].results, reports)


def stop_processes(processes: list[mp.Process]) -> None:
    """Terminate every process still running; kill the ones that do not go."""
    alive = [p for p in processes if p.is_alive()]
    for process in alive:
        process.terminate()
    for process in alive:
        process.join(STOP_GRACE_S)
        if process.is_alive():
            process.kill()
            process.join()


def torchrun_rank() -> tuple[int, int, str] | None:
    """(rank, world size, init method) when torchrun started this process, else None."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://"
