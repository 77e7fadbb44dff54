"""The rows of a batch: what every loop that runs several requests together needs.

The teaching loop (roseinfer/loops/generate.py), the split model (roseinfer/pipeline/)
and the engine each hold a batch of requests, one row per request. What a row needs
does not depend on which of them runs it, so it is written here once (without torch:
the onnxruntime loop takes it too; `sample_rows` is in roseinfer/request/sampling.py):

* `make_sequences`: one checked `Sequence` per prompt;
* `left_pad`: rows of different lengths as one rectangle, padding on the left;
* the window policy past the context (`window_start`, `checked_keep`, `slid_starts`,
  `windows`): GPT-2's positions are learned only up to `block_size`, so a cache cannot
  slide by one token (every cached key was computed at a position that would have to
  shift). When a row outgrows the window, its view is cut back to its last `keep`
  tokens, and a cached loop re-prefills those; the uncached oracle reads exactly the
  same window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from roseinfer.request.sampling_params import SamplingParams, params_per_prompt
from roseinfer.request.sequence import Sequence
from roseinfer.request.structured import grammar_for
from rosetrainer.errors import RoseError

if TYPE_CHECKING:
    from torch import nn

    from rosetrainer.tokenizer import Tokenizer


def make_sequences(
    model: nn.Module,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    eot_id: int | None,
    decode: Callable[[list[int]], str] | None,
    tokenizer: Tokenizer | None = None,
) -> list[Sequence]:
    """One checked Sequence per prompt, its random stream where the model's weights are;
    `tokenizer` compiles the grammars of requests with structured output."""
    params = params_per_prompt(prompts, params, model.config.block_size)
    device = next(model.parameters()).device  # (a pipeline stage may hold no lm_head)
    return [
        Sequence(
            list(prompt),
            p,
            eos_id=eot_id,
            decode=decode,
            device=device,
            grammar=grammar_for(p.structured_outputs, tokenizer, model.config.vocab_size),
        )
        for prompt, p in zip(prompts, params, strict=True)
    ]


def left_pad(rows: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """The rows left-padded to the longest one, and each row's padding length.

    Padding ids are never attended to (the caches mask them and count positions over
    real tokens only), so any id in the vocabulary will do: 0.
    """
    longest = max(map(len, rows))
    pads = [longest - len(row) for row in rows]
    return [[0] * pad + row for pad, row in zip(pads, rows, strict=True)], pads


def window_start(start: int, seq_len: int, block_size: int | None, keep: int) -> int:
    """Where the model's view of a `seq_len`-token sequence begins.

    The view starts at `start` until it would exceed `block_size` tokens; then it is
    cut back to the last `keep` tokens. Every loop calls this at every step.
    block_size None: the model has no limit (`context_limit`), the view is never cut.
    """
    if block_size is not None and seq_len - start > block_size:
        return seq_len - keep
    return start


def context_limit(model: nn.Module) -> int | None:
    """How many tokens the model may read at once: block_size, or None when unbounded (a
    rotary model with a sliding window: no position ever runs out)."""
    return None if model.config.unbounded else model.config.block_size


def slid_starts(
    starts: list[int], rows: list[list[int]], block_size: int | None, keep: int
) -> list[int] | None:
    """Each row's window start after its newest token, or None if no window moved.

    When one moves, a cached loop starts its cache afresh from the kept tokens of every
    row (a re-prefill): the cached keys sit at positions that would all have to shift.
    """
    new = [window_start(s, len(row), block_size, keep) for s, row in zip(starts, rows, strict=True)]
    return None if new == starts else new


def windows(rows: list[list[int]], starts: list[int]) -> list[list[int]]:
    """Each row's tokens from its window start on (new lists: the rows keep growing)."""
    return [row[start:] for row, start in zip(rows, starts, strict=True)]


def checked_keep(model: nn.Module, keep: int | None = None) -> int:
    """Tokens kept when the window is full (None: block_size // 2), checked.

    keep = block_size slides the window by one token every step (nanoGPT's crop): the
    cached path then re-prefills block_size tokens at every step past the window.
    """
    block_size = model.config.block_size
    keep = block_size // 2 if keep is None else keep
    if not 1 <= keep <= block_size:
        raise RoseError(f"window_keep must be in [1, block_size = {block_size}], got {keep}")
    return keep
