"""The engine's own settings (`EngineConfig`), apart from what each request asks for.

A request's settings live in `SamplingParams`; these are the server's: how the KV
memory is cut into blocks, how large the pool is, and how much work one step may take.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from roseinfer.cache.quantized import (
    BITS,
    DEFAULT_GROUP_SIZE,
    DEFAULT_WINDOW,
    KV_CACHE_DTYPES,
    METADATA_BYTES_PER_GROUP,
    check_quant_settings,
    kv_bytes_per_token,
)
from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError

# Without a size from the user: room for every running sequence at a full context,
# but never more than this many bytes (a GPT-2 124M context of 1024 tokens takes 36 MiB).
DEFAULT_POOL_CAP_BYTES = 2 * 1024**3
_UNITS = {"": 1, "b": 1, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_UNITS.update(kb=1000, mb=1000**2, gb=1000**3, tb=1000**4)
ATTENTIONS = ("auto", "kernel", "flex", "gather")  # see EngineConfig.attention


@dataclass(frozen=True)
class EngineConfig:
    kv_block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # pool size in blocks, or
    kv_cache_memory: int | str | None = None  # pool size in bytes: 2147483648 or "2GiB"
    max_num_seqs: int = 64  # running sequences at most
    max_num_batched_tokens: int = 512  # tokens per step (decode tokens + prefill chunks)
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "int8", "int4": quantized
    # Quantized pool: tokens kept exact besides each sequence's filling block (rounded out
    # to whole blocks), and channels per value group (keys: one group per block).
    kv_cache_window: int = DEFAULT_WINDOW
    kv_cache_group_size: int = DEFAULT_GROUP_SIZE
    # Tests: hand out free blocks in a random order drawn from this seed, so a logical
    # block number used where a physical one belongs cannot pass by luck. None: in order.
    shuffle_blocks_seed: int | None = None
    # How a step's attention reads the keys and values (the same tokens every way; the
    # pool is the only copy): "kernel", the decoding sequences in place, by a small C
    # kernel compiled at first use (roseinfer.cache.kernels; on a CPU, for a plain pool:
    # a quantized or GPU pool, or no C compiler, gathers instead), each prompt or verify
    # chunk alone; "flex", the decode rows and the chunks each in one compiled
    # FlexAttention call reading the pool in place (roseinfer.cache.flex; a quantized pool
    # gathers instead); "gather", each decoding sequence's blocks gathered into one tensor
    # every step, then attention in PyTorch; "auto": "flex" on CUDA, "kernel" elsewhere.
    attention: str = "auto"
    # With "flex" on a plain pool: decode steps (every sequence feeding one token) replay
    # through CUDA graphs captured at start-up, one per batch-size bucket
    # (roseinfer.engine.cuda_graphs; on a CPU the same static-buffer step runs directly).
    # True: every step eager (vLLM's enforce_eager).
    enforce_eager: bool = False
    # On a CPU: the model's linear layers run with their weights packed once for oneDNN
    # (roseinfer.engine.packed: about one more copy of the weights, a faster step).
    pack_weights: bool = True
    # Record each step's written slots and the writers' block tables (runner.written_slots
    # / writer_tables), so that tests and chapters can check the pool's invariants after
    # every step (block_manager.check_pool); the engine itself checks nothing. Work a
    # server does not need, so it is off unless asked for.
    record_writes: bool = False

    def __post_init__(self) -> None:
        for name in ("kv_block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise RoseError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise RoseError("give the pool size as num_kv_blocks or kv_cache_memory, not both")
        if self.num_kv_blocks is not None and (
            not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1
        ):
            raise RoseError(f"num_kv_blocks must be an integer >= 1, got {self.num_kv_blocks!r}")
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise RoseError(
                f"unknown KV cache dtype {self.kv_cache_dtype!r}: choose one of "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        if self.attention not in ATTENTIONS:
            raise RoseError(
                f"attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}"
            )

    def attention_on(self, device: torch.device) -> str:
        """The attention this engine runs on `device` ("auto" resolved)."""
        if self.attention != "auto":
            return self.attention
        return "flex" if device.type == "cuda" else "kernel"

    def check_model(self, model: GPTConfig) -> None:
        """The settings that depend on the model (a block's length, a quantized pool's
        group size)."""
        if self.kv_block_size > model.block_size:
            # (a block longer than any sequence can grow only holds memory no token uses)
            raise RoseError(
                f"kv_block_size {self.kv_block_size} is more than the model's context "
                f"({model.block_size} tokens): choose at most {model.block_size}"
            )
        if model.sliding_window is not None and self.kv_cache_dtype != "auto":
            raise RoseError(
                "a quantized KV pool does not yet free blocks behind a sliding window: "
                "serve a windowed model with --kv-cache-dtype auto"
            )
        check_quant_settings(
            model, self.kv_cache_dtype, self.kv_cache_group_size, self.kv_cache_window, "channel"
        )

    def bytes_per_block(self, model: GPTConfig, element_size: int) -> int:
        """Keys and values of kv_block_size tokens in every layer (quantized: codes, and a
        float16 scale and zero per group: keys one group per channel, values one per
        kv_cache_group_size channels of each token)."""
        if self.kv_cache_dtype == "auto":
            return self.kv_block_size * kv_bytes_per_token(model, "auto", itemsize=element_size)
        numbers = 2 * model.n_layer * model.kv_width * self.kv_block_size
        key_groups = model.n_layer * model.kv_width  # one per channel
        value_groups = (
            model.n_layer * self.kv_block_size * model.kv_width // self.kv_cache_group_size
        )
        groups = key_groups + value_groups
        return numbers * BITS[self.kv_cache_dtype] // 8 + groups * METADATA_BYTES_PER_GROUP

    def exact_blocks(self) -> int:
        """A quantized pool's exact blocks at most: each running sequence's window and
        filling block, plus the blocks one step may start writing (see QuantizedKVPool)."""
        if self.kv_cache_dtype == "auto":
            return 0
        window_blocks = -(-self.kv_cache_window // self.kv_block_size)
        step_blocks = -(-self.max_num_batched_tokens // self.kv_block_size) + self.max_num_seqs
        return self.max_num_seqs * (window_blocks + 1) + step_blocks

    def pool_blocks(
        self,
        model: GPTConfig,
        element_size: int,
        draft_bytes: int = 0,
        device: torch.device | None = None,
    ) -> int:
        """How many blocks the pool holds, from the user's size or the default (a
        quantized pool's exact blocks are paid for out of the size first). draft_bytes: what
        a block's keys take in a draft model's pool of its own, which has as many blocks
        (the size is for both). device: where the pool will be; a size the user gave is
        refused when it has not that much memory free (a RoseError rather than the
        allocator's traceback)."""
        per_block = self.bytes_per_block(model, element_size) + draft_bytes
        exact_bytes = self.exact_blocks() * self.kv_block_size
        exact_bytes *= kv_bytes_per_token(model, "auto", itemsize=element_size)
        if self.num_kv_blocks is None and self.kv_cache_memory is None:
            # The default is no one's request: not checked against the free memory (the
            # pool's pages are taken as they are written; the allocation's error stands).
            full_context = -(-model.block_size // self.kv_block_size)
            cap = (DEFAULT_POOL_CAP_BYTES - exact_bytes) // per_block
            return max(1, min(self.max_num_seqs * full_context, cap))
        if self.num_kv_blocks is not None:
            blocks, field_name = self.num_kv_blocks, "num_kv_blocks"
            setting = f"num_kv_blocks {self.num_kv_blocks}"
        else:
            budget = parse_bytes(self.kv_cache_memory) - exact_bytes
            if budget < per_block:
                raise RoseError(
                    f"kv_cache_memory {self.kv_cache_memory!r} holds no block: one block of "
                    f"{self.kv_block_size} tokens takes {per_block} bytes"
                    + (f", after {exact_bytes} bytes of exact blocks" if exact_bytes else "")
                )
            blocks, field_name = budget // per_block, "kv_cache_memory"
            setting = f"kv_cache_memory {self.kv_cache_memory!r}"
        if device is not None:
            check_room(blocks * per_block + exact_bytes, device, setting, field_name)
        return blocks


def check_room(size: int, device: torch.device, setting: str, field_name: str) -> None:
    """Refuse a pool of `size` bytes that `device` has not the memory for (`setting`
    sized it; `field_name` is the one to change)."""
    free = available_memory(device)
    if free is not None and size > free:
        raise RoseError(
            f"{setting} is a KV pool of {size / 1024**3:.1f} GiB, more than the "
            f"{free / 1024**3:.1f} GiB of memory available on {device}: give a smaller {field_name}"
        )


def available_memory(device: torch.device) -> int | None:
    """Bytes free for a new tensor on `device`, as far as the system says (None: unknown;
    the allocation itself then fails, see LLMEngine)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:  # Linux: what can be allocated without swapping (caches dropped)
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:  # elsewhere: the physical memory, an upper bound
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def parse_bytes(size: int | str, name: str = "kv_cache_memory") -> int:
    """2147483648, "2GiB", "512MiB", "1.5GB" -> bytes (`name`: the setting, for errors)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size < 1:
            raise RoseError(f"{name} must be > 0 bytes, got {size}")
        return size
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(size))
    unit = match.group(2).lower() if match else None
    if match is not None and unit in _UNITS and float(match.group(1)) <= 0:
        raise RoseError(f"{name} must be > 0 bytes, got {size!r}")  # ("0" is a byte count)
    if match is None or unit not in _UNITS:
        raise RoseError(
            f"{name} must be a byte count or a size like '2GiB' / '512MiB', got {size!r}"
        )
    return int(float(match.group(1)) * _UNITS[unit])
