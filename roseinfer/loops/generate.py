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

Each prompt is one `Sequence` (roseinfer/request/sequence.py): its `SamplingParams`, its own
random stream, its tokens and why it stopped. What belongs to the loop rather than to
a request (how much of the window to keep, the prefill chunk, compiling the decode
step) is passed to `generate_batch` on its own.

Past the context window both paths follow one policy, `window_start`: GPT-2's
positions are learned only up to `block_size`, so a cache cannot slide by one token
(every cached key was computed at a position that would have to shift). When the
sequence outgrows the window, the view is cut back to its last `keep` tokens, and the
cached path re-prefills those; the uncached path reads exactly the same window.
A rotary model with a sliding window (`GPTConfig.unbounded`) is never cut: the oracle
reads the whole sequence under the banded mask, and the cached path runs on a
rolling cache (roseinfer/cache/rolling.py) that holds only the window.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Iterator

import torch

from roseinfer.cache.dense import ConcatKVCache, StaticKVCache
from roseinfer.cache.rolling import ReRotatingSinkCache, RollingKVCache
from roseinfer.request.sampling import SamplingParams, sample_next_token
from roseinfer.request.sampling_params import params_per_prompt
from roseinfer.request.sequence import GenerationResult, Sequence
from rosetrainer.errors import RoseError
from rosetrainer.model import GPT

KVCache = ConcatKVCache | StaticKVCache | RollingKVCache | ReRotatingSinkCache
StepFn = Callable[[GPT, torch.Tensor, KVCache], torch.Tensor]


def window_start(start: int, seq_len: int, block_size: int | None, keep: int) -> int:
    """Where the model's view of a `seq_len`-token sequence begins.

    The view starts at `start` until it would exceed `block_size` tokens; then it is
    cut back to the last `keep` tokens. Both paths call this at every step.
    block_size None: the model has no limit (`context_limit`), the view is never cut.
    """
    if block_size is not None and seq_len - start > block_size:
        return seq_len - keep
    return start


def checked_keep(model: GPT, keep: int | None = None) -> int:
    """Tokens kept when the window is full (None: block_size // 2), checked.

    keep = block_size slides the window by one token every step (nanoGPT's crop): the
    cached path then re-prefills block_size tokens at every step past the window.
    """
    block_size = model.config.block_size
    keep = block_size // 2 if keep is None else keep
    if not 1 <= keep <= block_size:
        raise RoseError(f"window_keep must be in [1, block_size = {block_size}], got {keep}")
    return keep


def context_limit(model: GPT) -> int | None:
    """How many tokens the model may read at once: block_size, or None when unbounded."""
    return None if model.config.unbounded else model.config.block_size


def sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row of (B, vocab) logits, each drawn with its own request's
    parameters and random stream (so a row samples as its prompt would alone)."""
    if all(seq.params.greedy for seq in seqs):
        return torch.argmax(logits, dim=-1).tolist()
    return [
        int(sample_next_token(logits[i : i + 1], seq.params, seq.generator))
        for i, seq in enumerate(seqs)
    ]


def model_step(model: GPT, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """One model call on top of `cache`: the logits of each row's last new token (B, vocab)."""
    return model(ids, cache=cache, last_only=True, validate=False).logits[:, -1, :]


def uncached_steps(
    model: GPT, seq: Sequence, keep: int
) -> Iterator[tuple[list[int], torch.Tensor]]:
    """The oracle: every step re-runs the model on the whole window of one row.

    Yields ([token], logits) per step, the shape the cached path yields for one row.
    """
    device = model.lm_head.weight.device
    tokens = list(seq.prompt_ids)
    start = 0
    while True:
        start = window_start(start, len(tokens), context_limit(model), keep)
        idx = torch.tensor([tokens[start:]], device=device)
        logits = model(idx).logits[:, -1, :]
        new_tokens = sample_rows(logits, [seq])
        yield new_tokens, logits
        tokens += new_tokens


def cached_steps(
    model: GPT,
    seqs: list[Sequence],
    keep: int,
    cache: KVCache,
    prefill_chunk: int | None = None,
    decode_step: StepFn = model_step,
) -> Iterator[tuple[list[int], torch.Tensor]]:
    """Prefill once, then one token per row per step on top of `cache`.

    Rows of different lengths are left-padded; each row keeps its own window.
    Yields (one token per row, logits) per step.
    """
    device = model.lm_head.weight.device
    rows = [list(seq.prompt_ids) for seq in seqs]
    starts = [0] * len(rows)
    logits = prefill(
        model, cache, [row[s:] for row, s in zip(rows, starts, strict=True)], prefill_chunk
    )
    while True:
        new_tokens = sample_rows(logits, seqs)
        yield new_tokens, logits
        for row, token in zip(rows, new_tokens, strict=True):
            row.append(token)
        limit = context_limit(model)
        new_starts = [
            window_start(s, len(r), limit, keep) for s, r in zip(starts, rows, strict=True)
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
            logits = decode_step(model, step_ids, cache)


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
        model._check_ids(ids)
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
        out = model(ids[:, i : i + chunk], cache=cache, last_only=True)
    return out.logits[:, -1, :]


TokenCallback = Callable[[int, int], None]  # on_token(row, token), for streaming


def generate(
    model: GPT,
    prompt_ids: list[int],
    params: SamplingParams,
    **options: object,
) -> GenerationResult:
    """Generate after one prompt: `generate_batch` with one row (same options)."""
    (result,) = generate_batch(model, [prompt_ids], params, **options)
    return result


def generate_batch(
    model: GPT,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    *,
    use_cache: bool = True,
    cache: KVCache | None = None,
    eot_id: int | None = None,
    decode: Callable[[list[int]], str] | None = None,
    on_token: TokenCallback | None = None,
    keep_logits: bool = False,
    window_keep: int | None = None,
    prefill_chunk: int | None = None,
    compile: str | None = None,
) -> list[GenerationResult]:
    """Generate for several prompts; one result per prompt, in order.

    params: one SamplingParams for every prompt, or one per prompt. Each prompt is a
    `Sequence` with its own random stream seeded from its params, so a row's tokens
    equal those of its prompt generated alone.
    use_cache=False runs the oracle, each prompt on its own. Otherwise the prompts run
    as one left-padded batch on `cache` (default: a fresh ConcatKVCache, or a
    RollingKVCache for a model with a sliding window; a StaticKVCache or RollingKVCache
    must have one row per prompt), each row stopping on its own while the others go on.
    A cache that already holds the prompt's first tokens (a shared prefix, the earlier
    turns of a conversation) is fed only the rest.
    eot_id: end-of-text stops a row (unless its params ignore_eos); decode (ids -> text)
    enables stop strings; on_token(row, token) sees each kept token as it is made.
    window_keep: tokens kept when the context window is full (default block_size // 2);
    prefill_chunk: prefill long prompts this many tokens at a time; compile: compile the
    static cache's one-token decode step ("default" or "max-autotune").
    """
    seqs = make_sequences(model, prompts, params, eot_id, decode)
    keep = checked_keep(model, window_keep)
    if prefill_chunk is not None and prefill_chunk < 1:
        raise RoseError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    if not use_cache:
        results = []
        for row, seq in enumerate(seqs):
            callback = None if on_token is None else functools.partial(_on_row, on_token, row)
            results += _run(uncached_steps(model, seq, keep), [seq], callback, keep_logits)
        return results
    cache = default_cache(model, len(prompts)) if cache is None else cache
    if isinstance(cache, StaticKVCache) and cache.batch_size != len(prompts):
        raise RoseError(
            f"the static cache holds {cache.batch_size} row(s) but {len(prompts)} prompt(s) "
            f"were given: build it with StaticKVCache(model, batch_size={len(prompts)})"
        )
    if model.config.sliding_window is not None and not getattr(cache, "windowed", False):
        raise RoseError(
            f"the model attends over a sliding window of {model.config.sliding_window} "
            f"tokens; {type(cache).__name__} keeps no window: use a RollingKVCache"
        )
    decode_step = model_step
    if compile is not None:
        if not isinstance(cache, StaticKVCache) or not cache.compilable:
            raise RoseError(
                "compile needs an unquantized StaticKVCache: its decode steps have one shape"
            )
        decode_step = compiled_step(compile)
    steps = cached_steps(model, seqs, keep, cache, prefill_chunk, decode_step)
    return _run(steps, seqs, on_token, keep_logits)


def default_cache(model: GPT, rows: int) -> KVCache:
    """The cache a loop starts with: a rolling one for a sliding window, else concatenation."""
    if model.config.sliding_window is not None:
        return RollingKVCache(model, batch_size=rows)
    return ConcatKVCache()


def make_sequences(
    model: GPT,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    eot_id: int | None,
    decode: Callable[[list[int]], str] | None,
) -> list[Sequence]:
    """One checked Sequence per prompt."""
    params = params_per_prompt(prompts, params, model.config.block_size)
    device = next(model.parameters()).device  # (a pipeline stage may hold no lm_head)
    return [
        Sequence(list(prompt), p, eos_id=eot_id, decode=decode, device=device)
        for prompt, p in zip(prompts, params, strict=True)
    ]


def _on_row(on_token: TokenCallback, row: int, _: int, token: int) -> None:
    on_token(row, token)


def _run(
    steps: Iterator[tuple[list[int], torch.Tensor]],
    seqs: list[Sequence],
    on_token: TokenCallback | None,
    keep_logits: bool,
) -> list[GenerationResult]:
    """Consume the steps until every row has stopped; each Sequence applies its own rules."""
    step_logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    started = time.perf_counter()
    with torch.inference_mode():
        # The loop asks for the next step only while a row is still going, so the last
        # token is never fed back through the model for nothing.
        for tokens, logits in steps:
            now = time.perf_counter()
            for row, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
                if seq.is_finished:
                    continue  # this row stopped; the batch runs on for the others
                if keep_logits:
                    step_logits[row].append(logits[row].float().cpu())
                kept = len(seq.output_ids)
                seq.append_token(token, now)
                if on_token is not None and len(seq.output_ids) > kept:
                    on_token(row, token)
            if all(seq.is_finished for seq in seqs):
                break
    steps.close()
    return [
        seq.result(started, step_logits[row] if keep_logits else None)
        for row, seq in enumerate(seqs)
    ]


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
def compiled_step(mode: str = "default") -> StepFn:
    """`model_step` through torch.compile, built on first use (importing dynamo is slow)."""
    if mode not in COMPILE_MODES:
        raise RoseError(
            f"compile is one of {', '.join(COMPILE_MODES)} (or None for eager), got {mode!r}"
        )
    if mode == "default":
        return torch.compile(model_step, dynamic=False, fullgraph=True)
    from torch._inductor import config as inductor_config  # (imported on demand: slow)

    # CUDA graphs stay off: they would need the step's inputs at fixed addresses.
    step = torch.compile(
        model_step, dynamic=False, fullgraph=True, mode="max-autotune-no-cudagraphs"
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
