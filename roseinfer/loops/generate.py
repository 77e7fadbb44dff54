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
random stream, its tokens and why it stopped. A request with structured output has its logits
masked by its grammar inside `sample_rows`, on both paths alike, so the masked cached
run is held to the masked oracle like any other. What belongs to the loop rather than to
a request (how much of the window to keep, the prefill chunk, compiling the decode
step) is passed to `generate_batch` on its own.

Past the context window both paths follow one policy, `window_start`
(roseinfer/request/rows.py, with the other helpers every batched loop shares): when the
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

from roseinfer.cache.dense import ConcatKVCache, DenseKVCache
from roseinfer.cache.rolling import RollingKVCache
from roseinfer.request import rows
from roseinfer.request.rows import checked_keep, left_pad, make_sequences
from roseinfer.request.sampling import SamplingParams, sample_rows
from roseinfer.request.sequence import GenerationResult, Sequence
from roseinfer.request.token_step import TokenCallback, take_tokens
from rosetrainer.errors import RoseError
from rosetrainer.model import GPT
from rosetrainer.tokenizer import Tokenizer

StepFn = Callable[[GPT, torch.Tensor, DenseKVCache], torch.Tensor]


def model_step(model: GPT, ids: torch.Tensor, cache: DenseKVCache) -> torch.Tensor:
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
        start = rows.window_start(start, len(tokens), rows.context_limit(model), keep)
        idx = torch.tensor([tokens[start:]], device=device)
        logits = model(idx).logits[:, -1, :]
        new_tokens = sample_rows(logits, [seq])
        yield new_tokens, logits
        tokens += new_tokens


def cached_steps(
    model: GPT,
    seqs: list[Sequence],
    keep: int,
    cache: DenseKVCache,
    prefill_chunk: int | None = None,
    decode_step: StepFn = model_step,
) -> Iterator[tuple[list[int], torch.Tensor]]:
    """Prefill once, then one token per row per step on top of `cache`.

    Rows of different lengths are left-padded; each row keeps its own window.
    Yields (one token per row, logits) per step.
    """
    device = model.lm_head.weight.device
    tokens = [list(seq.prompt_ids) for seq in seqs]
    starts = [0] * len(tokens)
    logits = prefill(model, cache, rows.windows(tokens, starts), prefill_chunk)
    while True:
        new_tokens = sample_rows(logits, seqs)
        yield new_tokens, logits
        for row, token in zip(tokens, new_tokens, strict=True):
            row.append(token)
        slid = rows.slid_starts(starts, tokens, rows.context_limit(model), keep)
        if slid is not None:  # a window is full: start the cache afresh from the kept tokens
            starts = slid
            cache.reset()
            logits = prefill(model, cache, rows.windows(tokens, starts), prefill_chunk)
        else:
            step_ids = torch.tensor(new_tokens, device=device)[:, None]
            logits = decode_step(model, step_ids, cache)


def prefill(
    model: GPT, cache: DenseKVCache, windows: list[list[int]], chunk: int | None = None
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
        padded, pads = left_pad(windows)
        ids = torch.tensor(padded, device=device)
        cache.reset(torch.tensor(pads, device=device) if max(pads) > 0 else None)
    chunk = chunk or ids.size(1)
    for i in range(0, ids.size(1), chunk):
        out = model(ids[:, i : i + chunk], cache=cache, last_only=True)
    return out.logits[:, -1, :]


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
    cache: DenseKVCache | None = None,
    eot_id: int | None = None,
    decode: Callable[[list[int]], str] | None = None,
    tokenizer: Tokenizer | None = None,
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
    enables stop strings; tokenizer: compiles the grammar of a request with
    structured_outputs (its token mask applies in `sample_rows`, on both paths alike);
    on_token(row, token) sees each kept token as it is made.
    window_keep: tokens kept when the context window is full (default block_size // 2);
    prefill_chunk: prefill long prompts this many tokens at a time; compile: compile the
    static cache's one-token decode step ("default" or "max-autotune").
    """
    seqs = make_sequences(model, prompts, params, eot_id, decode, tokenizer)
    keep = checked_keep(model, window_keep)
    if prefill_chunk is not None and prefill_chunk < 1:
        raise RoseError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    if not use_cache:
        results = []
        for row, seq in enumerate(seqs):
            callback = None if on_token is None else functools.partial(_on_row, on_token, row)
            results += _run(uncached_steps(model, seq, keep), [seq], callback, keep_logits)
        return results
    if cache is None:
        longest = max(len(seq.prompt_ids) for seq in seqs)
        cache = default_cache(model, len(prompts), longest + max(s.params.max_tokens for s in seqs))
    cache.check_rows(len(prompts))
    if model.config.sliding_window is not None and not cache.windowed:
        raise RoseError(
            f"the model attends over a sliding window of {model.config.sliding_window} "
            f"tokens; {type(cache).__name__} keeps no window: use a RollingKVCache"
        )
    decode_step = model_step
    if compile is not None:
        if not cache.compilable:
            raise RoseError(
                "compile needs an unquantized StaticKVCache: its decode steps have one shape"
            )
        device_type = cache.layers[0].k.device.type
        decode_step = compiled_step(compile, device_type)
        if device_type == "cuda":
            cache.fix_addresses()
    steps = cached_steps(model, seqs, keep, cache, prefill_chunk, decode_step)
    return _run(steps, seqs, on_token, keep_logits)


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
            for row in take_tokens(seqs, tokens, on_token=on_token):
                if keep_logits:
                    step_logits[row].append(logits[row].float().cpu())
            if all(seq.is_finished for seq in seqs):
                break
    steps.close()
    return [
        seq.result(started, step_logits[row] if keep_logits else None)
        for row, seq in enumerate(seqs)
    ]


# How the one-token step may be compiled:
# * "default": inductor fuses the small ops (layer norms, GELU, the cache write,
#   attention's softmax) around the usual matmul library calls; compiles in seconds. On
#   CUDA the step also replays as a CUDA graph (mode "reduce-overhead", gpt-fast's way):
#   one launch a token instead of one per kernel, the cache's buffers at fixed addresses
#   (StaticKVCache.fix_addresses) so the graph writes them in place.
# * "max-autotune": the weights are frozen into the graph as constants, so they can be
#   packed once for the matmul kernels, and inductor times its own generated matmul
#   kernels against the library's and keeps the faster. For one-row decode matmuls on a
#   CPU without native bf16 its kernels win clearly in bf16. Compiling takes a minute or
#   two, and frozen weights are read once: changing them in place afterwards is not seen.
COMPILE_MODES = ("default", "max-autotune")


@functools.cache
def compiled_step(mode: str = "default", device_type: str = "cpu") -> StepFn:
    """`model_step` through torch.compile, built on first use (importing dynamo is slow),
    for a cache on `device_type` ("cuda": in CUDA graphs)."""
    if mode not in COMPILE_MODES:
        raise RoseError(
            f"compile is one of {', '.join(COMPILE_MODES)} (or None for eager), got {mode!r}"
        )
    if mode == "default":
        graphs = "reduce-overhead" if device_type == "cuda" else None
        return torch.compile(model_step, dynamic=False, fullgraph=True, mode=graphs)
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


def default_cache(model: GPT, rows: int, max_len: int) -> DenseKVCache:
    """The cache a loop starts with: a rolling one for a sliding window (of no more slots
    than max_len, the most tokens a row is fed), else concatenation."""
    if model.config.sliding_window is not None:
        return RollingKVCache(model, batch_size=rows, max_len=max_len)
    return ConcatKVCache()
