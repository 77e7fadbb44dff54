"""Exercises: write the piece a chapter is about; the oracle checks it.

Chapters 02 to 09 each end with an exercise: write the function the chapter is about,
with the signature of the real one, and pass it to that chapter's `check_*` function.
The check swaps your function in for the real piece (the same `mock.patch.object` the
chapters use to show a bug), generates on the chapters' random strong-oracle model,
and compares every step with the reference: the uncached greedy run of chapter 01 (for
sampling, the reference sampler under the same seed). It prints the first step that
differs and what that means. Each exercise has a diagnosis table of known wrong
answers; when your function behaves like one of them on a few small inputs (probes),
the explanation names the mistake.

Steps count as in the chapters: step 0 is the token the prefill chose, step 1 the
first decode step. A run that raises is reported at the step it was on.

The reference solutions live apart, in `rosecourse/solutions/`; the notebooks import
them, so CI runs every check on a right answer, and tests/test_exercises.py feeds each
check its known wrong answers.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from unittest import mock

import torch

import roseinfer.cache.rolling
import roseinfer.loops.generate
import roseinfer.request.rows
import roseinfer.request.sampling
import rosetrainer.model
from rosecourse.demo import (
    NEW_TOKENS,
    PROMPT,
    RANDOM_MODEL_CONFIG,
    WINDOWED_MODEL_CONFIG,
    first_divergence,
    wide_random_init,
)
from rosecourse.naive import lose_past_kv, positions_from_zero, top_left_causal_mask
from roseinfer.cache.dense import ConcatKVCache, StaticKVCache, StaticLayerCache
from roseinfer.cache.rolling import RollingKVCache, rolling_slot
from roseinfer.loops.generate import generate, generate_batch
from roseinfer.request.rows import window_start
from roseinfer.request.sampling import SamplingParams, top_p_filter
from rosetrainer.model import GPT, causal_mask, concat_kv, padded_position_ids, position_ids
from rosetrainer.tokenizer import Tokenizer

# A prefill in chunks of this many tokens: every chunk after the first has a past.
CHUNK = 3
# Ragged prompts for the batching exercise: rows with 0, some and many padding slots.
BATCH_TEXTS = ("JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?", PROMPT, "Good night")
# The sampling exercise: sharp enough that top-p's kept set is a few tokens, so a wrong
# one changes what is drawn.
SAMPLING = SamplingParams(
    max_tokens=NEW_TOKENS, temperature=1.0, top_p=0.7, seed=1, ignore_eos=True
)


@dataclass(frozen=True)
class CheckResult:
    """What a check found: passed, or the first step that differs and what it means."""

    exercise: str
    passed: bool
    step: int | None  # the first generation step that differs from the reference
    explanation: str
    # What a step is in this check (a generation step unless the check says otherwise).
    step_label: Callable[[int], str] | None = None

    def __str__(self) -> str:
        if self.passed:
            return f"{self.exercise}: passed. {self.explanation}"
        label = self.step_label or step_name
        where = "" if self.step is None else f" at step {self.step} ({label(self.step)})"
        return f"{self.exercise}: FAILED{where}: {self.explanation}"


@dataclass(frozen=True)
class KnownWrong:
    """A wrong answer people write, and what it does to the output."""

    name: str
    fn: Callable
    explanation: str


@dataclass(frozen=True)
class Divergence:
    step: int
    where: str  # which run, which row, what was raised


def step_name(step: int) -> str:
    return "the prefill's token" if step == 0 else f"decode step {step}"


# ---------------------------------------------------------------------------
# The oracle: the chapters' random model, its prompts and their reference runs
# ---------------------------------------------------------------------------


@functools.cache
def oracle_model() -> GPT:
    """The chapters' random strong-oracle model (rosecourse.demo), whatever is trained here,
    so a check's verdict and its step numbers are the same on every machine."""
    return wide_random_init(GPT(RANDOM_MODEL_CONFIG), 0)


@functools.cache
def encoded(text: str) -> tuple[int, ...]:
    return tuple(Tokenizer("gpt2").encode(text))


@functools.cache
def reference_tokens(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    """The uncached greedy run of `prompt` (with the default window policy past block_size)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return tuple(generate(oracle_model(), list(prompt), params, use_cache=False).token_ids)


@functools.cache
def reference_samples() -> tuple[int, ...]:
    """The sampling exercise's reference: the real sampler, uncached, under SAMPLING's seed."""
    run = generate(oracle_model(), list(encoded(PROMPT)), SAMPLING, use_cache=False)
    return tuple(run.token_ids)


def compare_run(
    label: str,
    expected: list[tuple[int, ...]],
    run: Callable[[Callable[[int, int], None]], list[list[int]]],
) -> Divergence | None:
    """Run `run(on_token)`; the first step where a row's tokens leave `expected`, if any.

    A learner's function may fail in any way at all; an exception is a divergence at
    the step the slowest row was on when it was raised.
    """
    made = [0] * len(expected)

    def on_token(row: int, _token: int) -> None:
        made[row] += 1

    try:
        rows = run(on_token)
    except Exception as error:  # anything a learner's code raises is a finding
        message = str(error).splitlines()[0] if str(error) else ""
        return Divergence(min(made), f"{label}: raised {type(error).__name__}: {message}")
    steps = [first_divergence(list(want), got) for want, got in zip(expected, rows, strict=True)]
    parted = [(step, row) for row, step in enumerate(steps) if step is not None]
    if not parted:
        return None
    step, row = min(parted)
    which = f", row {row}" if len(expected) > 1 else ""
    return Divergence(step, f"{label}{which}")


# ---------------------------------------------------------------------------
# Probes: a function's behaviour on small inputs, to compare it with known answers
# ---------------------------------------------------------------------------


def outcome(call: Callable[[], object]) -> object:
    """What a call returned (tensors as they are), or the name of what it raised."""
    try:
        return call()
    except Exception as error:  # what it raised is the outcome
        return f"raises {type(error).__name__}"


# Float outcomes computed in another order (a learner's attention, say) differ in the last
# bits; within these tolerances they are the same outcome.
PROBE_RTOL, PROBE_ATOL = 1e-4, 1e-5


def same(a: object, b: object) -> bool:
    """Equal outcomes: tensors of one shape and equal values (floats within PROBE_RTOL /
    PROBE_ATOL, NaN equal to NaN, inf to inf of its sign), recursively."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype.is_floating_point != b.dtype.is_floating_point:
            return False
        a, b = a.detach().cpu(), b.detach().cpu()
        if a.is_floating_point():
            return torch.allclose(
                a.float(), b.float(), rtol=PROBE_RTOL, atol=PROBE_ATOL, equal_nan=True
            )
        return bool((a == b).all())
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return a == b


def shown(value: object, limit: int = 160) -> str:
    """An outcome on one short line (tensors as nested lists)."""

    def brief(v: object) -> object:
        if not isinstance(v, torch.Tensor):
            return v
        if v.numel() <= 24:
            return v.tolist()
        start = ", ".join(f"{x:.3g}" for x in v.flatten()[:4].tolist())
        return f"<shape {tuple(v.shape)}: {start}, ...>"

    value = [brief(v) for v in value] if isinstance(value, (tuple, list)) else brief(value)
    text = str(value).replace("'", "")
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------
# One check, for every exercise
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Exercise:
    name: str
    reference: Callable
    probe: Callable[[Callable], list[object]]  # fn -> its outcomes on small inputs
    swapped_in: Callable[[Callable], contextlib.AbstractContextManager]
    runs: list[tuple[str, Callable[[], list[tuple[int, ...]]], Callable]]  # label, expected, run
    known_wrong: list[KnownWrong]
    fallback: str  # what a divergence means when the function is none of the known ones
    # What the runs' steps are: generation steps (step_name) unless the exercise says otherwise
    # (engine steps, cases of a measurement, ...).
    step_label: Callable[[int], str] = step_name


def check(exercise: Exercise, fn: Callable) -> CheckResult:
    """Swap `fn` in, run every run against its reference, print and return the verdict."""
    seen = exercise.probe(fn)
    diagnosis = next(
        (w.explanation for w in exercise.known_wrong if same(exercise.probe(w.fn), seen)),
        None,
    )
    result = None
    for label, expected, run in exercise.runs:
        want = expected()  # the reference runs before anything is swapped in
        with exercise.swapped_in(fn):
            divergence = compare_run(label, want, run)
        if divergence is not None:
            why = diagnosis or exercise.fallback
            if "raised NotImplementedError" in divergence.where:
                why = "not written yet: replace the stub with your function"
            result = CheckResult(
                exercise.name,
                False,
                divergence.step,
                f"{why} [{divergence.where}]",
                exercise.step_label,
            )
            break
    if result is None:
        wanted = exercise.probe(exercise.reference)
        bad = [i for i, (a, b) in enumerate(zip(seen, wanted, strict=True)) if not same(a, b)]
        if bad:
            why = diagnosis or "it differs from the reference on a case these runs never reach"
            result = CheckResult(
                exercise.name,
                False,
                None,
                f"every step matches, but on small input #{bad[0]} it gives {shown(seen[bad[0]])} "
                f"where {shown(wanted[bad[0]])} is right: {why}",
            )
    if result is None:
        labels = "; ".join(label for label, _, _ in exercise.runs)
        result = CheckResult(
            exercise.name, True, None, f"every step equals the reference ({labels})"
        )
    print(result)
    return result


def greedy_runs(cache: Callable[[], object]) -> list[tuple[str, Callable, Callable]]:
    """The chapter's prompt greedy on `cache`: a one-shot prefill, then a prefill in chunks."""
    prompt = encoded(PROMPT)

    def expected() -> list[tuple[int, ...]]:
        return [reference_tokens(prompt, NEW_TOKENS)]

    def run(chunk: int | None) -> Callable:
        def go(on_token: Callable[[int, int], None]) -> list[list[int]]:
            params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
            result = generate(
                oracle_model(),
                list(prompt),
                params,
                cache=cache(),
                prefill_chunk=chunk,
                on_token=on_token,
            )
            return [result.token_ids]

        return go

    return [
        ("one-shot prefill, then decode", expected, run(None)),
        (f"prefill in chunks of {CHUNK}", expected, run(CHUNK)),
    ]


def patched(module: object, name: str) -> Callable[[Callable], contextlib.AbstractContextManager]:
    return lambda fn: mock.patch.object(module, name, fn)


# -- 02: keep the past ------------------------------------------------------------------


def _kv_probe(fn: Callable) -> list[object]:
    generator = torch.Generator().manual_seed(0)
    past = (
        torch.randn(1, 2, 3, 4, generator=generator),
        torch.randn(1, 2, 3, 4, generator=generator),
    )
    new = (
        torch.randn(1, 2, 2, 4, generator=generator),
        torch.randn(1, 2, 2, 4, generator=generator),
    )
    return [outcome(lambda: fn(None, *new)), outcome(lambda: fn(past, *new))]


def _new_only(layer_past, k, v):
    return k, v


def _new_first(layer_past, k, v):
    if layer_past is None:
        return k, v
    return torch.cat([k, layer_past[0]], dim=2), torch.cat([v, layer_past[1]], dim=2)


def _along_heads(layer_past, k, v):
    if layer_past is None:
        return k, v
    return torch.cat([layer_past[0], k], dim=1), torch.cat([layer_past[1], v], dim=1)


CONCAT_KV = Exercise(
    name="concat_kv",
    reference=concat_kv,
    probe=_kv_probe,
    swapped_in=patched(rosetrainer.model, "concat_kv"),
    runs=greedy_runs(ConcatKVCache),
    known_wrong=[
        KnownWrong(
            "lose_past_kv",
            lose_past_kv,
            "the past's slots are there but hold zeros: "
            "the new token attends to keys that say nothing about the prompt",
        ),
        KnownWrong(
            "new_only",
            _new_only,
            "you hand back the new keys/values alone: the cache "
            "forgets the past, and the new token attends to itself only",
        ),
        KnownWrong(
            "new_first",
            _new_first,
            "the new keys go in front of the past: a decode "
            "query sees every key anyway (attention is a sum, order-free), but a chunk's "
            "mask columns are positions, and its queries now see the wrong keys",
        ),
        KnownWrong(
            "along_heads",
            _along_heads,
            "you concatenated along the heads (dim 1); "
            "time is dim 2 of (batch, heads, time, head_dim)",
        ),
    ],
    fallback="the keys/values handed back are not the past followed by the new ones",
)


def check_concat_kv(fn: Callable) -> CheckResult:
    """Chapter 02: `concat_kv(layer_past, k, v) -> (k_all, v_all)`."""
    return check(CONCAT_KV, fn)


# -- 03: the causal mask ---------------------------------------------------------------

MASK_PROBES = [(1, 1), (4, 4), (1, 6), (3, 7), (2, 2)]


def _mask_probe(fn: Callable) -> list[object]:
    return [outcome(lambda q=q, kv=kv: fn(q, kv)) for q, kv in MASK_PROBES]


def _square_mask(q_len, kv_len, device=None):
    return torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()


def _open_mask(q_len, kv_len, device=None):
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device)


def _strict_mask(q_len, kv_len, device=None):
    query = torch.arange(kv_len - q_len, kv_len, device=device)
    return torch.arange(kv_len, device=device)[None, :] < query[:, None]


TOP_LEFT = (
    "your mask lets the decode query see nothing but key 0: top-left alignment (what "
    "is_causal=True does), the mask rows of the oldest positions, not the newest"
)
SQUARE = (
    "your mask is the (q_len, q_len) triangle of the new tokens alone, nanoGPT's "
    "bias[:, :, :T, :T]: a single decode query broadcasts it over every key and passes, "
    "but a chunk of several tokens after a past has more keys than queries"
)
CAUSAL_MASK = Exercise(
    name="causal_mask",
    reference=causal_mask,
    probe=_mask_probe,
    swapped_in=patched(rosetrainer.model, "causal_mask"),
    runs=greedy_runs(ConcatKVCache),
    known_wrong=[
        KnownWrong("top_left", top_left_causal_mask, TOP_LEFT),
        KnownWrong("square", _square_mask, SQUARE),
        KnownWrong(
            "open",
            _open_mask,
            "your mask hides nothing: a decode query may see every "
            "key anyway, but a chunk's queries now see the tokens after them",
        ),
        KnownWrong(
            "strict",
            _strict_mask,
            "your mask hides each query's own key (< where <= "
            "is right): the newest token never reads itself",
        ),
    ],
    fallback="some query sees a key it must not, or misses one it must see",
)


def check_causal_mask(fn: Callable) -> CheckResult:
    """Chapter 03: `causal_mask(q_len, kv_len, device=None) -> (q_len, kv_len) bool`."""
    return check(CAUSAL_MASK, fn)


# -- 04: positions ------------------------------------------------------------------------


def _positions_probe(fn: Callable) -> list[object]:
    return [outcome(lambda a=a: fn(*a)) for a in [(0, 5), (5, 1), (7, 3)]]


def _one_too_far(past_len, q_len, device=None):
    return torch.arange(past_len + 1, past_len + q_len + 1, device=device)


def _all_at_past_len(past_len, q_len, device=None):
    return torch.full((q_len,), past_len, device=device)


POSITION_IDS = Exercise(
    name="position_ids",
    reference=position_ids,
    probe=_positions_probe,
    swapped_in=patched(rosetrainer.model, "position_ids"),
    runs=greedy_runs(ConcatKVCache),
    known_wrong=[
        KnownWrong(
            "from_zero",
            positions_from_zero,
            "every new token is numbered from 0 as if "
            "nothing came before: the decode token gets position 0's embedding",
        ),
        KnownWrong(
            "one_too_far",
            _one_too_far,
            "your positions are one too far right: the prompt's first token already stands at 1",
        ),
        KnownWrong(
            "all_at_past_len",
            _all_at_past_len,
            "every token of a call gets the same "
            "position, past_len: right for one decode token, wrong for a prefill",
        ),
    ],
    fallback="a new token stands at the wrong position",
)


def check_position_ids(fn: Callable) -> CheckResult:
    """Chapter 04: `position_ids(past_len, q_len, device=None) -> (q_len,) long`."""
    return check(POSITION_IDS, fn)


# -- 05: top-p ------------------------------------------------------------------------------

TOP_P_LOGITS = torch.tensor(
    [
        [2.0, 1.5, 1.0, 0.5, 0.0, -1.0],  # chapter 05's six tokens
        [0.0, 4.0, 0.0, 1.0, 0.0, 0.0],  # one token holds most of the mass, not first in order
        [1.0, 1.0, 1.0, 1.0, 0.0, 0.0],  # ties
    ]
)


def _top_p_probe(fn: Callable) -> list[object]:
    return [outcome(lambda p=p: fn(TOP_P_LOGITS.clone(), p)) for p in (0.5, 0.8, 0.95)]


def _drops_crossing(logits, p):
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    drop_sorted = torch.softmax(sorted_logits, dim=-1).cumsum(-1) > p
    return logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


def _sorted_not_scattered(logits, p):
    sorted_logits, _ = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    return logits.masked_fill(probs.cumsum(-1) - probs >= p, float("-inf"))


def _mass_of_logits(logits, p):
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    drop_sorted = sorted_logits.cumsum(-1) - sorted_logits >= p
    return logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


def _sampling_runs() -> list[tuple[str, Callable, Callable]]:
    def go(on_token: Callable[[int, int], None]) -> list[list[int]]:
        run = generate(oracle_model(), list(encoded(PROMPT)), SAMPLING, on_token=on_token)
        return [run.token_ids]

    label = f"cached, T={SAMPLING.temperature}, top_p={SAMPLING.top_p}, seed {SAMPLING.seed}"
    return [(label, lambda: [reference_samples()], go)]


TOP_P = Exercise(
    name="top_p_filter",
    reference=top_p_filter,
    probe=_top_p_probe,
    swapped_in=patched(roseinfer.request.sampling, "top_p_filter"),
    runs=_sampling_runs(),
    known_wrong=[
        KnownWrong(
            "drops_crossing",
            _drops_crossing,
            "you drop the token that carries the "
            "mass over p (cumsum > p): the kept set falls short of p, and when the top "
            "token alone holds more than p nothing is left to sample",
        ),
        KnownWrong(
            "sorted_not_scattered",
            _sorted_not_scattered,
            "you decide in sorted order "
            "but mask the logits in vocabulary order: the kept places land on the wrong "
            "token ids (scatter the decision back through the sort order)",
        ),
        KnownWrong(
            "mass_of_logits",
            _mass_of_logits,
            "you summed logits, not probabilities: take the softmax of the sorted logits first",
        ),
    ],
    fallback="it keeps a different set of tokens than the smallest set reaching p",
)


def check_top_p_filter(fn: Callable) -> CheckResult:
    """Chapter 05: `top_p_filter(logits, p) -> logits` with the dropped ones at -inf."""
    return check(TOP_P, fn)


# -- 06: the static cache's write ----------------------------------------------------------


def _static_probe(fn: Callable) -> list[object]:
    """A prefill of 3 into 6 slots, then one decode token: what is handed back, and kept."""
    k, v = torch.zeros(1, 1, 6, 2), torch.zeros(1, 1, 6, 2)
    seen = []
    for start, length in [(0, 3), (3, 1)]:
        new = torch.arange(start, start + length, dtype=torch.float32) + 1.0
        k_new = new[None, None, :, None].expand(1, 1, length, 2).contiguous()
        positions = torch.arange(start, start + length)
        seen.append(outcome(lambda n=k_new, p=positions: cloned(fn(k, v, p, n, -n))))
        seen.append((k.clone(), v.clone()))
    return seen


def cloned(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.clone() for t in tensors)  # the buffers change at the next call


# The real write, held before any check swaps a learner's in.
_real_static_update = StaticLayerCache.update


def static_update(k_buffer, v_buffer, input_pos, k_new, v_new):
    """The real write, as a function of the buffers (what StaticLayerCache.update does)."""
    return _real_static_update(StaticLayerCache(k_buffer, v_buffer), input_pos, k_new, v_new)


def _swap_static_update(fn: Callable) -> contextlib.AbstractContextManager:
    def update(layer: StaticLayerCache, input_pos, k_new, v_new):
        return fn(layer.k, layer.v, input_pos, k_new, v_new)

    return mock.patch.object(StaticLayerCache, "update", update)


def _at_slot_zero(k_buffer, v_buffer, input_pos, k_new, v_new):
    k_buffer[:, :, : k_new.size(2)] = k_new
    v_buffer[:, :, : v_new.size(2)] = v_new
    return k_buffer, v_buffer


def _into_a_copy(k_buffer, v_buffer, input_pos, k_new, v_new):
    return k_buffer.index_copy(2, input_pos, k_new), v_buffer.index_copy(2, input_pos, v_new)


def _never_written(k_buffer, v_buffer, input_pos, k_new, v_new):
    return k_buffer, v_buffer


STATIC_UPDATE = Exercise(
    name="static_update",
    reference=static_update,
    probe=_static_probe,
    swapped_in=_swap_static_update,
    runs=greedy_runs(lambda: StaticKVCache(oracle_model(), max_len=64)),
    known_wrong=[
        KnownWrong(
            "at_slot_zero",
            _at_slot_zero,
            "every call writes from slot 0 (input_pos "
            "ignored): each decode step overwrites the prompt's first keys and leaves "
            "its own slot unwritten, and the mask row shows the query that slot",
        ),
        KnownWrong(
            "into_a_copy",
            _into_a_copy,
            "you wrote into a copy (index_copy, not "
            "index_copy_): this call sees its keys, the next finds their slots "
            "unwritten (zeros) and attends to them",
        ),
        KnownWrong(
            "never_written",
            _never_written,
            "nothing is written: every query attends "
            "to unwritten slots (zeros), even at the prefill",
        ),
    ],
    fallback="the buffers handed back are not the past with the new keys/values in their slots",
)


def check_static_update(fn: Callable) -> CheckResult:
    """Chapter 06: `static_update(k_buffer, v_buffer, input_pos, k_new, v_new) -> (k, v)`."""
    return check(STATIC_UPDATE, fn)


# -- 07: per-row positions of a left-padded batch ---------------------------------------------

PADDING = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])


def _padded_probe(fn: Callable) -> list[object]:
    return [outcome(lambda: fn(PADDING.clone()))]


def _batch_runs() -> list[tuple[str, Callable, Callable]]:
    prompts = [encoded(text) for text in BATCH_TEXTS]

    def expected() -> list[tuple[int, ...]]:
        return [reference_tokens(p, NEW_TOKENS) for p in prompts]

    def go(on_token: Callable[[int, int], None]) -> list[list[int]]:
        params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
        runs = generate_batch(
            oracle_model(),
            [list(p) for p in prompts],
            params,
            cache=ConcatKVCache(),
            on_token=on_token,
        )
        return [run.token_ids for run in runs]

    pads = [max(map(len, prompts)) - len(p) for p in prompts]
    return [(f"a left-padded batch, padding {pads}", expected, go)]


def _counting_padding(attention_mask):
    return torch.arange(attention_mask.size(1)).expand(attention_mask.shape)


def _from_one(attention_mask):
    return attention_mask.long().cumsum(-1)


def _unclamped(attention_mask):
    return attention_mask.long().cumsum(-1) - 1


PADDED_POSITION_IDS = Exercise(
    name="padded_position_ids",
    reference=padded_position_ids,
    probe=_padded_probe,
    swapped_in=patched(rosetrainer.model, "padded_position_ids"),
    runs=_batch_runs(),
    known_wrong=[
        KnownWrong(
            "counting_padding",
            _counting_padding,
            "your positions count the padding: "
            "every real token of a padded row stands as far right as its padding is "
            "long (the row without padding cannot tell)",
        ),
        KnownWrong(
            "from_one",
            _from_one,
            "your positions start at 1 (cumsum without the - 1): "
            "every row's tokens stand one too far right",
        ),
        KnownWrong(
            "unclamped",
            _unclamped,
            "padding slots get position -1, which has no "
            "embedding row: clamp them to 0 (what they compute is never read)",
        ),
    ],
    fallback="a row's tokens do not stand where they would stand alone",
)


def check_padded_position_ids(fn: Callable) -> CheckResult:
    """Chapter 07: `padded_position_ids(attention_mask) -> (batch, slots) long`."""
    return check(PADDED_POSITION_IDS, fn)


# -- 08: a chunk's rows of one precomputed mask ------------------------------------------------


def mask_slice(bias: torch.Tensor, past_len: int, q_len: int) -> torch.Tensor:
    """The reference, as the solution writes it (kept here to compare learners with)."""
    return bias[past_len : past_len + q_len, : past_len + q_len]


def _slice_probe(fn: Callable) -> list[object]:
    bias = torch.ones(8, 8, dtype=torch.bool).tril()
    return [outcome(lambda a=a: fn(bias, *a)) for a in [(0, 4), (5, 1), (3, 3)]]


def _swap_mask_slice(fn: Callable) -> contextlib.AbstractContextManager:
    size = oracle_model().config.block_size
    bias = torch.ones(size, size, dtype=torch.bool).tril()  # nanoGPT's registered buffer

    def sliced_mask(q_len: int, kv_len: int, device: torch.device | None = None):
        return fn(bias.to(device), kv_len - q_len, q_len)

    return mock.patch.object(rosetrainer.model, "causal_mask", sliced_mask)


def _nanogpt_slice(bias, past_len, q_len):
    return bias[:q_len, :q_len]


def _top_rows(bias, past_len, q_len):
    return bias[:q_len, : past_len + q_len]


def _every_column(bias, past_len, q_len):
    return bias[past_len : past_len + q_len]


MASK_SLICE = Exercise(
    name="mask_slice",
    reference=mask_slice,
    probe=_slice_probe,
    swapped_in=_swap_mask_slice,
    runs=greedy_runs(ConcatKVCache),
    known_wrong=[
        KnownWrong("nanogpt", _nanogpt_slice, SQUARE),
        KnownWrong("top_rows", _top_rows, TOP_LEFT),
        KnownWrong(
            "every_column",
            _every_column,
            "the rows are right, but you kept every "
            "column of the bias: there are only past_len + q_len keys to mask",
        ),
    ],
    fallback="the slice is not rows past_len .. past_len + q_len, columns 0 .. past_len + q_len",
)


def check_mask_slice(fn: Callable) -> CheckResult:
    """Chapter 08: `mask_slice(bias, past_len, q_len) -> (q_len, past_len + q_len) bool`."""
    return check(MASK_SLICE, fn)


# -- 09: the window cut --------------------------------------------------------------------------


def _window_probe(fn: Callable) -> list[object]:
    cases = [(0, 8, 8, 4), (0, 9, 8, 4), (5, 12, 8, 4), (5, 13, 8, 4), (0, 9, 8, 7), (12, 17, 8, 4)]
    return [outcome(lambda a=a: fn(*a)) for a in cases]


def _window_runs() -> list[tuple[str, Callable, Callable]]:
    prompt = encoded(PROMPT)
    n_new = 2 * oracle_model().config.block_size

    def go(on_token: Callable[[int, int], None]) -> list[list[int]]:
        params = SamplingParams(max_tokens=n_new, ignore_eos=True)
        run = generate(oracle_model(), list(prompt), params, on_token=on_token)
        return [run.token_ids]

    return [
        (f"{n_new} tokens, keep = block_size // 2", lambda: [reference_tokens(prompt, n_new)], go)
    ]


def _slides(start, seq_len, block_size, keep):
    return max(start, seq_len - block_size)


def _a_step_early(start, seq_len, block_size, keep):
    return seq_len - keep if seq_len - start >= block_size else start


def _measures_the_sequence(start, seq_len, block_size, keep):
    return seq_len - keep if seq_len > block_size else start


def _never_cuts(start, seq_len, block_size, keep):
    return start


WINDOW_START = Exercise(
    name="window_start",
    reference=window_start,
    probe=_window_probe,
    swapped_in=patched(roseinfer.request.rows, "window_start"),
    runs=_window_runs(),
    known_wrong=[
        KnownWrong(
            "slides",
            _slides,
            "your window slides by one token every step (nanoGPT's "
            "crop): a policy of its own, not this one, and with a cache it re-prefills "
            "block_size tokens at every step",
        ),
        KnownWrong(
            "a_step_early",
            _a_step_early,
            "you cut a step early (>= where > is right): "
            "the window never holds all block_size tokens",
        ),
        KnownWrong(
            "measures_the_sequence",
            _measures_the_sequence,
            "you compare the whole "
            "sequence with block_size, not the window (seq_len - start): past the first "
            "cut it cuts again at every step",
        ),
        KnownWrong(
            "never_cuts",
            _never_cuts,
            "the window never moves: the model runs out of learned positions at block_size",
        ),
    ],
    fallback="the window does not start where the cut-back policy puts it",
)


def check_window_start(fn: Callable) -> CheckResult:
    """Chapter 09: `window_start(start, seq_len, block_size, keep) -> int`."""
    return check(WINDOW_START, fn)


# -- 18: the rolling cache's slot ----------------------------------------------------------


@functools.cache
def windowed_model() -> GPT:
    """Chapter 18's rotary model with a sliding window and sinks (rosecourse.demo)."""
    return wide_random_init(GPT(WINDOWED_MODEL_CONFIG), 0)


# A prompt of token ids (the windowed model's vocabulary is 512), and a run four contexts long.
WINDOWED_PROMPT = (5, 17, 3, 250, 99, 7)
WINDOWED_NEW_TOKENS = 4 * WINDOWED_MODEL_CONFIG.block_size


@functools.cache
def windowed_reference() -> tuple[int, ...]:
    """The uncached greedy run under the banded mask: the whole sequence at every step."""
    params = SamplingParams(max_tokens=WINDOWED_NEW_TOKENS, ignore_eos=True)
    run = generate(windowed_model(), list(WINDOWED_PROMPT), params, use_cache=False)
    return tuple(run.token_ids)


def _slot_probe(fn: Callable) -> list[object]:
    # (window, sinks): the chapter's (8, 2), no sinks, and one sink.
    pos = torch.arange(30)
    return [outcome(lambda w=w, s=s: fn(pos, w, s)) for w, s in ((8, 2), (8, 0), (5, 1))]


def _slot_runs() -> list[tuple[str, Callable, Callable]]:
    def go(chunk: int | None) -> Callable:
        def run(on_token: Callable[[int, int], None]) -> list[list[int]]:
            params = SamplingParams(max_tokens=WINDOWED_NEW_TOKENS, ignore_eos=True)
            model = windowed_model()
            result = generate(
                model, list(WINDOWED_PROMPT), params, cache=RollingKVCache(model),
                prefill_chunk=chunk, on_token=on_token,
            )  # fmt: skip
            return [result.token_ids]

        return run

    label = f"{WINDOWED_NEW_TOKENS} tokens on the rolling cache"
    expected = lambda: [windowed_reference()]  # noqa: E731
    return [
        (label, expected, go(None)),
        (f"{label}, prefill in chunks of {CHUNK}", expected, go(CHUNK)),
    ]


def _modulo_all_slots(pos, window, sinks):
    return pos % (window + sinks)


def _sinks_share_the_window(pos, window, sinks):
    return pos % window


def _last_slot_only(pos, window, sinks):
    return torch.where(pos < sinks, pos, torch.full_like(pos, sinks + window - 1))


ROLLING_SLOT = Exercise(
    name="rolling_slot",
    reference=rolling_slot,
    probe=_slot_probe,
    swapped_in=patched(roseinfer.cache.rolling, "rolling_slot"),
    runs=_slot_runs(),
    known_wrong=[
        KnownWrong(
            "modulo_all_slots",
            _modulo_all_slots,
            "every position goes round all sinks + window slots: once the sequence is "
            "longer than them, a later token overwrites a sink that every query still reads",
        ),
        KnownWrong(
            "sinks_share_the_window",
            _sinks_share_the_window,
            "the window's positions go round slots 0 .. W - 1, the sinks' own slots among "
            "them: the sinks are overwritten (and the last S slots are never used)",
        ),
        KnownWrong(
            "last_slot_only",
            _last_slot_only,
            "every position after the sinks lands in one slot: the cache remembers the "
            "latest token only, not the window",
        ),
    ],
    fallback="a key is overwritten while a query still needs it, or lands in no slot",
)


def check_rolling_slot(fn: Callable) -> CheckResult:
    """Chapter 18: `rolling_slot(pos, window, sinks) -> slots` (tensors of positions)."""
    return check(ROLLING_SLOT, fn)


def known_wrong_answers() -> Iterator[tuple[Callable[[Callable], CheckResult], KnownWrong]]:
    """Every check with each of its known wrong answers (for the tests)."""
    checks = {
        CONCAT_KV.name: check_concat_kv,
        CAUSAL_MASK.name: check_causal_mask,
        POSITION_IDS.name: check_position_ids,
        TOP_P.name: check_top_p_filter,
        STATIC_UPDATE.name: check_static_update,
        PADDED_POSITION_IDS.name: check_padded_position_ids,
        MASK_SLICE.name: check_mask_slice,
        WINDOW_START.name: check_window_start,
        ROLLING_SLOT.name: check_rolling_slot,
    }
    for exercise in (
        CONCAT_KV,
        CAUSAL_MASK,
        POSITION_IDS,
        TOP_P,
        STATIC_UPDATE,
        PADDED_POSITION_IDS,
        MASK_SLICE,
        WINDOW_START,
        ROLLING_SLOT,
    ):
        for wrong in exercise.known_wrong:
            yield checks[exercise.name], wrong


def wrong_answer(name: str) -> Callable:
    """A known wrong answer by its name in the diagnosis tables (the chapters show some)."""
    for _, wrong in known_wrong_answers():
        if wrong.name == name:
            return wrong.fn
    raise KeyError(f"no known wrong answer is called {name!r}")
