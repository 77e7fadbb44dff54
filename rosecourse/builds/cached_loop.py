"""Build (chapters 02-06): the cached loop and a static KV cache, graded against the oracle.

Contract: rosecourse/solutions/build_cached_loop.py. The learner's cache runs inside
rose's GPT (the chapters' random strong-oracle model): the prompts go in, then the
oracle's own tokens one at a time, and at every step each row's logits are held to the
uncached oracle's by rose's one tolerance rule (rosetrainer/numerics.py), for one row, a
ragged batch of three (left padding, as rose batches), a prefill in chunks of CHUNK and
one a token a call (where a padding slot's query may see no slot at all); then the same
in bfloat16, where the keys and values it hands back must be in the model's dtype. Its
memory must stay flat while it decodes: the bytes of every tensor it holds, and the
storage each layer's keys and values come back in.

The learner's loop runs on rose's own StaticKVCache, swapped in for the learner's class,
and on rose's GPT watched: every call is recorded (the rows and tokens fed, the cache
passed), and the vocabulary is relabelled so that end-of-text comes up mid-run (the loop
must go on). Each row's tokens must be the uncached greedy run of its prompt, token for
token, and the calls must be a cached loop's: one StaticCache for every prompt, every
call on it with every row, the prefill in `prefill_chunk` pieces, then one token a row
per decode step.
"""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

import torch

from rosecourse.builds.grading import Build, KnownWrong, Mismatch, Part, expect_close, seen
from rosecourse.demo import PROMPT
from rosecourse.exercises import BATCH_TEXTS, encoded, oracle_model, reference_tokens
from rosecourse.solutions.build_cached_loop import StaticCache
from roseinfer.cache.dense import StaticKVCache
from rosetrainer.errors import one_line
from rosetrainer.model import GPT
from rosetrainer.numerics import logit_tolerance

NEW = 12  # tokens decoded per run
CHUNK = 3  # a prefill in chunks of this many tokens: every chunk after the first has a past
END_OF_TEXT = 50256  # GPT-2's <|endoftext|>, the oracle model's last token
EOT_STEP = 3  # the loop's runs meet end-of-text at this step of row 0
# bfloat16 keeps 8 bits of a number: a cached run's logits leave the uncached bfloat16
# run's by up to 2**-7 of the largest (rounding measured on the reference: 0.8%), so
# the bfloat16 part holds them to 2**-5 of it, a sanity bound (float32 is the strict one).
BF16_RTOL = 2**-5


def prompts(batch: int) -> list[tuple[int, ...]]:
    """One prompt, or BATCH_TEXTS' three of different lengths."""
    return [encoded(PROMPT)] if batch == 1 else [encoded(text) for text in BATCH_TEXTS]


@functools.cache
def oracle_logits(prompt: tuple[int, ...]) -> torch.Tensor:
    """(NEW, vocab): the uncached logits of each greedy step after `prompt` (the model is
    causal, so one pass over the prompt and its greedy tokens gives every step's)."""
    tokens = list(prompt) + list(reference_tokens(prompt, NEW))
    with torch.no_grad():
        logits = oracle_model()(torch.tensor([tokens[:-1]])).logits[0]
    return logits[len(prompt) - 1 :]


def left_padded(rows: list[tuple[int, ...]]) -> tuple[torch.Tensor, list[int]]:
    longest = max(map(len, rows))
    pads = [longest - len(row) for row in rows]
    return torch.tensor([[0] * pad + list(row) for pad, row in zip(pads, rows, strict=True)]), pads


@functools.cache
def bfloat16_model() -> GPT:
    """The oracle model in bfloat16 (a copy: the float32 one stays as it is)."""
    return copy.deepcopy(oracle_model()).to(torch.bfloat16)


@functools.cache
def bfloat16_logits(prompt: tuple[int, ...]) -> torch.Tensor:
    """oracle_logits for the bfloat16 model, uncached, fed the float32 oracle's tokens."""
    tokens = list(prompt) + list(reference_tokens(prompt, NEW))
    with torch.no_grad():
        logits = bfloat16_model()(torch.tensor([tokens[:-1]])).logits[0]
    return logits[len(prompt) - 1 :]


def cached_steps(
    cache: object, rows: list[tuple[int, ...]], chunk: int | None, model: GPT | None = None
) -> Iterator:
    """rose's GPT on `cache`: each row's prompt, then the oracle's tokens one at a time;
    yields (step, logits of every row's newest token)."""
    model = model or oracle_model()
    ids, _ = left_padded(rows)
    chunk = chunk or ids.size(1)
    with torch.no_grad():
        for start in range(0, ids.size(1), chunk):
            logits = model(ids[:, start : start + chunk], cache=cache).logits[:, -1]
        yield 0, logits
        for step in range(1, NEW):
            fed = torch.tensor([[reference_tokens(row, NEW)[step - 1]] for row in rows])
            yield step, model(fed, cache=cache).logits[:, -1]


def new_cache(
    module: types.ModuleType, rows: list[tuple[int, ...]], model: GPT | None = None
) -> object:
    _, pads = left_padded(rows)
    longest = max(map(len, rows))
    return module.StaticCache(model or oracle_model(), len(rows), longest + NEW, pads)


def watched_updates(cache: object, rows: int, dtype: torch.dtype) -> None:
    """Hold what `cache.update` hands the model to the contract before the model reads it:
    the model's dtype, every row, no NaN (a NaN there reaches every query: a weight of 0
    times NaN is NaN)."""
    update = cache.update
    calls = [0]

    def checked(layer: int, k: torch.Tensor, v: torch.Tensor):
        calls[0] += layer == 0
        try:
            out = update(layer, k, v)
        except RuntimeError as error:
            held = {t.dtype for t in held_tensors(cache).values() if t.is_floating_point()}
            if dtype == torch.float32 or held <= {dtype}:
                raise
            raise Mismatch(
                f"writing layer {layer}'s {dtype} keys and values raised {one_line(error)} with "
                f"the cache holding {', '.join(sorted(map(str, held)))} tensors: the "
                "buffers are zeros in the dtype (and on the device) of the model's "
                "weights, as the contract says"
            ) from None
        for name, got in zip(("keys", "values"), out, strict=False):
            if not isinstance(got, torch.Tensor):
                raise Mismatch(f"update returns a {type(got).__name__} for the {name}")
            if got.dtype != dtype:
                raise Mismatch(
                    f"layer {layer}'s {name} come back as {got.dtype} in a {dtype} model: "
                    "the buffers are zeros in the dtype (and on the device) of the model's "
                    "weights, as the contract says"
                )
            if got.size(0) != rows:
                raise Mismatch(
                    f"layer {layer}'s {name} come back with {got.size(0)} rows of {rows}"
                )
            # Cast back on the way out is not enough: the buffers themselves, what the
            # cache's memory is, are in the model's dtype.
            other = sorted(
                str(t.dtype)
                for t in held_tensors(cache).values()
                if t.is_floating_point() and t.dtype != dtype and t.shape == got.shape
            )
            if other:
                raise Mismatch(
                    f"layer {layer}'s {name} come back as {dtype}, but the cache holds "
                    f"{other[0]} buffers of their shape in a {dtype} model: the buffers "
                    "are zeros in the dtype (and on the device) of the model's weights, as "
                    "the contract says"
                )
            if got.isnan().any():
                raise Mismatch(
                    f"layer {layer}'s {name} hold NaN after call {calls[0]}: a query that may "
                    "see no slot (a padding slot's, before any real token) takes a softmax "
                    "over nothing, NaN, and its values carry it into the next layer, where "
                    "a weight of 0 times NaN is NaN for every query: let such a query see "
                    "some slot (rose lets it see every slot)"
                )
        return out

    cache.update = checked


def cache_in_model(batch: int, chunk: int | None, dtype: torch.dtype = torch.float32):
    """A part: rose's GPT on the learner's cache, every step's logits against the oracle's."""

    def run(module: types.ModuleType) -> None:
        rows = prompts(batch)
        model = oracle_model() if dtype == torch.float32 else bfloat16_model()
        cache = new_cache(module, rows, model)
        watched_updates(cache, len(rows), dtype)
        for step, logits in cached_steps(cache, rows, chunk, model):
            for row, prompt in enumerate(rows):
                which = f", row {row}" if batch > 1 else ""
                where = "the prefill's logits" if step == 0 else f"decode step {step}"
                if dtype == torch.float32:
                    want = oracle_logits(prompt)[step]
                    expect_close(f"{where}{which}", logits[row], want, logit_tolerance(want))
                else:
                    want = bfloat16_logits(prompt)[step]
                    tolerance = BF16_RTOL * float(want.abs().max())
                    expect_close(f"{where}{which} ({dtype})", logits[row], want, tolerance)

    return run


def held_tensors(obj: object) -> dict[int, torch.Tensor]:
    """Every tensor `obj` holds (through its attributes, lists, tuples and dicts), by storage."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    todo = [obj]
    while todo:
        item = todo.pop()
        if id(item) in seen or isinstance(item, (torch.nn.Module, type, types.ModuleType)):
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            found[item.untyped_storage().data_ptr()] = item
        elif isinstance(item, (list, tuple)):
            todo += item
        elif isinstance(item, dict):
            todo += item.values()
        elif hasattr(item, "__dict__"):
            todo += vars(item).values()
    return found


def _memory(module: types.ModuleType) -> None:
    # On a model moved to another device (meta, as to a GPU): every tensor the cache keeps.
    cache = module.StaticCache(copy.deepcopy(oracle_model()).to("meta"), 2, 8, [0, 1])
    kept = {t.device.type for t in held_tensors(cache).values()}
    elsewhere = sorted(seen("the devices of a meta model's cache", kept) - {"meta"})
    if elsewhere:
        raise Mismatch(
            f"on a model moved to another device (meta, as to a GPU) the cache keeps "
            f"tensors on the {elsewhere[0]}: make every tensor it keeps (buffers, padding, "
            "slots) on the device of the model's weights, or it fails on a GPU"
        )
    rows = prompts(3)
    cache = new_cache(module, rows)
    returned: dict[int, list[int]] = {}  # layer -> the storage of its keys, per call
    update = cache.update

    def recorded(layer: int, k: torch.Tensor, v: torch.Tensor):
        out = update(layer, k, v)
        returned.setdefault(layer, []).append(out[0].untyped_storage().data_ptr())
        return out

    cache.update = recorded
    held = []
    for _ in cached_steps(cache, rows, None):
        held.append(sum(t.untyped_storage().nbytes() for t in held_tensors(cache).values()))
    held = seen("the bytes the cache holds at each step", held)
    for step in range(len(held)):
        if held[step] != held[min(step, 1)]:
            raise Mismatch(
                f"the cache holds {held[1]:,} bytes at decode step 1 and {held[-1]:,} at "
                f"decode step {step}: a static cache allocates its buffers once"
            )
    distinct = seen(
        "the keys' storages of each layer",
        [(layer, len(set(s)), len(s)) for layer, s in returned.items()],
    )
    for layer, different, calls in distinct:
        if different > 1:
            raise Mismatch(
                f"layer {layer}'s keys come back in {different} different tensors "
                f"over {calls} calls: write into the buffers in place"
            )


def _layer_update(module: types.ModuleType) -> None:
    generator = torch.Generator().manual_seed(3)
    shape = (3, 2, 9, 4)  # three rows: every row must be written, not row 0's alone
    start = [torch.randn(shape, generator=generator) for _ in range(2)]
    new = [torch.randn(3, 2, 4, 4, generator=generator) for _ in range(2)]
    input_pos = torch.tensor([2, 3, 4, 5])
    mine = [t.clone() for t in start]
    returned = module.StaticLayer(*mine).update(input_pos, *new)
    want = [t.clone() for t in start]
    for buffer, values in zip(want, new, strict=True):
        buffer[:, :, input_pos] = values
    for name, got, right in zip(("keys", "values"), mine, want, strict=True):
        expect_close(f"the {name} buffer after writing slots 2..5", got, right, 0.0)
    for name, got, right in zip(("keys", "values"), returned, want, strict=True):
        expect_close(f"the {name} update returns", got, right, 0.0)


def roses_static_cache(
    model: GPT, batch_size: int, max_len: int, pad_lengths: list[int] | None = None
) -> StaticKVCache:
    """rose's static cache, built as the learner's loop builds its own: the loop is graded
    on its own."""
    cache = StaticKVCache(model, batch_size, max_len)
    if pad_lengths is not None and max(pad_lengths) > 0:
        cache.reset(torch.tensor(pad_lengths))
    return cache


@dataclass
class Call:
    """One call of the watched model: the ids' shape, the cache passed, and how many
    positions that cache held after it."""

    rows: int
    q_len: int
    cache: object
    held_after: int | None = None


class Watched:
    """rose's GPT as a learner's loop sees it: every call recorded, and its vocabulary
    relabelled by swapping two token ids (`swap`), in the ids it is fed and in the logits
    it returns. The relabelled model is a model like any other: its greedy run of a
    relabelled prompt is the oracle's run relabelled, so end-of-text can be made to come
    up mid-run. Everything else is the model's own (config, weights, eval, ...)."""

    def __init__(self, model: GPT, swap: tuple[int, int]) -> None:
        self.model = model
        self.calls: list[Call] = []
        self.relabel = torch.arange(model.config.vocab_size)
        self.relabel[list(swap)] = torch.tensor(swap[::-1])

    def __getattr__(self, name: str) -> object:
        return getattr(self.model, name)

    def __call__(self, idx: torch.Tensor, targets=None, cache=None, **options):
        call = Call(int(idx.size(0)), int(idx.size(-1)), cache)
        self.calls.append(call)
        out = self.model(self.relabel[idx], targets, cache, **options)
        call.held_after = getattr(cache, "seq_len", None)  # rose's cache says how much it holds
        return out._replace(logits=out.logits[..., self.relabel])

    forward = __call__


def end_of_text_swap(rows: list[tuple[int, ...]]) -> tuple[int, int]:
    """The relabelling that makes row 0's greedy token at EOT_STEP end-of-text."""
    return (reference_tokens(rows[0], NEW)[EOT_STEP], END_OF_TEXT)


def prefill_pieces(longest: int, chunk: int | None) -> list[int]:
    size = chunk or longest
    return [min(size, longest - start) for start in range(0, longest, size)]


def expect_cached_calls(
    calls: list[Call], built: list[StaticKVCache], rows: int, longest: int, chunk: int | None
) -> None:
    """The calls of a cached loop: one StaticCache, every call on it with every row, the
    prefill in prefill_chunk pieces, then one token a row per decode step."""
    if len(built) != 1:
        raise Mismatch(
            f"StaticCache is built {len(built)} times in one run: the loop builds one "
            "StaticCache, for every prompt at once, and feeds each token through it once"
        )
    (cache,) = built
    if cache.batch_size != rows:
        raise Mismatch(
            f"the StaticCache holds {cache.batch_size} row(s) for {rows} prompts: one cache "
            "holds every prompt, a row each"
        )
    fed = 0
    for number, call in enumerate(calls, 1):
        if call.cache is not cache:
            what = "without a cache" if call.cache is None else "on another cache"
            raise Mismatch(
                f"model call {number} runs {what}: every call goes through the one "
                "StaticCache (model(ids, cache=cache)), so no token is run twice"
            )
        if call.rows != rows:
            raise Mismatch(
                f"model call {number} feeds {call.rows} row(s) of {rows}: every prompt goes "
                "through every call at once, a row each"
            )
        fed += call.q_len
        if call.held_after != fed:
            raise Mismatch(
                f"after model call {number} the cache holds {call.held_after} positions "
                f"where {fed} tokens were fed"
            )
    sizes = [call.q_len for call in calls]
    prefill, total = [], 0
    while total < longest and len(prefill) < len(sizes):
        prefill.append(sizes[len(prefill)])
        total += prefill[-1]
    want = prefill_pieces(longest, chunk)
    too_big = max(prefill) > (chunk or longest) or total != longest
    if too_big or len(prefill) != len(want):
        how = "at once" if chunk is None else "prefill_chunk tokens a call"
        raise Mismatch(
            f"the prefill feeds the {longest} padded prompt tokens as {prefill} with "
            f"prefill_chunk={chunk}: the padded prompts go through the model {how} "
            f"({want})"
        )
    decode = sizes[len(prefill) :]
    if any(size != 1 for size in decode):
        raise Mismatch(
            f"after the prefill the model is fed {decode} tokens a call: every decode step "
            "feeds each row's newest token alone"
        )
    if len(decode) not in (NEW - 1, NEW):
        raise Mismatch(
            f"{len(decode)} decode calls for {NEW} new tokens: one call a token after the "
            f"first ({NEW - 1}; the last token need not be fed)"
        )


def loop(batch: int, chunk: int | None):
    """A part: the learner's loop on rose's static cache, each row against its oracle run,
    and its calls against a cached loop's."""

    def run(module: types.ModuleType) -> None:
        rows = prompts(batch)
        swap = end_of_text_swap(rows)
        model = Watched(oracle_model(), swap)
        built: list[StaticKVCache] = []

        def static_cache(*args, **kwargs) -> StaticKVCache:
            built.append(roses_static_cache(*args, **kwargs))
            return built[-1]

        fed = [model.relabel[torch.tensor(row)].tolist() for row in rows]
        given = [list(row) for row in fed]
        with mock.patch.object(module, "StaticCache", static_cache):
            got = seen("the tokens it returns", module.generate_cached(model, fed, NEW, chunk))
        after = seen("the prompt lists after the call", fed)
        changed = next(
            (i for i, (a, b) in enumerate(zip(after, given, strict=True)) if a != b), None
        )
        if changed is not None:
            raise Mismatch(
                f"generate_cached changed the prompt lists it was given (row {changed} was "
                f"{given[changed]}, is {after[changed]}): they are the caller's; pad a copy"
            )
        if not isinstance(got, list) or len(got) != len(rows):
            raise Mismatch(f"it returns {type(got).__name__} where {len(rows)} lists are right")
        for row, prompt in enumerate(rows):
            want = model.relabel[torch.tensor(reference_tokens(prompt, NEW))].tolist()
            tokens = [int(t) for t in got[row]]
            if tokens != want:
                which = f"row {row}: " if batch > 1 else ""
                raise Mismatch(which + token_gap(tokens, want))
        expect_cached_calls(model.calls, built, len(rows), max(map(len, rows)), chunk)

    return run


def token_gap(tokens: list[int], want: list[int]) -> str:
    """Where a row's tokens leave the oracle's, in words (end-of-text named)."""
    step = next((i for i, (a, b) in enumerate(zip(tokens, want, strict=False)) if a != b), None)
    if step is not None:
        return (
            f"step {step} (token {step + 1} of {NEW}) is {tokens[step]} where the uncached "
            f"oracle gives {want[step]}"
        )
    said = f"{len(tokens)} new tokens where {NEW} are right"
    if len(tokens) < NEW and END_OF_TEXT in tokens:
        said += (
            f": it stops after end-of-text ({END_OF_TEXT}, step {tokens.index(END_OF_TEXT)}), "
            "where the contract decodes max_new_tokens tokens whatever they are (no "
            "stopping early)"
        )
    return said


def _probe(module: types.ModuleType) -> list[object]:
    """Layer writes on three rows, every step's logits of a ragged batch of two in chunks
    of 2 on the learner's cache, and the learner's loop on that batch."""
    generator = torch.Generator().manual_seed(5)
    buffers = [torch.zeros(3, 1, 6, 2) for _ in range(2)]
    new = [torch.randn(3, 1, 2, 2, generator=generator) for _ in range(2)]
    module.StaticLayer(*buffers).update(torch.tensor([1, 2]), *new)
    rows = [encoded(PROMPT), encoded("Good night")]
    steps = [logits for _, logits in cached_steps(new_cache(module, rows), rows, 2)]
    with mock.patch.object(module, "StaticCache", roses_static_cache):
        tokens = module.generate_cached(oracle_model(), [list(r) for r in rows], 4, 2)
    return [buffers, steps, tokens]


# ---------------------------------------------------------------------------
# Known wrong answers: the reference with one method or function written wrong
# ---------------------------------------------------------------------------
# Each runs as if written in the learner's file (grading.replaced rebinds it to the
# module's globals); the names it reads are imported above from the reference solution.


def _top_left_mask(
    self, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
    self.filled += q_len
    slots = torch.arange(self.max_len, device=device)
    # The rows input_pos of the full causal mask: the bottom q_len of filled rows.
    # the mistake: was `causal = slots[None, :] <= self.input_pos[:, None]`
    causal = slots[None, :] <= torch.arange(q_len, device=device)[:, None]
    mask = causal[None, None, :, :] & self.real[:, None, None, :]
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)
    return pos, mask


def _positions_restart(
    self, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
    self.filled += q_len
    slots = torch.arange(self.max_len, device=device)
    # The rows input_pos of the full causal mask: the bottom q_len of filled rows.
    causal = slots[None, :] <= self.input_pos[:, None]
    mask = causal[None, None, :, :] & self.real[:, None, None, :]
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    # the mistake: was `pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)`
    pos = torch.arange(q_len, device=device)[None, :].expand(batch, q_len)
    return pos, mask


def _padding_counted(
    self, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
    self.filled += q_len
    slots = torch.arange(self.max_len, device=device)
    # The rows input_pos of the full causal mask: the bottom q_len of filled rows.
    causal = slots[None, :] <= self.input_pos[:, None]
    mask = causal[None, None, :, :] & self.real[:, None, None, :]
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    # the mistake: was `pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)`
    pos = self.input_pos[None, :].expand(batch, q_len)
    return pos, mask


def _padding_attended(
    self, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
    self.filled += q_len
    slots = torch.arange(self.max_len, device=device)
    # The rows input_pos of the full causal mask: the bottom q_len of filled rows.
    causal = slots[None, :] <= self.input_pos[:, None]
    # the mistake: was `mask = causal[None, None, :, :] & self.real[:, None, None, :]`
    mask = causal[None, None, :, :].expand(batch, 1, q_len, self.max_len)
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)
    return pos, mask


def _row_zero_only(
    self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # the mistake: was `self.k[:, :, input_pos] = k`
    self.k[0, :, input_pos] = k[0]
    # the mistake: was `self.v[:, :, input_pos] = v`
    self.v[0, :, input_pos] = v[0]
    return self.k, self.v


def _chunk_sees_ahead(
    self, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
    self.filled += q_len
    slots = torch.arange(self.max_len, device=device)
    # The rows input_pos of the full causal mask: the bottom q_len of filled rows.
    # the mistake: was `causal = slots[None, :] <= self.input_pos[:, None]`
    causal = slots[None, :] < self.filled
    mask = causal[None, None, :, :] & self.real[:, None, None, :]
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)
    return pos, mask


@torch.no_grad()
def _right_padding(
    model: GPT, prompts: list[list[int]], max_new_tokens: int, prefill_chunk: int | None = None
) -> list[list[int]]:
    longest = max(len(prompt) for prompt in prompts)
    pads = [longest - len(prompt) for prompt in prompts]
    # the mistake: was `rows = [[0] * pad + prompt for pad, prompt in zip(pads, prompts,
    # strict=True)]`
    rows = [prompt + [0] * pad for pad, prompt in zip(pads, prompts, strict=True)]
    ids = torch.tensor(rows, device=model.lm_head.weight.device)
    cache = StaticCache(model, len(prompts), longest + max_new_tokens, pads)
    chunk = prefill_chunk or longest
    for start in range(0, longest, chunk):
        logits = model(ids[:, start : start + chunk], cache=cache).logits[:, -1]
    new_tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        next_ids = logits.argmax(dim=-1)
        for row, token in zip(new_tokens, next_ids.tolist(), strict=True):
            row.append(token)
        if step + 1 < max_new_tokens:  # the last token is never fed back
            logits = model(next_ids[:, None], cache=cache).logits[:, -1]
    return new_tokens


CACHED_LOOP = Build(
    name="cached_loop",
    chapters="02-06",
    task="a static KV cache that plugs into rose's GPT, and the cached greedy loop",
    parts=(
        Part("layer update", _layer_update),
        Part("cache, one row", cache_in_model(1, None)),
        Part("cache, ragged batch of 3", cache_in_model(3, None)),
        Part(f"cache, prefill in chunks of {CHUNK}", cache_in_model(3, CHUNK)),
        Part("cache, prefill a token a call", cache_in_model(3, 1)),
        Part("cache, bfloat16 model", cache_in_model(3, CHUNK, torch.bfloat16)),
        Part("cache memory", _memory),
        Part("loop, one row", loop(1, None)),
        Part("loop, ragged batch of 3", loop(3, None)),
        Part(f"loop, prefill in chunks of {CHUNK}", loop(3, CHUNK)),
        Part("loop, prefill a token a call", loop(3, 1)),
        Part("loop, prefill_chunk past the prompts", loop(3, 40)),
    ),
    probe=_probe,
    known_wrong=(
        KnownWrong(
            "top_left_mask",
            {"StaticCache.prepare": _top_left_mask},
            "the mask is aligned top-left: the new queries get the first rows of the full "
            "causal mask, as if they stood at the start, so a decode step sees slot 0 alone",
        ),
        KnownWrong(
            "positions_restart",
            {"StaticCache.prepare": _positions_restart},
            "the new tokens' positions start at 0 in every call: after a past they must "
            "continue where it ends",
        ),
        KnownWrong(
            "padding_counted",
            {"StaticCache.prepare": _padding_counted},
            "positions count the padding slots: a padded row's first real token must "
            "stand at position 0, as it does alone",
        ),
        KnownWrong(
            "padding_attended",
            {"StaticCache.prepare": _padding_attended},
            "queries attend to the padding slots: mask them out for every query of the row",
        ),
        KnownWrong(
            "row_zero_only",
            {"StaticLayer.update": _row_zero_only},
            "the layer writes row 0's keys and values alone: every row of the batch has its own",
        ),
        KnownWrong(
            "chunk_sees_ahead",
            {"StaticCache.prepare": _chunk_sees_ahead},
            "every new query sees all the slots filled so far, the later new tokens' too: "
            "query i of a call may see the slots up to its own",
        ),
        KnownWrong(
            "right_padding",
            {"generate_cached": _right_padding},
            "the loop pads the prompts on the right: the cache expects each row's padding "
            "first (left padding), so the last prompt token of every row is the last column",
        ),
    ),
    passed="equal to the uncached oracle",
)
