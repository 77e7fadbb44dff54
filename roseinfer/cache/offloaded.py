"""The offloaded KV cache: every layer's keys and values in host memory, two on the GPU.

At GPT-2 small's width a float32 cache takes 72 KiB per token, 72 MiB for one full
1024-token context, and a card fills with caches long before it fills with weights.
This cache keeps all of them in host memory (pinned, so the copies run as DMA on
their own), and on the compute device only two *slots*, each one layer's keys and
values for `max_len` positions. Layer L computes in slot L % 2:

* before layer L needs it, the held past of layer L is copied host -> slot (the
  *prefetch*), on a copy stream of its own, while the GPU is still busy with layer
  L - 1: `update(L - 1)` queues it, so it overlaps L - 1's attention and MLP;
* `update(L)` waits for that copy (an event), writes the new tokens' keys and values
  into the slot after the past, queues their copy back to host (the *write-back*),
  queues the prefetch of layer L + 1 into the other slot, and hands attention the
  slot's filled positions.

The slots are what the compute stream and the copy stream share, and each hand-over
is ordered: the copy stream waits for the compute stream (`wait_stream`) before it
overwrites a slot (so layer L - 1's attention has read it) and before it copies new
keys out of one; the compute stream waits for the prefetch's event before it touches
the slot. The copy stream only touches buffers this cache holds for its whole life,
so the caching allocator cannot hand their memory to another tensor while a copy is
in flight; the slots also name the copy stream (`record_stream`), so that when the
cache is dropped with a write-back still queued, their memory waits for it.

It costs bandwidth instead of memory: each decode step copies every layer's whole
past to the device again, 72 KiB per held token for GPT-2 small in float32, and PCIe
moves tens of GB/s where the GPU's memory moves TB/s. `python -m
benchmarks.offload --device cuda` measures both sides against the concatenating
and the static cache.

With the model on the CPU the host and the compute device are one: the copies are
plain copies and there are no streams, so the same bookkeeping (which positions are
prefetched, written back, and read) runs, and is tested, on any machine. Attention
reads exactly the filled positions, so positions and mask are the concatenating
cache's (`filled_positions_and_mask`).
"""

from __future__ import annotations

import contextlib
import copy

import torch

from roseinfer.cache.dense import Blocks, check_truncate, filled_positions_and_mask
from rosetrainer.errors import RoseError
from rosetrainer.model import LayerPast

# The stored layout is time-major, (max_len, B, n_head, head_dim): the positions of one
# step are then one contiguous range, so a write-back or a prefetch is a single copy (a
# non-contiguous copy into pinned memory would go through a pageable buffer and stall
# the CPU). Attention reads it through a (B, n_head, T, head_dim) view, no copy.
TIME_MAJOR = (2, 0, 1, 3)  # (B, n_head, T, head_dim) -> (T, B, n_head, head_dim)
HEADS_FIRST = (1, 2, 0, 3)  # back


class OffloadedKVCache:
    """Keys/values of every layer in host memory; two layers' worth on the compute device.

    nbytes: the host buffers (every position of every layer, allocated once, like the
    static cache's); device_nbytes: the two slots. copied_to_device / copied_to_host
    count the bytes moved each way since construction (PCIe traffic on a GPU).
    """

    compilable = False  # each step copies a longer past: no one fixed shape
    windowed = False  # it keeps every position

    def __init__(self, model: Blocks, batch_size: int = 1, max_len: int | None = None) -> None:
        cfg = model.config
        blocks = model.transformer.h
        weight = blocks[0].attn.c_attn.weight
        self.max_len = cfg.block_size if max_len is None else max_len
        if not 0 < self.max_len <= cfg.block_size:
            raise RoseError(
                f"an offloaded cache holds 1..block_size ({cfg.block_size}) positions, "
                f"got max_len={self.max_len}"
            )
        self.device = weight.device
        self.dtype = weight.dtype
        self.n_layer = len(blocks)
        self.shape = (self.max_len, batch_size, cfg.kv_heads, cfg.head_dim)
        self.host_k = [self._host_zeros() for _ in range(self.n_layer)]
        self.host_v = [self._host_zeros() for _ in range(self.n_layer)]
        self._new_slots()
        self.copied_to_device = 0
        self.copied_to_host = 0
        self.reset()

    def _host_zeros(self) -> torch.Tensor:
        # Pinned only for a GPU: only page-locked memory copies asynchronously over PCIe.
        pin = self.device.type == "cuda"
        return torch.zeros(self.shape, dtype=self.dtype, pin_memory=pin)

    def _new_slots(self) -> None:
        """The two compute-device slots, and on a GPU the copy stream and one event per
        slot (its prefetch has landed)."""

        def zeros() -> torch.Tensor:
            return torch.zeros(self.shape, dtype=self.dtype, device=self.device)

        self.slots: list[LayerPast] = [(zeros(), zeros()) for _ in range(2)]
        self.copy_stream: torch.cuda.Stream | None = None
        self.ready: list[torch.cuda.Event] = []
        if self.device.type == "cuda":
            self.copy_stream = torch.cuda.Stream(device=self.device)
            self.ready = [torch.cuda.Event() for _ in self.slots]
            for slot in self.slots:
                for t in slot:
                    # A dropped cache's last write-back may still be reading its slot:
                    # the allocator then waits for the copy stream before reusing it.
                    t.record_stream(self.copy_stream)

    # -- what the loops ask of a cache (roseinfer.cache.dense.DenseKVCache) --

    @property
    def batch_size(self) -> int:
        return self.shape[1]

    @property
    def seq_len(self) -> int:
        return self.filled

    @property
    def nbytes(self) -> int:
        """The host buffers, filled or not: every layer's keys and values live there."""
        return sum(t.nbytes for t in self.host_k + self.host_v)

    @property
    def device_nbytes(self) -> int:
        """The two slots on the compute device: what offloading leaves there."""
        return sum(t.nbytes for slot in self.slots for t in slot)

    def reset(self, pad_lengths: torch.Tensor | None = None) -> None:
        """Forget every position; the buffers stay (stale positions are never read: a
        step prefetches and attends over the filled ones only)."""
        if pad_lengths is not None and pad_lengths.shape != (self.batch_size,):
            raise RoseError(
                f"pad_lengths has shape {tuple(pad_lengths.shape)}, but the cache holds "
                f"{self.batch_size} rows: give one left-padding length per row"
            )
        self.filled = 0  # positions held, the new ones of the current call included
        self.past_len = 0  # positions held before the current call
        self.pad_lengths = pad_lengths

    def truncate(self, n: int) -> None:
        """Keep the first n positions: only the count moves back (the next step
        prefetches the first n and writes its own after them)."""
        check_truncate(n, self.seq_len)
        self.filled = n

    def filled_kv(self) -> list[LayerPast]:
        """Every layer's filled keys and values, (B, n_head, seq_len, head_dim) views of
        the host buffers (in host memory)."""
        self._wait_for_copies()
        n = self.filled
        return [
            (k[:n].permute(HEADS_FIRST), v[:n].permute(HEADS_FIRST))
            for k, v in zip(self.host_k, self.host_v, strict=True)
        ]

    def check_rows(self, rows: int) -> None:
        if rows != self.batch_size:
            raise RoseError(
                f"the offloaded cache holds {self.batch_size} row(s) but {rows} prompt(s) "
                f"were given: build it with {type(self).__name__}(model, batch_size={rows})"
            )

    def fork(self, n: int) -> list[OffloadedKVCache]:
        """n caches for n continuations, each with its own copy of the host buffers (they
        are written in place) and its own slots and stream."""
        self._wait_for_copies()
        forks = []
        for _ in range(n):
            fork = copy.copy(self)
            fork.host_k = [self._host_zeros().copy_(k) for k in self.host_k]
            fork.host_v = [self._host_zeros().copy_(v) for v in self.host_v]
            fork._new_slots()
            forks.append(fork)
        return forks

    # -- what the model asks of a cache (rosetrainer.model.KVCache) --

    def prepare(
        self, batch: int, q_len: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if batch != self.batch_size or self.filled + q_len > self.max_len:
            raise RoseError(
                f"offloaded cache holds {self.batch_size} row(s) x {self.max_len} positions: "
                f"{batch} row(s) with past ({self.filled}) + new ({q_len}) = "
                f"{self.filled + q_len} do not fit"
            )
        self.past_len, self.filled = self.filled, self.filled + q_len
        self._prefetch(0)  # the first layer's past, while the embedding runs
        return filled_positions_and_mask(self.past_len, q_len, self.pad_lengths, device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> LayerPast:
        slot = layer % 2
        k_slot, v_slot = self.slots[slot]
        if self.copy_stream is not None:  # this layer's past has landed in its slot
            torch.cuda.current_stream(self.device).wait_event(self.ready[slot])
        new = slice(self.past_len, self.filled)
        k_slot[new].copy_(k.permute(TIME_MAJOR))
        v_slot[new].copy_(v.permute(TIME_MAJOR))
        with self._after_compute():
            # Only the new positions go back: the host holds the rest already.
            self.host_k[layer][new].copy_(k_slot[new], non_blocking=True)
            self.host_v[layer][new].copy_(v_slot[new], non_blocking=True)
        self.copied_to_host += 2 * k_slot[new].nbytes
        if layer + 1 < self.n_layer:
            self._prefetch(layer + 1)
        held = slice(0, self.filled)
        return k_slot[held].permute(HEADS_FIRST), v_slot[held].permute(HEADS_FIRST)

    # -- the copies --

    def _prefetch(self, layer: int) -> None:
        """Queue the copy of `layer`'s held past into its slot (the new positions are
        written there by `update`)."""
        k_slot, v_slot = self.slots[layer % 2]
        past = slice(0, self.past_len)
        with self._after_compute():
            k_slot[past].copy_(self.host_k[layer][past], non_blocking=True)
            v_slot[past].copy_(self.host_v[layer][past], non_blocking=True)
            if self.copy_stream is not None:
                self.ready[layer % 2].record(self.copy_stream)
        self.copied_to_device += 2 * k_slot[past].nbytes

    def _after_compute(self) -> contextlib.AbstractContextManager:
        """Where the copies run: on a GPU, the copy stream, made to wait for everything
        queued on the compute stream so far (the attention that last read the slot being
        overwritten, the new keys being copied out); elsewhere, right here, in order."""
        if self.copy_stream is None:
            return contextlib.nullcontext()
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.copy_stream)

    def _wait_for_copies(self) -> None:
        """Before the CPU reads the host buffers: the write-backs have landed."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
