"""KV caches: where the generation loop keeps the keys and values of tokens already seen.

The model is stateless; a cache is owned by the loop and handed to the model on each
call. Both kinds here answer the same three questions for the loop:

* `seq_len`: how many positions the cache holds;
* `forward(model, ids)`: run `ids` as the tokens right after those positions and
  return the logits of the last one, remembering their keys and values;
* `fork(n)`: n independent copies (for several continuations of one prefix);
* `reset(pad_lengths)`: forget everything; rows of a batch may start with left padding,
  which is then masked out of attention and not counted in positions.

`ConcatKVCache` is the teaching version: a list of per-layer (k, v) that grows by
`torch.cat` every step, so each step copies the whole past. `StaticKVCache` is the
fast default: buffers allocated once for `max_len` positions and written in place at
`input_pos`; attention reads the whole buffer through a row slice of a precomputed
causal mask, so no step allocates or copies the past.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable

import torch

from rosetrainer.errors import RoseError
from rosetrainer.model import GPT, LayerPast, causal_mask, padding_mask


class ConcatKVCache:
    """Past keys/values as a list of per-layer (k, v), grown by concatenation."""

    def __init__(self) -> None:
        self.past_kv: list[LayerPast] | None = None
        self.pad_lengths: torch.Tensor | None = None  # (B,) left padding per row

    @property
    def seq_len(self) -> int:
        return 0 if self.past_kv is None else self.past_kv[0][0].size(2)

    def forward(self, model: GPT, ids: torch.Tensor, validate: bool = True) -> torch.Tensor:
        attention_mask = None
        if self.pad_lengths is not None:
            if self.pad_lengths.shape != (ids.size(0),):
                raise RoseError(
                    f"pad_lengths has shape {tuple(self.pad_lengths.shape)}, but {ids.size(0)} "
                    f"row(s) of ids were given: give one left-padding length per row"
                )
            # The model wants the mask over past + new: a slot is real once past the padding.
            slots = torch.arange(self.seq_len + ids.size(1), device=ids.device)
            attention_mask = slots[None, :] >= self.pad_lengths[:, None]
        out = model(
            ids,
            past_kv=self.past_kv,
            use_cache=True,
            attention_mask=attention_mask,
            last_only=True,
            validate=validate,
        )
        self.past_kv = out.past_kv
        return out.logits[:, -1, :]

    def reset(self, pad_lengths: torch.Tensor | None = None) -> None:
        self.past_kv = None
        self.pad_lengths = pad_lengths

    def fork(self, n: int) -> list[ConcatKVCache]:
        """n caches for n continuations. They may share the past tensors: concatenation
        builds new tensors and never writes into old ones, so no copy is needed."""
        forks = []
        for _ in range(n):
            fork = ConcatKVCache()
            fork.past_kv = None if self.past_kv is None else list(self.past_kv)
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
        compile_decode: str | None = None,
    ) -> None:
        cfg = model.config
        weight = model.lm_head.weight  # the cache lives where the weights do, in their dtype
        self.max_len = cfg.block_size if max_len is None else max_len
        if not 0 < self.max_len <= cfg.block_size:
            raise RoseError(
                f"a static cache holds 1..block_size ({cfg.block_size}) positions, "
                f"got max_len={self.max_len}"
            )
        shape = (batch_size, cfg.n_head, self.max_len, cfg.head_dim)
        self.layers = [
            StaticLayerCache(
                torch.zeros(shape, device=weight.device, dtype=weight.dtype),
                torch.zeros(shape, device=weight.device, dtype=weight.dtype),
            )
            for _ in range(cfg.n_layer)
        ]
        # The full (max_len, max_len) causal mask, once; a step reads rows input_pos of it.
        self.causal_rows = causal_mask(self.max_len, self.max_len, weight.device)
        if compile_decode is not None and compile_decode not in COMPILE_MODES:
            raise RoseError(
                f"compile_decode is one of {', '.join(COMPILE_MODES)} (or None for eager), "
                f"got {compile_decode!r}"
            )
        # One-token decode steps all have the same shapes, so they compile to one graph.
        self.compile_decode = compile_decode
        self.reset()

    @property
    def batch_size(self) -> int:
        return self.layers[0].k.size(0)

    def reset(self, pad_lengths: torch.Tensor | None = None) -> None:
        """Forget every position; the buffers stay (stale slots are masked until rewritten)."""
        if pad_lengths is not None and pad_lengths.shape != (self.batch_size,):
            raise RoseError(
                f"pad_lengths has shape {tuple(pad_lengths.shape)}, but the cache holds "
                f"{self.batch_size} rows: give one left-padding length per row"
            )
        self.seq_len = 0
        self.pad_lengths = pad_lengths
        self.real_slots = None  # (B, max_len): slot holds a real token, not padding
        if pad_lengths is not None:
            slots = torch.arange(self.max_len, device=self.causal_rows.device)
            self.real_slots = slots[None, :] >= pad_lengths[:, None]

    # -- what the model asks of a preallocated cache --

    def position_ids(self, input_pos: torch.Tensor) -> torch.Tensor:
        # Slot i holds the token at position i, less the row's left padding.
        if self.pad_lengths is None:
            return input_pos
        return (input_pos[None, :] - self.pad_lengths[:, None]).clamp(min=0)

    def mask_rows(self, input_pos: torch.Tensor) -> torch.Tensor:
        rows = self.causal_rows[input_pos]
        if self.real_slots is None:
            return rows
        return padding_mask(rows, self.real_slots)

    # -- what the generation loop asks of a cache --

    def forward(self, model: GPT, ids: torch.Tensor, validate: bool = True) -> torch.Tensor:
        B, T = ids.shape
        if B != self.batch_size or self.seq_len + T > self.max_len:
            raise RoseError(
                f"static cache holds {self.batch_size} row(s) x {self.max_len} positions: "
                f"{B} row(s) with past ({self.seq_len}) + new ({T}) = {self.seq_len + T} do not fit"
            )
        input_pos = torch.arange(self.seq_len, self.seq_len + T, device=ids.device)
        if T == 1 and self.compile_decode is not None:
            logits = compiled_static_step(self.compile_decode)(model, ids, input_pos, self)
        else:
            logits = static_step(model, ids, input_pos, self, validate=validate)
        self.seq_len += T
        return logits

    def fork(self, n: int) -> list[StaticKVCache]:
        """n caches for n continuations: the buffers are written in place, so each fork
        gets its own copy (copy-on-fork)."""
        forks = []
        for _ in range(n):
            fork = copy.copy(self)
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


# How the one-token step may be compiled:
# * "default": inductor fuses the small ops (layer norms, GELU, the cache write,
#   attention's softmax) around the usual matmul library calls; compiles in seconds.
# * "max-autotune": the weights are frozen into the graph as constants, so they can be
#   packed once for the matmul kernels, and inductor times its own generated matmul
#   kernels against the library's and keeps the faster. For one-row decode matmuls on a
#   CPU without native bf16 its kernels win clearly in bf16. Compiling takes a minute or
#   two, and frozen weights are read once: changing them in place afterwards is not seen.
COMPILE_MODES = ("default", "max-autotune")


@functools.cache
def compiled_static_step(mode: str = "default") -> Callable[..., torch.Tensor]:
    """`static_step` through torch.compile, built on first use (importing dynamo is slow)."""
    if mode == "default":
        return torch.compile(static_step, dynamic=False, fullgraph=True)
    from torch._inductor import config as inductor_config  # (imported on demand: slow)

    # CUDA graphs stay off: they would need the step's inputs at fixed addresses.
    step = torch.compile(
        static_step, dynamic=False, fullgraph=True, mode="max-autotune-no-cudagraphs"
    )

    def frozen_step(*args: object) -> torch.Tensor:
        # Dynamo reads the freezing flag while it traces (and guards on the weights' identity,
        # so another model compiles anew); torch.compile's options only reach inductor.
        # The autotuner would report every kernel timing on stderr (and trip a deprecation
        # warning inside torch): the compile stays quiet instead.
        quiet = dict(max_autotune_report_choices_stats=False, autotune_num_choices_displayed=0)
        with inductor_config.patch(freezing=True, **quiet), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
            return step(*args)

    return frozen_step
