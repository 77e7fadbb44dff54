"""Generation: the uncached oracle, the cached path, and the loop that stops them.

`uncached_steps` is the slow, obvious version every other path is checked against:
each step runs the model on the whole (cropped) sequence and reads the last logits.

`cached_steps` prefills the prompt once, takes the first new token from the prefill
logits, then feeds one token per step on top of a KV cache. That it equals the oracle
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

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 0:
            raise RoseError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if any(not s for s in self.stop_strings):
            raise RoseError("stop strings must not be empty")


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


Sampler = Callable[[torch.Tensor], torch.Tensor]


def uncached_steps(
    model: GPT, prompt: list[int], sample: Sampler, keep: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """The oracle: every step re-runs the model on the whole window. Yields (token, logits)."""
    device = model.lm_head.weight.device
    tokens = list(prompt)
    start = 0
    while True:
        start = window_start(start, len(tokens), model.config.block_size, keep)
        idx = torch.tensor([tokens[start:]], device=device)
        logits = model(idx).logits[:, -1, :]
        token = int(sample(logits))
        yield token, logits
        tokens.append(token)


def cached_steps(
    model: GPT, prompt: list[int], sample: Sampler, keep: int, cache: KVCache
) -> Iterator[tuple[int, torch.Tensor]]:
    """Prefill once, then one token per step on top of `cache`. Yields (token, logits)."""
    device = model.lm_head.weight.device
    tokens = list(prompt)
    start = window_start(0, len(tokens), model.config.block_size, keep)
    logits = cache.forward(model, torch.tensor([tokens[start:]], device=device))
    while True:
        token = int(sample(logits))
        yield token, logits
        tokens.append(token)
        new_start = window_start(start, len(tokens), model.config.block_size, keep)
        if new_start != start:
            # The window is full: the cached keys sit at positions that would all have to
            # shift, so start a fresh cache from the kept tokens (re-prefill).
            start = new_start
            cache.reset()
            logits = cache.forward(model, torch.tensor([tokens[start:]], device=device))
        else:
            step_ids = torch.tensor([[token]], device=device)
            logits = cache.forward(model, step_ids, validate=False)


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
    carries the past. `eot_id` enables stopping at end-of-text, `decode` (ids -> text)
    enables stop strings, and `on_token` sees every kept token as it is made (streaming).
    """
    block_size = model.config.block_size
    if not prompt_ids:
        raise RoseError("the prompt is empty: start from the end-of-text token instead")
    if len(prompt_ids) > block_size:
        raise RoseError(
            f"the prompt has {len(prompt_ids)} tokens but the model's context (block_size) is "
            f"{block_size}: shorten the prompt"
        )
    if config.stop_strings and decode is None:
        raise RoseError("stop strings need a decode function (ids -> text)")
    keep = window_keep(model, config)
    device = model.lm_head.weight.device
    generator = None
    if config.seed is not None:
        generator = torch.Generator(device=device).manual_seed(config.seed)

    def sample(logits: torch.Tensor) -> torch.Tensor:
        return sample_next_token(logits, config.sampling, generator)

    if use_cache:
        steps = cached_steps(model, prompt_ids, sample, keep, cache or ConcatKVCache())
    else:
        steps = uncached_steps(model, prompt_ids, sample, keep)

    new_ids: list[int] = []
    step_logits: list[torch.Tensor] | None = [] if keep_logits else None
    finish_reason = "length"
    text_len = 0  # length of the decoded new text before the latest token (stop strings)
    started = time.perf_counter()
    first_token_at = started
    with torch.inference_mode():
        for token, logits in _take(steps, config.max_new_tokens):
            if not new_ids:
                first_token_at = time.perf_counter()
            if step_logits is not None:
                step_logits.append(logits[0].float().cpu())
            if config.stop_at_eot and token == eot_id:
                finish_reason = "eot"
                break
            new_ids.append(token)
            if on_token is not None:
                on_token(token)
            if config.stop_strings:
                text = decode(new_ids)
                if _completes_stop_string(text, text_len, config.stop_strings):
                    finish_reason = "stop_string"
                    break
                text_len = len(text)
    steps.close()
    ended = time.perf_counter()
    return GenerationResult(
        prompt_ids=list(prompt_ids),
        token_ids=new_ids,
        finish_reason=finish_reason,
        step_logits=step_logits,
        time_to_first_token_s=first_token_at - started,
        total_time_s=ended - started,
    )


def _take(steps: Iterator[tuple[int, torch.Tensor]], n: int) -> Iterator[tuple[int, torch.Tensor]]:
    for _ in range(n):
        yield next(steps)


def _completes_stop_string(text: str, old_len: int, stop_strings: tuple[str, ...]) -> bool:
    """Did the text added after `old_len` characters complete one of the stop strings?"""
    return any(s in text[max(0, old_len - len(s) + 1) :] for s in stop_strings)
