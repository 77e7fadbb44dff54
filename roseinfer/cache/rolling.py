"""Caches for a sliding-window model: memory that stops growing at the window.

A model with `sliding_window = W` (and `attention_sinks = S`) lets a query at position
p see keys p - W + 1 .. p, and the first S positions. Nothing older is ever read
again, so a cache needs only S + W slots, however long the sequence grows. Two forms:

* `RollingKVCache` (form a, the one that keeps the oracle's promise): S sink slots,
  then W slots written modulo W (position p >= S goes to slot S + (p - S) % W). Keys
  keep their true positions, which grow without end, so for a rotary model (whose
  scores depend on distances only, all below W) the tokens equal the uncached
  forward under `banded_mask`, token for token, arbitrarily far past block_size.
* `ReRotatingSinkCache` (form b, StreamingLLM's and Hugging Face's SinkCache): keys
  are numbered by their place *in the cache*, so positions never leave the trained
  range. When the window moves on, the oldest keys are dropped and the ones left
  move closer to the front: each is turned back by the number dropped (rotation by
  delta composes: `apply_rotary` at p, then by delta, is the key at p + delta). It
  is *not* equal to any one uncached forward: every kept key was computed by layers
  that saw the sinks at other distances. Chapter 18 measures how far it drifts.
"""

from __future__ import annotations

import copy

import torch

from rosetrainer import model as gpt
from rosetrainer.errors import RoseError
from rosetrainer.model import GPT, LayerPast


def rolling_slot(pos: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """Where position `pos` is kept: a sink in its own slot in front, every later position
    modulo the window after them (a new position takes the slot of the one W before it,
    which has just left every later query's window)."""
    return torch.where(pos < sinks, pos, sinks + (pos - sinks) % window)


class RollingKVCache:
    """S sink slots and W window slots per layer, written modulo W; true positions.

    Rows of a batch may start with left padding (`reset(pad_lengths)`): padding is never
    written, and each row counts its own positions. `slot_pos` says which position each
    slot holds (-1: empty); the mask is computed from it, not from slot order.
    """

    windowed = True  # it honours the model's sliding window (the generate loop asks)
    compilable = False  # a static shape, but not yet a compiled decode path

    def __init__(self, model: GPT, batch_size: int = 1, max_len: int | None = None) -> None:
        """max_len: the most tokens a row will be fed (padding included), when known. A
        run that never fills S + W slots needs only max_len of them (a model trained
        with a window of a trillion tokens generates 100 on 100 slots); the cache then
        refuses to be fed more. None: S + W slots, enough for a sequence of any length."""
        cfg = model.config
        if cfg.sliding_window is None:
            raise RoseError(
                "a rolling cache needs a model with a sliding window (GPTConfig.sliding_window)"
            )
        self.window, self.sinks = cfg.sliding_window, cfg.attention_sinks
        if max_len is not None and max_len < 1:
            raise RoseError(f"max_len must be >= 1, got {max_len}")
        slots = self.sinks + self.window
        # Below S + W slots nothing ever rolls: position p stays in slot p.
        self.max_len = max_len if max_len is not None and max_len < slots else None
        weight = model.transformer.h[0].attn.c_attn.weight
        shape = (batch_size, cfg.kv_heads, self.max_len or slots, cfg.head_dim)
        self.k = [weight.new_zeros(shape) for _ in range(cfg.n_layer)]
        self.v = [weight.new_zeros(shape) for _ in range(cfg.n_layer)]
        self.reset()

    @property
    def batch_size(self) -> int:
        return self.k[0].size(0)

    @property
    def seq_len(self) -> int:
        """Tokens fed so far per row (padding included), however few are still held."""
        return self.fed

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    def filled_kv(self) -> list[LayerPast]:
        """The held keys and values, in slot order (their positions are in slot_pos)."""
        return list(zip(self.k, self.v, strict=True))

    def check_rows(self, rows: int) -> None:
        if rows != self.batch_size:
            raise RoseError(
                f"the rolling cache holds {self.batch_size} row(s) but {rows} prompt(s) were "
                f"given: build it with RollingKVCache(model, batch_size={rows})"
            )

    def reset(self, pad_lengths: torch.Tensor | None = None) -> None:
        device = self.k[0].device
        if pad_lengths is None:
            pad_lengths = torch.zeros(self.batch_size, dtype=torch.long, device=device)
        if pad_lengths.shape != (self.batch_size,):
            raise RoseError(
                f"pad_lengths has shape {tuple(pad_lengths.shape)}, but the cache holds "
                f"{self.batch_size} rows: give one left-padding length per row"
            )
        self.fed = 0
        self.next_pos = -pad_lengths.to(device)  # a row's next position (< 0: padding)
        self.slot_pos = torch.full_like(self.k[0][:, 0, :, 0], -1, dtype=torch.long)

    # -- what the model asks of a cache (rosetrainer.model.KVCache) --

    def prepare(
        self, batch: int, q_len: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if batch != self.batch_size:
            raise RoseError(
                f"the rolling cache holds {self.batch_size} row(s), but {batch} row(s) of ids "
                f"were given: build it with RollingKVCache(model, batch_size={batch})"
            )
        if self.max_len is not None and self.fed + q_len > self.max_len:
            raise RoseError(
                f"the rolling cache was built for {self.max_len} tokens per row and would "
                f"be fed {self.fed + q_len}: build it with a larger max_len (or None)"
            )
        pos = self.next_pos[:, None] + torch.arange(q_len, device=device)  # (B, q_len)
        # The new queries attend over the held slots, then the new keys themselves.
        key_pos = torch.cat([self.slot_pos, pos.clamp(min=-1)], dim=1)
        mask = gpt.window_mask(pos[:, :, None], key_pos[:, None, :], self.window, self.sinks)
        mask &= key_pos[:, None, :] >= 0
        mask |= ~mask.any(dim=-1, keepdim=True)  # a padding query: any key, never read
        # Which new tokens stay: not padding, and a sink or among the row's last W.
        keep = (pos >= 0) & ((pos < self.sinks) | (pos > pos[:, -1:] - self.window))
        self.write_rows, self.write_cols = keep.nonzero(as_tuple=True)
        kept_pos = pos[self.write_rows, self.write_cols]
        # (looked up in this module at every call, so the chapter's exercise can swap it)
        self.write_slots = rolling_slot(kept_pos, self.window, self.sinks)
        self.slot_pos[self.write_rows, self.write_slots] = kept_pos
        self.next_pos = self.next_pos + q_len
        self.fed += q_len
        return pos.clamp(min=0), mask[:, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> LayerPast:
        keys = torch.cat([self.k[layer], k], dim=2)
        values = torch.cat([self.v[layer], v], dim=2)
        # Then overwrite the slots the kept tokens go to (the old keys there are out of
        # every later query's window; this step's queries already have them above).
        rows, cols, slots = self.write_rows, self.write_cols, self.write_slots
        self.k[layer][rows, :, slots] = k[rows, :, cols]
        self.v[layer][rows, :, slots] = v[rows, :, cols]
        return keys, values

    def truncate(self, n: int) -> None:
        """A rolling cache cannot move back: each new key took the slot of the key one
        window before it, and that key is gone."""
        raise RoseError(
            "a rolling cache cannot be rolled back (new keys overwrite the oldest ones): "
            "speculative decoding of a sliding-window model runs in the engine's paged pool"
        )

    def fork(self, n: int) -> list[RollingKVCache]:
        """n caches for n continuations; the slots are written in place, so each gets a copy."""
        forks = []
        for _ in range(n):
            fork = copy.copy(self)
            fork.k, fork.v = [t.clone() for t in self.k], [t.clone() for t in self.v]
            fork.slot_pos, fork.next_pos = self.slot_pos.clone(), self.next_pos.clone()
            forks.append(fork)
        return forks


def rerotate(k: torch.Tensor, delta: int, base: float = 10000.0) -> torch.Tensor:
    """Keys rotated at their positions p -> the same keys at p + delta (delta may be < 0),
    by the model's rotary base."""
    angle = torch.tensor([[delta]], device=k.device)
    return gpt.apply_rotary(k, *gpt.rotary_cos_sin(angle, k.size(-1), base))


class ReRotatingSinkCache:
    """Form b: one row; the sinks, then the last W - 1 keys, numbered by cache place.

    A new token stands at the cache's length (at most S + W - 1), so positions stay
    below S + W whatever the sequence length; when more than S + W - 1 keys are held,
    the oldest window keys go and the others are turned back by as many places.
    """

    windowed = True
    compilable = False

    def __init__(self, model: GPT) -> None:
        cfg = model.config
        if cfg.position_embedding != "rotary" or cfg.sliding_window is None:
            raise RoseError("re-rotating keys needs a rotary model with a sliding window")
        self.window, self.sinks = cfg.sliding_window, cfg.attention_sinks
        self.rotary_base = cfg.rotary_base
        self.reset()

    def reset(self, pad_lengths: torch.Tensor | None = None) -> None:
        if pad_lengths is not None:
            raise RoseError("the re-rotating sink cache holds one row without padding")
        self.layers: list[LayerPast] = []
        self.fed = 0

    @property
    def seq_len(self) -> int:
        return self.fed

    @property
    def held(self) -> int:
        return self.layers[0][0].size(2) if self.layers else 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for pair in self.layers for t in pair)

    def filled_kv(self) -> list[LayerPast]:
        return list(self.layers)

    def check_rows(self, rows: int) -> None:
        if rows != 1:
            raise RoseError(f"the re-rotating sink cache holds one row, but {rows} were given")

    def prepare(
        self, batch: int, q_len: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if batch != 1:
            raise RoseError("the re-rotating sink cache holds one row; generate one prompt")
        dropped = max(0, self.held - (self.sinks + self.window - 1))
        if dropped:
            self._drop_oldest(dropped)
        held = self.held
        self.fed += q_len
        pos = gpt.position_ids(held, q_len, device)[None, :]
        return pos, gpt.banded_mask(q_len, held + q_len, self.window, self.sinks, device)

    def _drop_oldest(self, dropped: int) -> None:
        """Forget the `dropped` oldest window entries; the keys left move as many places
        forward, so they are turned back by as many positions."""
        s = self.sinks
        for layer, (k, v) in enumerate(self.layers):
            k = torch.cat(
                [k[:, :, :s], rerotate(k[:, :, s + dropped :], -dropped, self.rotary_base)], dim=2
            )
            v = torch.cat([v[:, :, :s], v[:, :, s + dropped :]], dim=2)
            self.layers[layer] = (k, v)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> LayerPast:
        if layer < len(self.layers):
            self.layers[layer] = gpt.concat_kv(self.layers[layer], k, v)
        else:
            self.layers.append((k, v))
        return self.layers[layer]
