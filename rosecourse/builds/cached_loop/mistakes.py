"""The cached loop build's known answers, as data (rosecourse/exercises/answers.py says
what each kind is; tests/course/test_builds.py runs them against this build's check).

Each is the reference solution (reference.py, beside this file) with one class, function or
method replaced by the code below, as a learner writes it into build_cached_loop.py: it runs
as if written there (grading.replaced rebinds a function to the module's globals, so the
names it reads are the module's; those imported below from the reference are for the reader
and the linter). First the known mistakes (`KNOWN_WRONG`: what `rose-course check
cached_loop` names when a learner's module probes like one); then the other wrong answers
(`build_mutant`) and the right ones written another way (`build_alternative`); last the
wrong answers written blind (`blind_build`). Where a piece was written as an edit of the
reference's text, `# the mistake` marks the line.
"""

from __future__ import annotations

import torch

from rosecourse.builds.cached_loop import reference
from rosecourse.builds.cached_loop.reference import StaticCache, StaticLayer
from rosecourse.builds.grading import KnownWrong
from rosecourse.exercises.answers import blind_build, build_alternative, build_mutant
from rosetrainer.model import GPT

# == The known mistakes: the check names each one it meets (KNOWN_WRONG) ======================


def _prepare(self, batch, q_len, device, causal_of=None, pos_of=None, padding_seen=False):
    """The reference's StaticCache.prepare, with the mistake its arguments say: the causal
    mask `causal_of(slots)`, the positions `pos_of()`, the padding slots left visible."""
    self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
    self.filled += q_len
    slots = torch.arange(self.max_len, device=device)
    # The rows input_pos of the full causal mask: the bottom q_len of filled rows.
    causal = slots[None, :] <= self.input_pos[:, None] if causal_of is None else causal_of(slots)
    if padding_seen:  # the mistake: was `mask = causal[None, None, :, :] & self.real[...]`
        mask = causal[None, None, :, :].expand(batch, 1, q_len, self.max_len)
    else:
        mask = causal[None, None, :, :] & self.real[:, None, None, :]
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    if pos_of is not None:
        return pos_of(), mask
    return (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0), mask


def _top_left_mask(self, batch: int, q_len: int, device: torch.device):
    # the mistake: was `causal = slots[None, :] <= self.input_pos[:, None]`
    top_left = torch.arange(q_len, device=device)[:, None]
    return _prepare(self, batch, q_len, device, causal_of=lambda slots: slots[None, :] <= top_left)


def _positions_restart(self, batch: int, q_len: int, device: torch.device):
    # the mistake: was `pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)`
    restart = torch.arange(q_len, device=device)[None, :].expand(batch, q_len)
    return _prepare(self, batch, q_len, device, pos_of=lambda: restart)


def _padding_counted(self, batch: int, q_len: int, device: torch.device):
    # the mistake: was `pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)`
    return _prepare(
        self, batch, q_len, device, pos_of=lambda: self.input_pos[None, :].expand(batch, q_len)
    )


def _padding_attended(self, batch: int, q_len: int, device: torch.device):
    return _prepare(self, batch, q_len, device, padding_seen=True)


def _chunk_sees_ahead(self, batch: int, q_len: int, device: torch.device):
    # the mistake: was `causal = slots[None, :] <= self.input_pos[:, None]`
    return _prepare(
        self, batch, q_len, device, causal_of=lambda slots: slots[None, :] < self.filled
    )


def _row_zero_only(
    self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # the mistake: was `self.k[:, :, input_pos] = k`
    self.k[0, :, input_pos] = k[0]
    # the mistake: was `self.v[:, :, input_pos] = v`
    self.v[0, :, input_pos] = v[0]
    return self.k, self.v


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


KNOWN_WRONG = (
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
)


# == Other wrong answers (build_mutant), and right ones (build_alternative) ==================
# tests/course/test_builds.py asserts that each wrong one fails a part of the check without
# being taken for a known mistake, and that each right one passes every part.

# -- written as code -----------------------------------------------------------------------

# These functions run with the learner module's globals: StaticCache is whatever the
# module holds under that name (rose's own static cache while the loop is checked).

END_OF_TEXT = 50256  # GPT-2's <|endoftext|>


def _padded(prompts: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    longest = max(map(len, prompts))
    pads = [longest - len(p) for p in prompts]
    return torch.tensor([[0] * pad + p for pad, p in zip(pads, prompts, strict=True)]), pads


@build_mutant("cached_loop", "generate_cached")
def loop_without_a_cache(model, prompts, max_new_tokens, prefill_chunk=None):
    # The whole sequence through the model every step, one prompt at a time: right tokens,
    # and no cache at all.
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_new_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(prompt) :])
    return out


@build_mutant("cached_loop", "generate_cached")
def one_prompt_at_a_time(model, prompts, max_new_tokens, prefill_chunk=None):
    out = []
    with torch.no_grad():
        for prompt in prompts:
            cache = StaticCache(model, 1, len(prompt) + max_new_tokens)  # noqa: F821
            ids = torch.tensor([prompt])
            chunk = prefill_chunk or len(prompt)
            for start in range(0, len(prompt), chunk):
                logits = model(ids[:, start : start + chunk], cache=cache).logits[:, -1]
            tokens = []
            for _ in range(max_new_tokens):
                tokens.append(int(logits.argmax()))
                logits = model(torch.tensor([[tokens[-1]]]), cache=cache).logits[:, -1]
            out.append(tokens)
    return out


def _cached_loop(model, prompts, max_new_tokens, chunks, stop=None):
    """The reference's loop with the prefill split as `chunks(longest)` says and an
    optional stop(new_tokens) -> bool checked after every step."""
    ids, pads = _padded(prompts)
    longest = ids.size(1)
    cache = StaticCache(model, len(prompts), longest + max_new_tokens, pads)  # noqa: F821
    with torch.no_grad():
        start = 0
        for size in chunks(longest):
            logits = model(ids[:, start : start + size], cache=cache).logits[:, -1]
            start += size
        new_tokens = [[] for _ in prompts]
        for step in range(max_new_tokens):
            next_ids = logits.argmax(dim=-1)
            for row, token in zip(new_tokens, next_ids.tolist(), strict=True):
                row.append(token)
            if stop is not None and stop(new_tokens):
                break
            if step + 1 < max_new_tokens:
                logits = model(next_ids[:, None], cache=cache).logits[:, -1]
    return new_tokens


@build_mutant("cached_loop", "generate_cached")
def prefill_ignores_the_chunk(model, prompts, max_new_tokens, prefill_chunk=None):
    return _cached_loop(model, prompts, max_new_tokens, lambda n: [n])


@build_mutant("cached_loop", "generate_cached")
def stops_at_end_of_text(model, prompts, max_new_tokens, prefill_chunk=None):
    def chunks(n):
        size = prefill_chunk or n
        return [min(size, n - s) for s in range(0, n, size)]

    return _cached_loop(
        model, prompts, max_new_tokens, chunks, lambda rows: END_OF_TEXT in rows[0][-1:]
    )


@build_mutant("cached_loop", "generate_cached")
def prefill_leaves_the_last_token(model, prompts, max_new_tokens, prefill_chunk=None):
    # All but the last prompt token in one call, the last fed as a first decode step.
    return _cached_loop(model, prompts, max_new_tokens, lambda n: [n - 1, 1])


@build_mutant("cached_loop", "generate_cached")
def a_fresh_cache_every_step(model, prompts, max_new_tokens, prefill_chunk=None):
    # A cache, but rebuilt and refilled with the whole sequence every step.
    ids, pads = _padded(prompts)
    new_tokens = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            cache = StaticCache(model, len(prompts), ids.size(1), pads)  # noqa: F821
            next_ids = model(ids, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
            new_tokens.append(next_ids)
            ids = torch.cat([ids, next_ids], dim=1)
    return torch.cat(new_tokens, dim=1).tolist()


@build_mutant("cached_loop", "generate_cached")
def cache_for_the_prefill_alone(model, prompts, max_new_tokens, prefill_chunk=None):
    # The prompts through the cache, then every decode step over each whole sequence.
    ids, pads = _padded(prompts)
    cache = StaticCache(model, len(prompts), ids.size(1), pads)  # noqa: F821
    with torch.no_grad():
        first = model(ids, cache=cache).logits[:, -1].argmax(-1).tolist()
    out = []
    for prompt, token in zip(prompts, first, strict=True):
        seq = [*prompt, token]
        with torch.no_grad():
            for _ in range(max_new_tokens - 1):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        out.append(seq[len(prompt) :])
    return out


@build_mutant("cached_loop", "generate_cached")
def each_row_stops_at_end_of_text(model, prompts, max_new_tokens, prefill_chunk=None):
    def chunks(n):
        size = prefill_chunk or n
        return [min(size, n - s) for s in range(0, n, size)]

    rows = _cached_loop(model, prompts, max_new_tokens, chunks)
    return [row[: row.index(END_OF_TEXT) + 1] if END_OF_TEXT in row else row for row in rows]


@build_mutant("cached_loop", "generate_cached")
def the_last_prompt_tokens_alone_when_chunked(model, prompts, max_new_tokens, prefill_chunk=None):
    # Chunks of prefill_chunk, but a remainder shorter than a chunk fed a token a call.
    def chunks(n):
        size = prefill_chunk or n
        whole = [size] * (n // size)
        return whole + [1] * (n - sum(whole))

    return _cached_loop(model, prompts, max_new_tokens, chunks)


@build_mutant("cached_loop", "StaticCache", name="buffers_in_the_default_dtype")
class DefaultDtypeCache(reference.StaticCache):
    def __init__(self, model, batch_size, max_len, pad_lengths=None):
        super().__init__(model, batch_size, max_len, pad_lengths)
        for layer in self.layers:  # torch.zeros(shape): float32 whatever the model's dtype
            layer.k, layer.v = torch.zeros(layer.k.shape), torch.zeros(layer.v.shape)


@build_mutant("cached_loop", "StaticCache", name="values_in_the_default_dtype")
class DefaultDtypeValues(reference.StaticCache):
    def __init__(self, model, batch_size, max_len, pad_lengths=None):
        super().__init__(model, batch_size, max_len, pad_lengths)
        for layer in self.layers:
            layer.v = torch.zeros(layer.v.shape)


class _CastingLayer(reference.StaticLayer):
    def update(self, input_pos, k, v):
        self.k[:, :, input_pos] = k.to(self.k.dtype)
        self.v[:, :, input_pos] = v.to(self.v.dtype)
        return self.k.to(k.dtype), self.v.to(v.dtype)  # cast back: the dtype looks right


@build_mutant("cached_loop", "StaticCache", name="float32_buffers_cast_back")
class Float32BuffersCastBack(reference.StaticCache):
    def __init__(self, model, batch_size, max_len, pad_lengths=None):
        super().__init__(model, batch_size, max_len, pad_lengths)
        self.layers = [
            _CastingLayer(torch.zeros(layer.k.shape), torch.zeros(layer.v.shape))
            for layer in self.layers
        ]


@build_mutant("cached_loop", "StaticCache", name="padding_queries_see_nothing")
class PaddingQueriesSeeNothing(reference.StaticCache):
    def prepare(self, batch, q_len, device):
        self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
        self.filled += q_len
        slots = torch.arange(self.max_len, device=device)
        causal = slots[None, :] <= self.input_pos[:, None]
        mask = causal[None, None, :, :] & self.real[:, None, None, :]  # all False: NaN rows
        pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)
        return pos, mask


@build_alternative("cached_loop", "generate_cached")
def loop_that_feeds_the_last_token_too(model, prompts, max_new_tokens, prefill_chunk=None):
    # Remainder first, logits of the last position alone, and one decode call a token
    # (the last one's logits unused): a cached loop all the same.
    ids, pads = _padded(prompts)
    ids = ids.to(model.lm_head.weight.device)
    longest = ids.size(1)
    size = prefill_chunk or longest
    cache = StaticCache(model, len(prompts), longest + max_new_tokens, pads)  # noqa: F821
    cuts = [0, *range(longest % size or size, longest + 1, size)]
    out = []
    with torch.inference_mode():
        for start, end in zip(cuts, cuts[1:], strict=False):
            logits = model.forward(idx=ids[:, start:end], cache=cache, last_only=True).logits
        for _ in range(max_new_tokens):
            out.append(logits[:, -1].argmax(-1, keepdim=True))
            logits = model(out[-1], cache=cache, last_only=True).logits
    return torch.cat(out, dim=1).tolist()


@build_alternative("cached_loop", "StaticCache", name="padding_queries_see_themselves")
class PaddingQueriesSeeThemselves(reference.StaticCache):
    def prepare(self, batch, q_len, device):
        self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
        self.filled += q_len
        slots = torch.arange(self.max_len, device=device)
        causal = slots[None, :] <= self.input_pos[:, None]
        mask = causal[None, None, :, :] & self.real[:, None, None, :]
        # A padding slot's query sees its own slot alone (no NaN, and nothing real).
        own = slots[None, :] == self.input_pos[:, None]  # (q_len, max_len)
        padding_query = self.input_pos[None, :] < self.pads[:, None]  # (B, q_len)
        mask = mask | (own[None, None] & padding_query[:, None, :, None])
        pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)
        return pos, mask


# -- first written as edits of the reference's text: `# the mistake` marks the line ----------
# A mutant that replaces two pieces is registered twice under one name.


@build_mutant("cached_loop", "StaticLayer.update")
def written_out_of_place(
    self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # the mistake: was `self.k[:, :, input_pos] = k`
    self.k = self.k.index_copy(2, input_pos, k)
    # the mistake: was `self.v[:, :, input_pos] = v`
    self.v = self.v.index_copy(2, input_pos, v)
    return self.k, self.v


@build_mutant("cached_loop", "StaticCache.prepare", name="query_blind_to_itself")
def query_blind_to_itself_in_the_cache(
    self, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
    self.filled += q_len
    slots = torch.arange(self.max_len, device=device)
    # The rows input_pos of the full causal mask: the bottom q_len of filled rows.
    # the mistake: was `causal = slots[None, :] <= self.input_pos[:, None]`
    causal = slots[None, :] < self.input_pos[:, None]
    mask = causal[None, None, :, :] & self.real[:, None, None, :]
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)
    return pos, mask


@build_mutant("cached_loop", "StaticCache.prepare")
def filled_never_advances(
    self, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
    # the mistake: `self.filled += q_len` left out
    slots = torch.arange(self.max_len, device=device)
    # The rows input_pos of the full causal mask: the bottom q_len of filled rows.
    causal = slots[None, :] <= self.input_pos[:, None]
    mask = causal[None, None, :, :] & self.real[:, None, None, :]
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)
    return pos, mask


@build_mutant("cached_loop", "StaticCache.__init__")
def padding_taken_from_the_right(
    self, model: GPT, batch_size: int, max_len: int, pad_lengths: list[int] | None = None
) -> None:
    cfg = model.config
    weight = model.lm_head.weight
    shape = (batch_size, cfg.n_head, max_len, cfg.n_embd // cfg.n_head)
    self.layers = [
        StaticLayer(
            torch.zeros(shape, dtype=weight.dtype, device=weight.device),
            torch.zeros(shape, dtype=weight.dtype, device=weight.device),
        )
        for _ in range(cfg.n_layer)
    ]
    self.max_len = max_len
    self.filled = 0
    self.input_pos = torch.zeros(0, dtype=torch.long, device=weight.device)
    self.pads = torch.tensor(pad_lengths or [0] * batch_size, device=weight.device)
    slots = torch.arange(max_len, device=weight.device)
    # (B, max_len): the slot holds a real token of the row, not padding.
    # the mistake: was `self.real = slots[None, :] >= self.pads[:, None]`
    self.real = slots[None, :] < max_len - self.pads[:, None]


@build_mutant("cached_loop", "StaticCache.__init__")
def one_real_slot_masked(
    self, model: GPT, batch_size: int, max_len: int, pad_lengths: list[int] | None = None
) -> None:
    cfg = model.config
    weight = model.lm_head.weight
    shape = (batch_size, cfg.n_head, max_len, cfg.n_embd // cfg.n_head)
    self.layers = [
        StaticLayer(
            torch.zeros(shape, dtype=weight.dtype, device=weight.device),
            torch.zeros(shape, dtype=weight.dtype, device=weight.device),
        )
        for _ in range(cfg.n_layer)
    ]
    self.max_len = max_len
    self.filled = 0
    self.input_pos = torch.zeros(0, dtype=torch.long, device=weight.device)
    self.pads = torch.tensor(pad_lengths or [0] * batch_size, device=weight.device)
    slots = torch.arange(max_len, device=weight.device)
    # (B, max_len): the slot holds a real token of the row, not padding.
    # the mistake: was `self.real = slots[None, :] >= self.pads[:, None]`
    self.real = slots[None, :] > self.pads[:, None]


@build_mutant("cached_loop", "StaticCache.prepare")
def keeps_every_mask(
    self, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
    self.filled += q_len
    slots = torch.arange(self.max_len, device=device)
    # The rows input_pos of the full causal mask: the bottom q_len of filled rows.
    causal = slots[None, :] <= self.input_pos[:, None]
    mask = causal[None, None, :, :] & self.real[:, None, None, :]
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)
    # the mistake: was `return pos, mask`
    self.masks = [*getattr(self, "masks", []), mask]
    return pos, mask


@build_mutant("cached_loop", "generate_cached")
@torch.no_grad()
def argmax_over_rows(
    model: GPT, prompts: list[list[int]], max_new_tokens: int, prefill_chunk: int | None = None
) -> list[list[int]]:
    longest = max(len(prompt) for prompt in prompts)
    pads = [longest - len(prompt) for prompt in prompts]
    rows = [[0] * pad + prompt for pad, prompt in zip(pads, prompts, strict=True)]
    ids = torch.tensor(rows, device=model.lm_head.weight.device)
    cache = StaticCache(model, len(prompts), longest + max_new_tokens, pads)
    chunk = prefill_chunk or longest
    for start in range(0, longest, chunk):
        logits = model(ids[:, start : start + chunk], cache=cache).logits[:, -1]
    new_tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        # the mistake: was `next_ids = logits.argmax(dim=-1)`
        next_ids = logits.argmax(dim=0)
        for row, token in zip(new_tokens, next_ids.tolist(), strict=True):
            row.append(token)
        if step + 1 < max_new_tokens:  # the last token is never fed back
            logits = model(next_ids[:, None], cache=cache).logits[:, -1]
    return new_tokens


@build_mutant("cached_loop", "generate_cached")
@torch.no_grad()
def last_chunk_skipped(
    model: GPT, prompts: list[list[int]], max_new_tokens: int, prefill_chunk: int | None = None
) -> list[list[int]]:
    longest = max(len(prompt) for prompt in prompts)
    pads = [longest - len(prompt) for prompt in prompts]
    rows = [[0] * pad + prompt for pad, prompt in zip(pads, prompts, strict=True)]
    ids = torch.tensor(rows, device=model.lm_head.weight.device)
    cache = StaticCache(model, len(prompts), longest + max_new_tokens, pads)
    chunk = prefill_chunk or longest
    # the mistake: was `for start in range(0, longest, chunk):`
    for start in range(0, longest - chunk, chunk):
        logits = model(ids[:, start : start + chunk], cache=cache).logits[:, -1]
    new_tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        next_ids = logits.argmax(dim=-1)
        for row, token in zip(new_tokens, next_ids.tolist(), strict=True):
            row.append(token)
        if step + 1 < max_new_tokens:  # the last token is never fed back
            logits = model(next_ids[:, None], cache=cache).logits[:, -1]
    return new_tokens


@build_mutant("cached_loop", "generate_cached")
@torch.no_grad()
def prefill_logits_of_the_first_token(
    model: GPT, prompts: list[list[int]], max_new_tokens: int, prefill_chunk: int | None = None
) -> list[list[int]]:
    longest = max(len(prompt) for prompt in prompts)
    pads = [longest - len(prompt) for prompt in prompts]
    rows = [[0] * pad + prompt for pad, prompt in zip(pads, prompts, strict=True)]
    ids = torch.tensor(rows, device=model.lm_head.weight.device)
    cache = StaticCache(model, len(prompts), longest + max_new_tokens, pads)
    chunk = prefill_chunk or longest
    for start in range(0, longest, chunk):
        # the mistake: was `logits = model(ids[:, start : start + chunk], cache=cache).logits[:, -1]
        # new_tokens: list[list[int]] = [[] for _ in prompts]`
        logits = model(ids[:, start : start + chunk], cache=cache).logits[:, 0]
    new_tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        next_ids = logits.argmax(dim=-1)
        for row, token in zip(new_tokens, next_ids.tolist(), strict=True):
            row.append(token)
        if step + 1 < max_new_tokens:  # the last token is never fed back
            logits = model(next_ids[:, None], cache=cache).logits[:, -1]
    return new_tokens


# == Written blind (blind_build; rosecourse/exercises/answers.py says how) ===================
# Each one's writer said in one line what is wrong: the `# WRONG:` comment above it.

# These run with the learner module's globals: StaticCache is whatever the module holds
# under that name (rose's own static cache while the loop is checked).


def _blind_loop(model, prompts, max_new_tokens, prefill_chunk=None, chunked=True, stops=()):
    """The reference's generate_cached; `chunked` False: the prefill in one call whatever
    prefill_chunk says; a row whose last token is in `stops` repeats it."""
    longest = max(len(prompt) for prompt in prompts)
    pads = [longest - len(prompt) for prompt in prompts]
    rows = [[0] * pad + prompt for pad, prompt in zip(pads, prompts, strict=True)]
    ids = torch.tensor(rows, device=model.lm_head.weight.device)
    cache = StaticCache(model, len(prompts), longest + max_new_tokens, pads)
    chunk = (prefill_chunk if chunked else None) or longest
    for start in range(0, longest, chunk):
        logits = model(ids[:, start : start + chunk], cache=cache).logits[:, -1]
    new_tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        next_ids = logits.argmax(dim=-1)
        for r, row in enumerate(new_tokens):
            if row and row[-1] in stops:
                next_ids[r] = row[-1]
            row.append(int(next_ids[r]))
        if step + 1 < max_new_tokens:  # the last token is never fed back
            logits = model(next_ids[:, None], cache=cache).logits[:, -1]
    return new_tokens


# WRONG: each prompt decoded alone on a cache of its own (no batching)
@blind_build("cached_loop", "generate_cached")
@torch.no_grad()
def cache_per_prompt(model, prompts, max_new_tokens, prefill_chunk=None):
    # the mistake: was `return _blind_loop(model, prompts, max_new_tokens, prefill_chunk)`
    return [_blind_loop(model, [p], max_new_tokens, prefill_chunk)[0] for p in prompts]


# WRONG: generate_cached prefills the whole prompt in one call whatever prefill_chunk says
@blind_build("cached_loop", "generate_cached")
@torch.no_grad()
def ignores_prefill_chunk(model, prompts, max_new_tokens, prefill_chunk=None):
    # the mistake: the loop's `chunk = prefill_chunk or longest` was `chunk = longest`
    return _blind_loop(model, prompts, max_new_tokens, prefill_chunk, chunked=False)


# WRONG: a row stops at end-of-text (50256) and repeats it, though the contract says no
# stopping early
@blind_build("cached_loop", "generate_cached")
@torch.no_grad()
def stops_at_eot(model, prompts, max_new_tokens, prefill_chunk=None):
    stops = (END_OF_TEXT, model.config.vocab_size - 1)  # the mistake: no stop is right
    return _blind_loop(model, prompts, max_new_tokens, prefill_chunk, stops=stops)


# WRONG: buffers always float32 (model dtype ignored); writes cast by indexing
@blind_build("cached_loop", "StaticCache.__init__", name="float32_buffers")
def _float32_buffers_made(self, model, batch_size, max_len, pad_lengths=None):
    cfg = model.config
    weight = model.lm_head.weight
    shape = (batch_size, cfg.n_head, max_len, cfg.n_embd // cfg.n_head)
    self.layers = [
        # the mistake: was `torch.zeros(shape, dtype=weight.dtype, device=weight.device)`
        StaticLayer(
            torch.zeros(shape, device=weight.device), torch.zeros(shape, device=weight.device)
        )
        for _ in range(cfg.n_layer)
    ]
    self.max_len = max_len
    self.filled = 0
    self.input_pos = torch.zeros(0, dtype=torch.long, device=weight.device)
    self.pads = torch.tensor(pad_lengths or [0] * batch_size, device=weight.device)
    slots = torch.arange(max_len, device=weight.device)
    self.real = slots[None, :] >= self.pads[:, None]


@blind_build("cached_loop", "StaticLayer.update", name="float32_buffers")
def _float32_buffers_written(self, input_pos, k, v):
    # the mistake: was `self.k[:, :, input_pos] = k` (and v), returning self.k, self.v
    self.k[:, :, input_pos] = k.float()
    self.v[:, :, input_pos] = v.float()
    return self.k.to(k.dtype), self.v.to(v.dtype)


# WRONG: StaticLayer.update rebinds self.k/self.v to new tensors (index_copy, not
# index_copy_): the buffers given are never written
@blind_build("cached_loop", "StaticLayer.update")
def out_of_place_update(self, input_pos, k, v):
    # the mistake: was `self.k[:, :, input_pos] = k` (and v): the buffers written in place
    self.k = self.k.index_copy(2, input_pos, k)
    self.v = self.v.index_copy(2, input_pos, v)
    return self.k, self.v


# WRONG: only row 0 of the batch is written into the buffers
@blind_build("cached_loop", "StaticLayer.update", known="row_zero_only")
def row0_only_write(self, input_pos, k, v):
    # the mistake: was `self.k[:, :, input_pos] = k` (and v): every row
    self.k[0].index_copy_(1, input_pos, k[0])
    self.v[0].index_copy_(1, input_pos, v[0])
    return self.k, self.v


def _blind_prepare(self, batch, q_len, device, top_left=False, opened=True, padded=True):
    """The reference's prepare; `top_left`: query i sees slots 0..i; `opened` False: a
    padding query's row left all False; `padded` False: the positions are the slots'."""
    self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
    self.filled += q_len
    slots = torch.arange(self.max_len, device=device)
    rows = torch.arange(q_len, device=device) if top_left else self.input_pos
    causal = slots[None, :] <= rows[:, None]
    mask = causal[None, None, :, :] & self.real[:, None, None, :]
    if opened:
        mask = mask | ~mask.any(dim=-1, keepdim=True)
    if not padded:
        return self.input_pos[None, :].expand(batch, q_len), mask
    return (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0), mask


# WRONG: causal part of the mask aligned top-left (query i sees slots 0..i, ignoring the past)
@blind_build("cached_loop", "StaticCache.prepare", known="top_left_mask")
def mask_top_left(self, batch, q_len, device):
    return _blind_prepare(self, batch, q_len, device, top_left=True)


# WRONG: a padding query's mask row is left all False (softmax over nothing: NaN)
@blind_build("cached_loop", "StaticCache.prepare")
def padding_rows_not_opened(self, batch, q_len, device):
    return _blind_prepare(self, batch, q_len, device, opened=False)


# WRONG: positions are the slot numbers: left padding counted in the positions
@blind_build("cached_loop", "StaticCache.prepare", known="padding_counted")
def pos_counts_padding(self, batch, q_len, device):
    return _blind_prepare(self, batch, q_len, device, padded=False)


# == A whole module written another way (build_alternative's, not one piece: all) ==========
# Every class and function written afresh, as another learner would write the file;
# tests/course/test_builds.py asserts that it passes every part.

ALTERNATIVE_MODULE = """
import torch


class StaticLayer:
    def __init__(self, k, v):
        self.buffers = (k, v)

    def update(self, input_pos, k, v):
        for buffer, new in zip(self.buffers, (k, v)):
            buffer.index_copy_(2, input_pos, new)
        return self.buffers


class StaticCache:
    def __init__(self, model, batch_size, max_len, pad_lengths=None):
        c = model.config
        w = model.lm_head.weight
        shape = (batch_size, c.n_head, max_len, c.n_embd // c.n_head)
        self.layers = [
            StaticLayer(w.new_zeros(shape), w.new_zeros(shape)) for _ in range(c.n_layer)
        ]
        self.full = torch.ones(max_len, max_len, dtype=torch.bool, device=w.device).tril()
        self.pads = pad_lengths or [0] * batch_size
        self.filled = 0

    @property
    def seq_len(self):
        return self.filled

    def prepare(self, batch, q_len, device):
        self.at = torch.arange(self.filled, self.filled + q_len, device=device)
        self.filled += q_len
        n = self.filled
        rows = self.full[self.at, :n]  # only the filled slots
        real = torch.stack([torch.arange(n, device=device) >= p for p in self.pads])
        mask = rows[None, None] & real[:, None, None]
        mask[~mask.any(-1)] = True
        pads = torch.tensor(self.pads, device=device)[:, None]
        return torch.relu(self.at[None] - pads), mask

    def update(self, layer, k, v):
        keys, values = self.layers[layer].update(self.at, k, v)
        return keys[:, :, : self.filled], values[:, :, : self.filled]


def generate_cached(model, prompts, max_new_tokens, prefill_chunk=None):
    width = max(map(len, prompts))
    pads = [width - len(p) for p in prompts]
    rows = [[0] * (width - len(p)) + p for p in prompts]
    ids = torch.tensor(rows, device=model.lm_head.weight.device)
    cache = StaticCache(model, len(prompts), width + max_new_tokens - 1, pads)
    with torch.inference_mode():
        done = 0
        while done < width:
            step = prefill_chunk or width
            out = model(ids[:, done : done + step], cache=cache).logits
            done += step
        tokens = out[:, -1].argmax(-1, keepdim=True)
        made = [tokens]
        while len(made) < max_new_tokens:
            tokens = model(tokens, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
            made.append(tokens)
    return torch.cat(made, dim=1).tolist()
"""
