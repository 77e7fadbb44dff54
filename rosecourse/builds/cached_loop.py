"""Build (chapters 02-06): the cached loop and a static KV cache, graded against the oracle.

Contract: rosecourse/solutions/build_cached_loop.py. The learner's cache runs inside
rose's GPT (the chapters' random strong-oracle model): the prompts go in, then the
oracle's own tokens one at a time, and at every step each row's logits are held to the
uncached oracle's by rose's one tolerance rule (rosetrainer/numerics.py), for one row, a
ragged batch of three (left padding, as rose batches) and a prefill in chunks of
CHUNK. Its memory must stay flat while it decodes: the bytes of every tensor it holds,
and the storage each layer's keys and values come back in. The learner's loop runs on
rose's own StaticKVCache, swapped in for the learner's class, and each row's tokens must
be the uncached greedy run of its prompt, token for token.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterator
from unittest import mock

import torch

from rosecourse.builds.grading import Build, KnownWrong, Mismatch, Part, expect_close
from rosecourse.demo import PROMPT
from rosecourse.exercises import BATCH_TEXTS, encoded, oracle_model, reference_tokens
from roseinfer.cache.dense import StaticKVCache
from rosetrainer.model import GPT
from rosetrainer.numerics import logit_tolerance

NEW = 12  # tokens decoded per run
CHUNK = 3  # a prefill in chunks of this many tokens: every chunk after the first has a past


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


def cached_steps(cache: object, rows: list[tuple[int, ...]], chunk: int | None) -> Iterator:
    """rose's GPT on `cache`: each row's prompt, then the oracle's tokens one at a time;
    yields (step, logits of every row's newest token)."""
    model = oracle_model()
    ids, _ = left_padded(rows)
    chunk = chunk or ids.size(1)
    with torch.no_grad():
        for start in range(0, ids.size(1), chunk):
            logits = model(ids[:, start : start + chunk], cache=cache).logits[:, -1]
        yield 0, logits
        for step in range(1, NEW):
            fed = torch.tensor([[reference_tokens(row, NEW)[step - 1]] for row in rows])
            yield step, model(fed, cache=cache).logits[:, -1]


def new_cache(module: types.ModuleType, rows: list[tuple[int, ...]]) -> object:
    _, pads = left_padded(rows)
    longest = max(map(len, rows))
    return module.StaticCache(oracle_model(), len(rows), longest + NEW, pads)


def cache_in_model(batch: int, chunk: int | None):
    """A part: rose's GPT on the learner's cache, every step's logits against the oracle's."""

    def run(module: types.ModuleType) -> None:
        rows = prompts(batch)
        for step, logits in cached_steps(new_cache(module, rows), rows, chunk):
            for row, prompt in enumerate(rows):
                want = oracle_logits(prompt)[step]
                which = f", row {row}" if batch > 1 else ""
                where = "the prefill's logits" if step == 0 else f"decode step {step}"
                expect_close(f"{where}{which}", logits[row], want, logit_tolerance(want))

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
    for step, _ in cached_steps(cache, rows, None):
        held.append(sum(t.untyped_storage().nbytes() for t in held_tensors(cache).values()))
        if held[-1] != held[min(step, 1)]:
            raise Mismatch(
                f"the cache holds {held[1]:,} bytes at decode step 1 and {held[-1]:,} at "
                f"decode step {step}: a static cache allocates its buffers once"
            )
    for layer, storages in returned.items():
        if len(set(storages)) > 1:
            raise Mismatch(
                f"layer {layer}'s keys come back in {len(set(storages))} different tensors "
                f"over {len(storages)} calls: write into the buffers in place"
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


def loop(batch: int, chunk: int | None):
    """A part: the learner's loop on rose's static cache, each row against its oracle run."""

    def run(module: types.ModuleType) -> None:
        rows = prompts(batch)
        with mock.patch.object(module, "StaticCache", roses_static_cache):
            got = module.generate_cached(oracle_model(), [list(r) for r in rows], NEW, chunk)
        if not isinstance(got, list) or len(got) != len(rows):
            raise Mismatch(f"it returns {type(got).__name__} where {len(rows)} lists are right")
        for row, prompt in enumerate(rows):
            want = list(reference_tokens(prompt, NEW))
            tokens = list(got[row])
            if tokens != want:
                step = next(
                    (i for i, (a, b) in enumerate(zip(tokens, want, strict=False)) if a != b), None
                )
                which = f"row {row}: " if batch > 1 else ""
                if step is None:
                    raise Mismatch(f"{which}{len(tokens)} new tokens where {NEW} are right")
                raise Mismatch(
                    f"{which}step {step} (token {step + 1} of {NEW}) is {tokens[step]} where "
                    f"the uncached oracle gives {want[step]}"
                )

    return run


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


CACHED_LOOP = Build(
    name="cached_loop",
    chapters="02-06",
    task="a static KV cache that plugs into rose's GPT, and the cached greedy loop",
    parts=(
        Part("layer update", _layer_update),
        Part("cache, one row", cache_in_model(1, None)),
        Part("cache, ragged batch of 3", cache_in_model(3, None)),
        Part(f"cache, prefill in chunks of {CHUNK}", cache_in_model(3, CHUNK)),
        Part("cache memory", _memory),
        Part("loop, one row", loop(1, None)),
        Part("loop, ragged batch of 3", loop(3, None)),
        Part(f"loop, prefill in chunks of {CHUNK}", loop(3, CHUNK)),
    ),
    probe=_probe,
    known_wrong=(
        KnownWrong(
            "top_left_mask",
            (
                (
                    "causal = slots[None, :] <= self.input_pos[:, None]",
                    "causal = slots[None, :] <= torch.arange(q_len, device=device)[:, None]",
                ),
            ),
            "the mask is aligned top-left: the new queries get the first rows of the full "
            "causal mask, as if they stood at the start, so a decode step sees slot 0 alone",
        ),
        KnownWrong(
            "positions_restart",
            (
                (
                    "pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)",
                    "pos = torch.arange(q_len, device=device)[None, :].expand(batch, q_len)",
                ),
            ),
            "the new tokens' positions start at 0 in every call: after a past they must "
            "continue where it ends",
        ),
        KnownWrong(
            "padding_counted",
            (
                (
                    "pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)",
                    "pos = self.input_pos[None, :].expand(batch, q_len)",
                ),
            ),
            "positions count the padding slots: a padded row's first real token must "
            "stand at position 0, as it does alone",
        ),
        KnownWrong(
            "padding_attended",
            (
                (
                    "mask = causal[None, None, :, :] & self.real[:, None, None, :]",
                    "mask = causal[None, None, :, :].expand(batch, 1, q_len, self.max_len)",
                ),
            ),
            "queries attend to the padding slots: mask them out for every query of the row",
        ),
        KnownWrong(
            "row_zero_only",
            (
                ("self.k[:, :, input_pos] = k", "self.k[0, :, input_pos] = k[0]"),
                ("self.v[:, :, input_pos] = v", "self.v[0, :, input_pos] = v[0]"),
            ),
            "the layer writes row 0's keys and values alone: every row of the batch has its own",
        ),
        KnownWrong(
            "chunk_sees_ahead",
            (("slots[None, :] <= self.input_pos[:, None]", "slots[None, :] < self.filled"),),
            "every new query sees all the slots filled so far, the later new tokens' too: "
            "query i of a call may see the slots up to its own",
        ),
        KnownWrong(
            "right_padding",
            (
                (
                    "rows = [[0] * pad + prompt for",
                    "rows = [prompt + [0] * pad for",
                ),
            ),
            "the loop pads the prompts on the right: the cache expects each row's padding "
            "first (left padding), so the last prompt token of every row is the last column",
        ),
    ),
    passed="equal to the uncached oracle",
)
