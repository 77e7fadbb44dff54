"""Where a training process computes: its device, its autocast dtype, its torchrun rank.

Under `torchrun --nproc_per_node=N` every process gets RANK, LOCAL_RANK and
WORLD_SIZE in its environment; `setup_device` reads them, picks one GPU per
process (or the CPU), and joins the process group (NCCL on GPUs, Gloo on CPUs).
A plain `python -m ...` run is rank 0 of a world of one, and joins nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from rosetrainer.errors import RoseError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Runtime:
    """The device, the autocast dtype, and which of the torchrun processes this is."""

    device: torch.device
    dtype: torch.dtype  # the autocast compute dtype; float32 means no autocast
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def autocast(self) -> contextlib.AbstractContextManager:
        enabled = self.dtype != torch.float32
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=enabled)

    def synchronize(self) -> None:
        """Wait for queued GPU work, so that a clock reading means what it says."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def pick_device(name: str = "auto") -> torch.device:
    """auto (CUDA when there is one, else the CPU), cpu, cuda or cuda:N; CUDA is checked."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise RoseError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RoseError(
            f"--device {name}, but CUDA is not available here (no GPU, or a CPU-only torch); "
            f"use --device cpu or auto"
        )
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype called `name`, checked against what `device` can compute in."""
    if name not in DTYPES:
        raise RoseError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    if name == "float16" and device.type != "cuda":
        raise RoseError("float16 is not supported on CPU; use bfloat16 or float32")
    if name == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise RoseError(
            f"bfloat16 is not supported on {torch.cuda.get_device_name(device)}; "
            f"use float16 or float32"
        )
    return DTYPES[name]


def setup_device(device: str = "auto", dtype: str = "float32") -> Runtime:
    """Check the device and dtype asked for, and join the process group under torchrun."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch_device = pick_device(device)
    if torch_device.type == "cuda" and world_size > 1:
        torch_device = torch.device("cuda", local_rank)  # one GPU per process
    elif torch_device.type == "cuda" and torch_device.index is None:
        # "cuda" alone is the current GPU: set_device wants its number
        torch_device = torch.device("cuda", torch.cuda.current_device())
    torch_dtype = pick_dtype(dtype, torch_device)
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
        torch.set_float32_matmul_precision("high")  # TF32 matmuls: much faster, same training
    if world_size > 1:
        dist.init_process_group(backend="nccl" if torch_device.type == "cuda" else "gloo")
    return Runtime(torch_device, torch_dtype, rank, world_size)


def keep_freed_memory() -> None:
    """Have glibc keep freed memory for the next step instead of handing it back to the kernel.

    A training step allocates and frees the same large tensors every time (the logits
    alone are batch x block_size x 50,257 floats). By default glibc returns each large
    block to the kernel as soon as it is freed, and the next step page-faults every
    page of it back in, zero-filled by the kernel: on a small CPU a large share of a
    tiny-model step (docs/benchmarks.md, "Figures behind the code"). Raising glibc's
    mmap and trim thresholds keeps those blocks in the heap, ready for reuse; the
    process's resident size then counts freed blocks too. Elsewhere (macOS, musl) this
    does nothing.
    """
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    libc.mallopt(m_mmap_threshold, 1 << 30)  # blocks up to 1 GiB come from the heap
    libc.mallopt(m_trim_threshold, 2**31 - 1)  # and freed heap memory stays mapped


def mean_over_ranks(values: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """The mean of `values` over all processes (the values themselves in a single process)."""
    if rt.distributed:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values /= rt.world_size
    return values


def is_torchrun_worker() -> bool:
    """Whether this process is one of several that torchrun started."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def exit_torchrun_worker(code: int) -> NoReturn:
    """End a torchrun worker with `code` now, without the interpreter's teardown.

    torch's gloo backend keeps its worker threads past destroy_process_group. At exit, one
    of them may still be releasing the last collective's tensors, which takes the GIL; the
    finalizing interpreter ends such a thread with a forced unwind through a noexcept
    destructor, and the process aborts (SIGABRT, exit -6) after a run that had finished and
    saved: 1 in 5 two-process CPU runs on the build machine (the stack read with gdb), and
    a CI run of tests/trainer/test_ddp.py. Everything a run writes is closed by then; the two
    streams are flushed here."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def shutdown(rt: Runtime) -> None:
    if rt.distributed:
        dist.destroy_process_group()
