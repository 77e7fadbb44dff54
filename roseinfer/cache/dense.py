"""KV caches: where a generation loop keeps the keys and values of tokens already seen.

The model is stateless; a cache is owned by the loop and handed to the model on each
call. Each cache here implements `rosetrainer.model.KVCache` (`prepare` and `update`)
and answers the loop's own questions:

* `seq_len`: how many positions it holds (per row, padding included);
* `reset(pad_lengths)`: forget everything; rows of a batch may start with left padding,
  which is then masked out of attention and not counted in positions;
* `fork(n)`: n independent copies (for several continuations of one prefix);
* `truncate(n)`: keep only the first n positions (speculative decoding rolls a cache
  back past the drafted tokens the target rejected);
* `nbytes`: the bytes its keys and values take; `filled_kv()`: the keys and values of
  the positions filled so far; `check_rows(n)`: a clear error before a batch of n rows
  that it cannot take; `compilable`: whether its decode steps all have one shape.

`DenseKVCache` names that interface, so a loop or a tool asks the cache instead of
branching on its class.

`ConcatKVCache` is the teaching version: a list of per-layer (k, v) grown by
`torch.cat` every step, so each step copies the whole past. It computes its mask and
positions with the named invariant functions of `rosetrainer.model` (looked up there at
every call, so a chapter can swap one for its buggy version). `StaticKVCache` is the
fast default: buffers allocated once for `max_len` positions and written in place at
`input_pos`; attention reads the whole buffer through rows of a precomputed causal
mask, so no step allocates or copies the past.
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from rosetrainer import model as gpt
from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError
from rosetrainer.model import KVCache, LayerPast

CACHE_KINDS = ("static", "concat")  # what `new_cache` builds (the split model's --cache)


class DenseKVCache(KVCache, Protocol):
    """A model cache (rosetrainer.model.KVCache) as the generation loops hold it: one
    row of positions per sequence (concat, static, quantized, offloaded)."""

    compilable: bool
    windowed: bool  # honours the model's sliding window (the rolling caches)
    pad_lengths: torch.Tensor | None

    @property
    def seq_len(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def reset(self, pad_lengths: torch.Tensor | None = None) -> None: ...

    def fork(self, n: int) -> list[DenseKVCache]: ...

    def truncate(self, n: int) -> None: ...

    def filled_kv(self) -> list[LayerPast]: ...

    def check_rows(self, rows: int) -> None: ...


class Blocks(Protocol):
    """What a preallocated cache is sized from: a GPT, or a pipeline stage that holds
    only its own blocks (numbered from 0 there)."""

    config: GPTConfig
    transformer: nn.ModuleDict


class ConcatKVCache:
    """Past keys/values as a list of per-layer (k, v), grown by concatenation."""

    compilable = False  # the past grows every step: each step has a new shape
    windowed = False  # it keeps every position

    def __init__(self) -> None:
        self.past_kv: list[LayerPast] = []  # one (k, v) per layer, (B, n_head, seq_len, head_dim)
        self.pad_lengths: torch.Tensor | None = None  # (B,) left padding per row

    @property
    def seq_len(self) -> int:
        return self.past_kv[0][0].size(2) if self.past_kv else 0

    def prepare(
        self, batch: int, q_len: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.past_kv:
            if self.past_kv[0][0].size(0) != batch:
                raise RoseError(
                    f"the cache holds {self.past_kv[0][0].size(0)} row(s), but {batch} row(s) "
                    f"of ids were given: continue the batch the cache was filled with"
                )
        if self.pad_lengths is not None and self.pad_lengths.shape != (batch,):
            raise RoseError(
                f"pad_lengths has shape {tuple(self.pad_lengths.shape)}, but {batch} row(s) "
                f"of ids were given: give one left-padding length per row"
            )
        return filled_positions_and_mask(self.seq_len, q_len, self.pad_lengths, device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> LayerPast:
        if layer < len(self.past_kv):
            self.past_kv[layer] = gpt.concat_kv(self.past_kv[layer], k, v)
        else:  # the first call: this layer has no past yet
            self.past_kv.append(gpt.concat_kv(None, k, v))
        return self.past_kv[layer]

    def reset(self, pad_lengths: torch.Tensor | None = None) -> None:
        self.past_kv = []
        self.pad_lengths = pad_lengths

    def truncate(self, n: int) -> None:
        """Keep the first n positions: every layer's keys and values cut along time."""
        check_truncate(n, self.seq_len)
        self.past_kv = [(k[:, :, :n], v[:, :, :n]) for k, v in self.past_kv]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for pair in self.past_kv for t in pair)

    def filled_kv(self) -> list[LayerPast]:
        return list(self.past_kv)

    def check_rows(self, rows: int) -> None:
        """Any number of rows: the first prefill sets it (`prepare` checks later steps)."""

    @classmethod
    def stacked(cls, caches: list[ConcatKVCache]) -> ConcatKVCache:
        """One left-padded batch of one-row caches of different lengths (each row's padding
        masked, its positions its own), to run them in one call; `unstacked` splits it."""
        if len(caches) == 1:
            return caches[0]
        lengths = [cache.seq_len for cache in caches]
        longest = max(lengths)
        batch = cls()
        for layer in range(len(caches[0].past_kv)):
            # (1, n_head, len, head_dim) each, padded on the left along time to the longest
            k, v = (
                torch.cat(
                    [F.pad(cache.past_kv[layer][i], (0, 0, longest - n, 0)) for cache, n in
                     zip(caches, lengths, strict=True)]
                )
                for i in (0, 1)
            )  # fmt: skip
            batch.past_kv.append((k, v))
        device = batch.past_kv[0][0].device
        batch.pad_lengths = torch.tensor([longest - n for n in lengths], device=device)
        return batch

    def unstacked(self) -> list[ConcatKVCache]:
        """The rows of a `stacked` batch as one-row caches again, without their padding
        (views: nothing is copied)."""
        if self.pad_lengths is None:
            return [self]
        rows = []
        for row, pad in enumerate(self.pad_lengths.tolist()):
            cache = ConcatKVCache()
            cache.past_kv = [
                (k[row : row + 1, :, pad:], v[row : row + 1, :, pad:]) for k, v in self.past_kv
            ]
            rows.append(cache)
        return rows

    def fork(self, n: int) -> list[ConcatKVCache]:
        """n caches for n continuations. They may share the past tensors: concatenation
        builds new tensors and never writes into old ones, so no copy is needed."""
        forks = []
        for _ in range(n):
            fork = ConcatKVCache()
            fork.past_kv = list(self.past_kv)
            fork.pad_lengths = self.pad_lengths
            forks.append(fork)
        return forks


class StaticLayerCache:
    """One layer's preallocated (B, n_head, max_len, head_dim) key and value buffers."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = k
        self.v = v

    def update(
        self, input_pos: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> LayerPast:
        # Write the new keys/values into their slots along time, in place; hand back the
        # whole buffers (slots not yet written are hidden by the mask rows).
        self.k.index_copy_(2, input_pos, k_new)
        self.v.index_copy_(2, input_pos, v_new)
        return self.k, self.v


class StaticKVCache:
    """Preallocated keys/values for `max_len` positions, written in place at `input_pos`.

    How many slots are filled is kept as a tensor (`filled`), not a Python int, so a
    compiled decode step reads and advances it inside the graph: every one-token step
    then has the same inputs and runs the same compiled graph.
    """

    compilable = True  # every decode step has the same shapes: torch.compile can take it
    windowed = False

    def __init__(self, model: Blocks, batch_size: int = 1, max_len: int | None = None) -> None:
        # One buffer pair per block the model holds (a pipeline stage holds only its own,
        # and they are numbered from 0 there), where the blocks' weights live, in their dtype.
        cfg = model.config
        blocks = model.transformer.h
        weight = blocks[0].attn.c_attn.weight
        self._init_slots(cfg, max_len, weight.device)
        shape = (batch_size, cfg.kv_heads, self.max_len, cfg.head_dim)
        self.layers = [
            StaticLayerCache(
                torch.zeros(shape, device=weight.device, dtype=weight.dtype),
                torch.zeros(shape, device=weight.device, dtype=weight.dtype),
            )
            for _ in range(len(blocks))
        ]
        self.reset()

    def _init_slots(self, cfg: GPTConfig, max_len: int | None, device: torch.device) -> None:
        """The slot bookkeeping any preallocated cache needs (roseinfer.cache.quantized's too)."""
        self.max_len = cfg.block_size if max_len is None else max_len
        if not 0 < self.max_len <= cfg.block_size:
            raise RoseError(
                f"a static cache holds 1..block_size ({cfg.block_size}) positions, "
                f"got max_len={self.max_len}"
            )
        # The full (max_len, max_len) causal mask, once; a step reads rows input_pos of it.
        self.causal_rows = gpt.causal_mask(self.max_len, self.max_len, device)
        self.filled = torch.zeros((), dtype=torch.long, device=device)
        self.input_pos = torch.zeros(0, dtype=torch.long, device=device)

    @property
    def batch_size(self) -> int:
        return self.layers[0].k.size(0)

    @property
    def seq_len(self) -> int:
        return int(self.filled)

    @property
    def nbytes(self) -> int:
        """The whole buffers, filled or not: they are allocated once, up front."""
        return sum(t.nbytes for layer in self.layers for t in (layer.k, layer.v))

    def filled_kv(self) -> list[LayerPast]:
        n = self.seq_len
        return [(layer.k[:, :, :n], layer.v[:, :, :n]) for layer in self.layers]

    def check_rows(self, rows: int) -> None:
        if rows != self.batch_size:
            raise RoseError(
                f"the static cache holds {self.batch_size} row(s) but {rows} prompt(s) were "
                f"given: build it with {type(self).__name__}(model, batch_size={rows})"
            )

    def reset(self, pad_lengths: torch.Tensor | None = None) -> None:
        """Forget every position; the buffers stay (stale slots are masked until rewritten)."""
        if pad_lengths is not None and pad_lengths.shape != (self.batch_size,):
            raise RoseError(
                f"pad_lengths has shape {tuple(pad_lengths.shape)}, but the cache holds "
                f"{self.batch_size} rows: give one left-padding length per row"
            )
        self.filled.zero_()
        self.pad_lengths = pad_lengths
        self.real_slots = None  # (B, max_len): slot holds a real token, not padding
        if pad_lengths is not None:
            slots = torch.arange(self.max_len, device=self.causal_rows.device)
            self.real_slots = slots[None, :] >= pad_lengths[:, None]

    def truncate(self, n: int) -> None:
        """Keep the first n positions: only the count moves back. The slots after it keep
        their stale keys, which no query sees (a query's mask row stops at its own
        position) until new tokens overwrite them."""
        check_truncate(n, self.seq_len)
        self.filled.fill_(n)

    # -- what the model asks of a cache (rosetrainer.model.KVCache) --

    def prepare(
        self, batch: int, q_len: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not torch.compiler.is_compiling():
            self._check_fits(batch, q_len)
        # The new tokens fill the next q_len slots; slot i holds the token at position i.
        self.input_pos = self.filled + torch.arange(q_len, device=self.filled.device)
        self.filled += q_len
        rows = self.causal_rows[self.input_pos]
        if self.real_slots is None:
            return self.input_pos[None, :], rows
        # Left padding: positions count real tokens only, and padding slots are masked.
        pos = (self.input_pos[None, :] - self.pad_lengths[:, None]).clamp(min=0)
        return pos, gpt.padding_mask(rows, self.real_slots)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> LayerPast:
        return self.layers[layer].update(self.input_pos, k, v)

    def _check_fits(self, batch: int, q_len: int) -> None:
        if batch != self.batch_size or self.seq_len + q_len > self.max_len:
            raise RoseError(
                f"static cache holds {self.batch_size} row(s) x {self.max_len} positions: "
                f"{batch} row(s) with past ({self.seq_len}) + new ({q_len}) = "
                f"{self.seq_len + q_len} do not fit"
            )

    def fix_addresses(self) -> None:
        """Tell torch.compile that the tensors a step reads and writes stay where they are
        (`mark_static_address`), so that a compiled step may replay as a CUDA graph
        (mode "reduce-overhead") that writes them in place."""
        tensors = [t for layer in self.layers for t in (layer.k, layer.v)]
        tensors += [self.filled, self.causal_rows]
        if self.real_slots is not None:
            tensors += [self.real_slots, self.pad_lengths]
        for tensor in tensors:
            torch._dynamo.mark_static_address(tensor)

    def fork(self, n: int) -> list[StaticKVCache]:
        """n caches for n continuations: the buffers are written in place, so each fork
        gets its own copy (copy-on-fork)."""
        forks = []
        for _ in range(n):
            fork = copy.copy(self)
            fork.layers = [StaticLayerCache(lc.k.clone(), lc.v.clone()) for lc in self.layers]
            fork.filled = self.filled.clone()
            forks.append(fork)
        return forks


def filled_positions_and_mask(
    past_len: int, q_len: int, pad_lengths: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Positions and mask of q_len new tokens after past_len held ones, for a cache whose
    attention reads exactly the past_len + q_len filled positions (the concatenating and
    the offloaded caches): the bottom-right rows of the causal mask, positions after the
    past, and with left padding (pad_lengths, one per row) the padding masked and not
    counted in positions."""
    kv_len = past_len + q_len
    if pad_lengths is None:
        pos = gpt.position_ids(past_len, q_len, device)[None, :]
        mask = None if past_len == 0 else gpt.causal_mask(q_len, kv_len, device)
        return pos, mask
    # A slot is real once past the row's padding; positions count real tokens only.
    slots = torch.arange(kv_len, device=device)
    attention_mask = slots[None, :] >= pad_lengths[:, None]
    pos = gpt.padded_position_ids(attention_mask)[:, past_len:]
    mask = gpt.padding_mask(gpt.causal_mask(q_len, kv_len, device), attention_mask)
    return pos, mask


def check_truncate(n: int, held: int) -> None:
    """A cache can be cut back to 0 .. the positions it holds, never forward."""
    if not 0 <= n <= held:
        raise RoseError(f"a cache holding {held} positions cannot be truncated to {n}")


def new_cache(model: Blocks, kind: str, rows: int, max_len: int) -> DenseKVCache:
    """A cache of `kind` (CACHE_KINDS) for the model's blocks: `rows` rows of up to
    `max_len` positions (a concat cache grows as it goes, so it takes neither)."""
    if kind == "static":
        return StaticKVCache(model, batch_size=rows, max_len=max_len)
    return ConcatKVCache()
