"""The paged pool's decode attention kernel: C, compiled at first use, loaded with ctypes.

`paged_decode_attention(q, k_pool, v_pool, tables, lens, window, sinks)` is the decode
batch's attention read straight from the pool's blocks (paged_attention.c says how),
with no copy of any key or value. The first call in a process builds the library with
the system's C compiler (`cc`, or $CC) for the instruction set PyTorch uses on this CPU
(`torch.backends.cpu.get_cpu_capability()`: AVX-512 -> x86-64-v4, AVX2 -> x86-64-v3; so
ATEN_CPU_CAPABILITY=avx2 builds what an AVX2-only processor runs), with OpenMP, into
$ROSE_KERNEL_CACHE or ~/.cache/rose/kernels (named by a hash of the source and the
flags, written to a temporary file and moved into place, so processes building at
once never read half a library), and later processes load it from there.

Where it cannot run (a quantized pool, a pool off the CPU, a dtype or head size it is
not built for, no compiler, a failed build) `runs_on(pool)` says no (a build that fails
says why once, in one line through logging), and the paged cache gathers the blocks and
attends in PyTorch instead (the same math).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from rosetrainer.errors import one_line

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.c")
MAX_HEAD_DIM = 256  # (the source's limits)
MAX_BLOCK = 256
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
# torch.backends.cpu.get_cpu_capability() -> the x86-64 level to build for
MARCH = {"AVX512": "x86-64-v4", "AVX2": "x86-64-v3"}


def build_flags() -> list[str]:
    """The compiler's flags: optimised, OpenMP, the processor's level (x86 only).

    -fassociative-math (with the two flags it needs) lets the compiler add a dot
    product's partial sums as a tree: by default C's left-to-right order holds, and each
    key's score ends in a chain of 16 dependent scalar additions, which bound the kernel
    by that chain (docs/benchmarks.md, "Figures behind the code"). It changes the order of
    the sums, not what is summed: NaN and infinity keep their rules."""
    flags = ["-O3", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared"]
    flags += ["-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        level = MARCH.get(torch.backends.cpu.get_cpu_capability())
        flags += [f"-march={level}", "-mtune=generic"] if level else ["-march=x86-64"]
    return flags


def cache_dir() -> Path:
    folder = os.environ.get("ROSE_KERNEL_CACHE")
    return Path(folder) if folder else Path.home() / ".cache" / "rose" / "kernels"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library, or None (said once) where it cannot be built or loaded."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return _unavailable("no C compiler (cc) found")
    flags = build_flags()
    try:
        source = SOURCE.read_bytes()
    except OSError as error:
        return _unavailable(f"its source could not be read ({one_line(error)})")
    key = hashlib.sha256(source + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    path = cache_dir() / f"paged_attention-{key}.so"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
                built = Path(scratch) / path.name
                subprocess.run(
                    [compiler, *flags, str(SOURCE), "-o", str(built), "-lm"],
                    check=True,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                os.replace(built, path)
        except (OSError, subprocess.SubprocessError) as error:
            said = (getattr(error, "stderr", None) or "").strip().splitlines()  # the compiler's
            return _unavailable(f"its build failed ({said[0] if said else one_line(error)})")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as error:
        return _unavailable(f"it could not be loaded ({one_line(error)})")
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    for name in DTYPES.values():
        function = getattr(lib, f"paged_decode_attention_{name}")
        function.restype = None
        function.argtypes = [pointer] * 5 + [size] * 8 + [ctypes.c_float, pointer, ctypes.c_int]
    return lib


def _unavailable(why: str) -> None:
    logger.warning(
        "the paged decode attention kernel is not available: %s; decode steps gather "
        "their keys and values in PyTorch instead (the same tokens, slower)",
        why,
    )
    return None


def runs_on(pool: object) -> bool:
    """Whether the kernel can read this pool: keys and values in one tensor per layer (not
    a quantized pool's codes), on the CPU, in a dtype it is built for, heads and blocks
    within its limits; and the library builds (the first time asked)."""
    layers = pool.k
    if not layers or not isinstance(layers[0], torch.Tensor):  # (a quantized pool's codes)
        return False
    _, _, kv_block_size, head_dim = layers[0].shape
    return (
        layers[0].device.type == "cpu"
        and layers[0].dtype in DTYPES
        and head_dim <= MAX_HEAD_DIM
        and kv_block_size <= MAX_BLOCK
        and library() is not None
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    window: int | None,
    sinks: int,
) -> torch.Tensor:
    """q (n, n_head, head_dim): one query per sequence, at position lens[i] - 1 of its own;
    k_pool, v_pool: one layer's blocks, (num_blocks, n_kv_head, kv_block_size, head_dim),
    n_kv_head dividing n_head (query head h reads key/value head h // (n_head // n_kv_head));
    tables (n, max_blocks) int64, its blocks in order. Each query's attention over its
    visible keys (0 .. lens[i] - 1, or its window and sinks), (n, n_head, head_dim)."""
    function = getattr(library(), f"paged_decode_attention_{DTYPES[q.dtype]}")
    n, n_head, head_dim = q.shape
    q, tables, lens = q.contiguous(), tables.contiguous(), lens.contiguous()
    assert k_pool.is_contiguous() and v_pool.is_contiguous() and q.dtype == k_pool.dtype
    out = torch.empty_like(q)
    function(
        q.data_ptr(),
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        n,
        n_head,
        k_pool.size(1),
        head_dim,
        k_pool.size(2),
        tables.size(1),
        0 if window is None else window,
        sinks,
        1.0 / math.sqrt(head_dim),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out
