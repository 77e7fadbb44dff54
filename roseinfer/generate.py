"""Generation: the uncached oracle, the cached path, and the loop that stops them.

`uncached_steps` is the slow, obvious version every other path is checked against:
each step runs the model on the whole (cropped) sequence and reads the last logits.

`cached_steps` prefills the prompt once, takes the first new token from the prefill
logits, then feeds one token per step on top of a KV cache; several prompts run as
one left-padded batch, each row with its own positions and its own stop. That it equals the oracle
rests on three invariants, each a named function in `rosetrainer/model.py`:
`concat_kv` (the past is kept and extended), `causal_mask` (a new query's mask row is
the bottom row of the full mask, not the top one) and `position_ids` (a new token's
position continues after the past, it does not restart at 0).

Past the context window both paths follow one policy, `window_start`: GPT-2's
positions are learned only up to `block_size`, so a cache cannot slide by one token
(every cached key was computed at a position that would have to shift). When the
sequence outgrows the window, the view is cut back to its last `keep` tokens, and the
cached path re-prefills those; the uncached path reads exactly the same window.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from roseinfer.kv_cache import ConcatKVCache, StaticKVCache
from roseinfer.sampling import SamplingParams, sample_next_token
from rosetrainer.errors import RoseError
from rosetrainer.model import GPT

KVCache = ConcatKVCache | StaticKVCache


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None  # with sampling: one seed, one output
    stop_at_eot: bool = True
    stop_strings: tuple[str, ...] = ()
    window_keep: int | None = None  # tokens kept when the window is full; None = block_size // 2
    prefill_chunk: int | None = None  # prefill long prompts this many tokens at a time

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 0:
            raise RoseError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if any(not s for s in self.stop_strings):
            raise RoseError("stop strings must not be empty")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise RoseError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")


def window_start(start: int, seq_len: int, block_size: int, keep: int) -> int:
    """Where the model's view of a `seq_len`-token sequence begins.

    The view starts at `start` until it would exceed `block_size` tokens; then it is
    cut back to the last `keep` tokens. Both paths call this at every step.
    """
    if seq_len - start > block_size:
        return seq_len - keep
    return start


def window_keep(model: GPT, config: GenerationConfig) -> int:
    block_size = model.config.block_size
    keep = block_size // 2 if config.window_keep is None else config.window_keep
    if not 1 <= keep <= block_size - 1:
        raise RoseError(
            f"window_keep must be in [1, block_size - 1 = {block_size - 1}], got {keep}"
        )
    return keep


RowSampler = Callable[[torch.Tensor], list[int]]  # (B, vocab) logits -> one token per row


def uncached_steps(
    model: GPT, prompt: list[int], sample: RowSampler, keep: int
) -> Iterator[tuple[list[int], torch.Tensor]]:
    """The oracle: every step re-runs the model on the whole window of one row.

    Yields ([token], logits) per step, the shape the cached path yields for one row.
    """
    device = model.lm_head.weight.device
    tokens = list(prompt)
    start = 0
    while True:
        start = window_start(start, len(tokens), model.config.block_size, keep)
        idx = torch.tensor([tokens[start:]], device=device)
        logits = model(idx).logits[:, -1, :]
        new_tokens = sample(logits)
        yield new_tokens, logits
        tokens += new_tokens


def cached_steps(
    model: GPT,
    prompts: list[list[int]],
    sample: RowSampler,
    keep: int,
    cache: KVCache,
    prefill_chunk: int | None = None,
) -> Iterator[tuple[list[int], torch.Tensor]]:
    """Prefill once, then one token per row per step on top of `cache`.

    Rows of different lengths are left-padded; each row keeps its own window.
    Yields (one token per row, logits) per step.
    """
    device = model.lm_head.weight.device
    rows = [list(p) for p in prompts]
    starts = [0] * len(rows)
    logits = prefill(
        model, cache, [row[s:] for row, s in zip(rows, starts, strict=True)], prefill_chunk
    )
    while True:
        new_tokens = sample(logits)
        yield new_tokens, logits
        for row, token in zip(rows, new_tokens, strict=True):
            row.append(token)
        block_size = model.config.block_size
        new_starts = [
            window_start(s, len(r), block_size, keep) for s, r in zip(starts, rows, strict=True)
        ]
        if new_starts != starts:
            # A window is full: the cached keys sit at positions that would all have to
            # shift, so start the cache afresh from the kept tokens (re-prefill).
            starts = new_starts
            cache.reset()
            windows = [row[s:] for row, s in zip(rows, starts, strict=True)]
            logits = prefill(model, cache, windows, prefill_chunk)
        else:
            step_ids = torch.tensor(new_tokens, device=device)[:, None]
            logits = cache.forward(model, step_ids, validate=False)


def prefill(
    model: GPT, cache: KVCache, windows: list[list[int]], chunk: int | None = None
) -> torch.Tensor:
    """Feed each row's tokens into the cache; return the logits of each row's last one.

    Rows are left-padded to one length (padding masked, positions counted over real
    tokens only). A cache that already holds a row's first tokens (a shared prefix, an
    earlier turn) is fed only the rest. With `chunk`, the tokens go in chunk-sized
    pieces, each attending to everything before it through its bottom-right mask rows.
    """
    device = model.lm_head.weight.device
    if cache.seq_len > 0:
        if len(windows) != 1 or cache.seq_len >= len(windows[0]):
            raise RoseError(
                f"a cache that already holds {cache.seq_len} tokens continues one prompt "
                f"longer than that; got {len(windows)} prompt(s) of {len(windows[0])} tokens"
            )
        ids = torch.tensor([windows[0][cache.seq_len :]], device=device)
    else:
        longest = max(map(len, windows))
        pads = [longest - len(w) for w in windows]
        # Padding ids are never attended to; any id in the vocabulary will do.
        ids = torch.tensor(
            [[0] * pad + w for pad, w in zip(pads, windows, strict=True)], device=device
        )
        cache.reset(torch.tensor(pads, device=device) if max(pads) > 0 else None)
    chunk = chunk or ids.size(1)
    for i in range(0, ids.size(1), chunk):
        logits = cache.forward(model, ids[:, i : i + chunk])
    return logits


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # the new tokens (a final <|endoftext|> is not included)
    finish_reason: str  # "length", "eot" or "stop_string"
    step_logits: list[torch.Tensor] | None  # (vocab,) float32 per step, when asked for
    time_to_first_token_s: float
    total_time_s: float

    @property
    def tokens_per_s(self) -> float:
        decode_time = self.total_time_s - self.time_to_first_token_s
        n = len(self.token_ids) - 1
        return n / decode_time if n > 0 and decode_time > 0 else float("nan")


def generate(
    model: GPT,
    prompt_ids: list[int],
    config: GenerationConfig,
    *,
    use_cache: bool = True,
    cache: KVCache | None = None,
    eot_id: int | None = None,
    decode: Callable[[list[int]], str] | None = None,
    on_token: Callable[[int], None] | None = None,
    keep_logits: bool = False,
) -> GenerationResult:
    """Generate up to `config.max_new_tokens` tokens after `prompt_ids`.

    use_cache=False runs the oracle; otherwise `cache` (default: a fresh ConcatKVCache)
    carries the past. A cache that already holds the prompt's first tokens (a shared
    prefix, the earlier turns of a conversation) is fed only the rest. `eot_id` enables
    stopping at end-of-text, `decode` (ids -> text) enables stop strings, and
    `on_token` sees every kept token as it is made (streaming).
    """
    row_callback = None if on_token is None else (lambda _row, token: on_token(token))
    (result,) = generate_batch(
        model,
        [prompt_ids],
        config,
        use_cache=use_cache,
        cache=cache,
        eot_id=eot_id,
        decode=decode,
        on_token=row_callback,
        keep_logits=keep_logits,
    )
    return result


def generate_batch(
    model: GPT,
    prompts: list[list[int]],
    config: GenerationConfig,
    *,
    use_cache: bool = True,
    cache: KVCache | None = None,
    eot_id: int | None = None,
    decode: Callable[[list[int]], str] | None = None,
    on_token: Callable[[int, int], None] | None = None,
    keep_logits: bool = False,
) -> list[GenerationResult]:
    """Generate for several prompts at once; one result per prompt, in order.

    With the cache, the prompts run as one left-padded batch (a StaticKVCache must be
    built with batch_size=len(prompts)); each row stops on its own while the others go
    on. Without it, each prompt runs the oracle on its own. With sampling, every row
    draws from its own generator seeded with `config.seed`, so a row's tokens equal
    those of its prompt generated alone. `on_token(row, token)` streams.
    """
    block_size = model.config.block_size
    if not prompts:
        raise RoseError("no prompts given: pass at least one list of token ids")
    for prompt in prompts:
        if not prompt:
            raise RoseError("a prompt is empty: start it from the end-of-text token instead")
        if len(prompt) > block_size:
            raise RoseError(
                f"a prompt has {len(prompt)} tokens but the model's context (block_size) is "
                f"{block_size}: shorten the prompt"
            )
    if config.stop_strings and decode is None:
        raise RoseError("stop strings need a decode function (ids -> text)")
    keep = window_keep(model, config)

    if not use_cache:
        results = []
        for i, prompt in enumerate(prompts):
            sample = row_sampler(model, config, n_rows=1)
            steps = uncached_steps(model, prompt, sample, keep)
            row_callback = None if on_token is None else functools.partial(_on_row, on_token, i)
            results += _run(steps, [prompt], config, eot_id, decode, row_callback, keep_logits)
        return results
    cache = ConcatKVCache() if cache is None else cache
    if isinstance(cache, StaticKVCache) and cache.batch_size != len(prompts):
        raise RoseError(
            f"the static cache holds {cache.batch_size} row(s) but {len(prompts)} prompt(s) "
            f"were given: build it with StaticKVCache(model, batch_size={len(prompts)})"
        )
    sample = row_sampler(model, config, n_rows=len(prompts))
    steps = cached_steps(model, prompts, sample, keep, cache, config.prefill_chunk)
    return _run(steps, prompts, config, eot_id, decode, on_token, keep_logits)


def _on_row(on_token: Callable[[int, int], None], row: int, _: int, token: int) -> None:
    on_token(row, token)


def row_sampler(model: GPT, config: GenerationConfig, n_rows: int) -> RowSampler:
    """One token per row from (B, vocab) logits; with sampling, one generator per row."""
    if config.sampling.greedy:
        return lambda logits: torch.argmax(logits, dim=-1).tolist()
    device = model.lm_head.weight.device
    generators = [torch.Generator(device=device) for _ in range(n_rows)]
    for generator in generators:
        if config.seed is None:
            generator.seed()
        else:
            generator.manual_seed(config.seed)

    def sample(logits: torch.Tensor) -> list[int]:
        return [
            int(sample_next_token(logits[i : i + 1], config.sampling, generator))
            for i, generator in enumerate(generators)
        ]

    return sample


def _run(
    steps: Iterator[tuple[list[int], torch.Tensor]],
    prompts: list[list[int]],
    config: GenerationConfig,
    eot_id: int | None,
    decode: Callable[[list[int]], str] | None,
    on_token: Callable[[int, int], None] | None,
    keep_logits: bool,
) -> list[GenerationResult]:
    """Consume the steps until every row has stopped; the stopping rules live here."""
    n_rows = len(prompts)
    new_ids: list[list[int]] = [[] for _ in prompts]
    step_logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    finish: list[str | None] = [None] * n_rows
    finished_at = [0.0] * n_rows
    text_len = [0] * n_rows  # decoded length before the latest token (for stop strings)
    started = time.perf_counter()
    first_token_at = started
    with torch.inference_mode():
        # islice never asks for a step past the last one, so the last token is not fed
        # back through the model for nothing (and max_new_tokens=0 runs no model at all).
        for step, (tokens, logits) in enumerate(itertools.islice(steps, config.max_new_tokens)):
            if step == 0:
                first_token_at = time.perf_counter()
            for row, token in enumerate(tokens):
                if finish[row] is not None:
                    continue  # this row stopped; the batch runs on for the others
                if keep_logits:
                    step_logits[row].append(logits[row].float().cpu())
                if config.stop_at_eot and token == eot_id:
                    finish[row] = "eot"
                else:
                    new_ids[row].append(token)
                    if on_token is not None:
                        on_token(row, token)
                    if config.stop_strings:
                        text = decode(new_ids[row])
                        if _completes_stop_string(text, text_len[row], config.stop_strings):
                            finish[row] = "stop_string"
                        text_len[row] = len(text)
                if finish[row] is not None:
                    finished_at[row] = time.perf_counter()
            if all(reason is not None for reason in finish):
                break
    steps.close()
    ended = time.perf_counter()
    return [
        GenerationResult(
            prompt_ids=list(prompts[row]),
            token_ids=new_ids[row],
            finish_reason=finish[row] or "length",
            step_logits=step_logits[row] if keep_logits else None,
            time_to_first_token_s=first_token_at - started,
            total_time_s=(finished_at[row] if finish[row] else ended) - started,
        )
        for row in range(n_rows)
    ]


def _completes_stop_string(text: str, old_len: int, stop_strings: tuple[str, ...]) -> bool:
    """Did the text added after `old_len` characters complete one of the stop strings?"""
    return any(s in text[max(0, old_len - len(s) + 1) :] for s in stop_strings)
