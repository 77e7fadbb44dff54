"""KV caches: where the generation loop keeps the keys and values of tokens already seen.

The model is stateless; a cache is owned by the loop and handed to the model on each
call. Both kinds here answer the same three questions for the loop:

* `seq_len`: how many positions the cache holds;
* `forward(model, ids)`: run `ids` as the tokens right after those positions and
  return the logits of the last one, remembering their keys and values;
* `fork(n)`: n independent copies (for several continuations of one prefix).

`ConcatKVCache` is the teaching version: a list of per-layer (k, v) that grows by
`torch.cat` every step, so each step copies the whole past. `StaticKVCache` is the
fast default: buffers allocated once for `max_len` positions and written in place at
`input_pos`; attention reads the whole buffer through a row slice of a precomputed
causal mask, so no step allocates or copies the past.
"""

from __future__ import annotations

import functools

import torch

from rosetrainer.errors import RoseError
from rosetrainer.model import GPT, LayerPast, causal_mask


class ConcatKVCache:
    """Past keys/values as a list of per-layer (k, v), grown by concatenation."""

    def __init__(self) -> None:
        self.past_kv: list[LayerPast] | None = None

    @property
    def seq_len(self) -> int:
        return 0 if self.past_kv is None else self.past_kv[0][0].size(2)

    def forward(self, model: GPT, ids: torch.Tensor, validate: bool = True) -> torch.Tensor:
        out = model(ids, past_kv=self.past_kv, use_cache=True, last_only=True, validate=validate)
        self.past_kv = out.past_kv
        return out.logits[:, -1, :]

    def reset(self) -> None:
        self.past_kv = None

    def fork(self, n: int) -> list[ConcatKVCache]:
        """n caches that share nothing: each continuation may grow its own."""
        forks = []
        for _ in range(n):
            fork = ConcatKVCache()
            if self.past_kv is not None:
                fork.past_kv = [(k.clone(), v.clone()) for k, v in self.past_kv]
            forks.append(fork)
        return forks


class StaticLayerCache:
    """One layer's preallocated (B, n_head, max_len, head_dim) key and value buffers."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = k
        self.v = v

    def update(
        self, input_pos: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Write the new keys/values into their slots along time, in place; hand back the
        # whole buffers (slots not yet written are hidden by the mask rows).
        self.k.index_copy_(2, input_pos, k_new)
        self.v.index_copy_(2, input_pos, v_new)
        return self.k, self.v


class StaticKVCache:
    """Preallocated keys/values for `max_len` positions, written in place at `input_pos`."""

    def __init__(
        self,
        model: GPT,
        batch_size: int = 1,
        max_len: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        compile_decode: bool = False,
    ) -> None:
        cfg = model.config
        weight = model.lm_head.weight
        self.max_len = cfg.block_size if max_len is None else max_len
        if not 0 < self.max_len <= cfg.block_size:
            raise RoseError(
                f"a static cache holds 1..block_size ({cfg.block_size}) positions, "
                f"got max_len={self.max_len}"
            )
        device = weight.device if device is None else torch.device(device)
        dtype = weight.dtype if dtype is None else dtype
        shape = (batch_size, cfg.n_head, self.max_len, cfg.head_dim)
        self.layers = [
            StaticLayerCache(
                torch.zeros(shape, device=device, dtype=dtype),
                torch.zeros(shape, device=device, dtype=dtype),
            )
            for _ in range(cfg.n_layer)
        ]
        # The full (max_len, max_len) causal mask, once; a step reads rows input_pos of it.
        self.causal_rows = causal_mask(self.max_len, self.max_len, device)
        self.seq_len = 0
        # One-token decode steps all have the same shapes, so they compile to one graph.
        self.compile_decode = compile_decode

    # -- what the model asks of a preallocated cache --

    def position_ids(self, input_pos: torch.Tensor) -> torch.Tensor:
        # Slot i holds the token at position i, so positions are the slots themselves.
        return input_pos

    def mask_rows(self, input_pos: torch.Tensor) -> torch.Tensor:
        return self.causal_rows[input_pos]

    # -- what the generation loop asks of a cache --

    def forward(self, model: GPT, ids: torch.Tensor, validate: bool = True) -> torch.Tensor:
        T = ids.size(1)
        if self.seq_len + T > self.max_len:
            raise RoseError(
                f"static cache holds {self.max_len} positions: past ({self.seq_len}) + new ({T}) "
                f"= {self.seq_len + T} do not fit"
            )
        input_pos = torch.arange(self.seq_len, self.seq_len + T, device=ids.device)
        logits = self.step(model, ids, input_pos, validate=validate)
        self.seq_len += T
        return logits

    def step(
        self, model: GPT, ids: torch.Tensor, input_pos: torch.Tensor, validate: bool = False
    ) -> torch.Tensor:
        """The model call alone, with the slots given: static shapes, so it can be compiled."""
        out = model(
            ids,
            past_kv=self,
            use_cache=True,
            input_pos=input_pos,
            last_only=True,
            validate=validate,
        )
        return out.logits[:, -1, :]

    def reset(self) -> None:
        """Forget every position; the buffers stay (stale slots are masked until rewritten)."""
        self.seq_len = 0

    def fork(self, n: int) -> list[StaticKVCache]:
        forks = []
        for _ in range(n):
            fork = object.__new__(StaticKVCache)
            fork.max_len, fork.causal_rows = self.max_len, self.causal_rows
            fork.seq_len, fork.compile_decode = self.seq_len, self.compile_decode
            fork.layers = [StaticLayerCache(lc.k.clone(), lc.v.clone()) for lc in self.layers]
            forks.append(fork)
        return forks


def static_step(
    model: GPT,
    ids: torch.Tensor,
    input_pos: torch.Tensor,
    cache: StaticKVCache,
    validate: bool = False,
) -> torch.Tensor:
    """One model call on a static cache, slots given: last-position logits (B, vocab)."""
    out = model(
        ids, past_kv=cache, use_cache=True, input_pos=input_pos, last_only=True, validate=validate
    )
    return out.logits[:, -1, :]


@functools.cache
def compiled_static_step():
    """`static_step` through torch.compile, built on first use (importing dynamo is slow)."""
    return torch.compile(static_step, dynamic=False, fullgraph=True)
