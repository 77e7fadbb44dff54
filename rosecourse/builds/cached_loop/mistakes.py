"""The cached loop build's known wrong answers (data: what `rose-course check
cached_loop` names).

Each is the reference solution (cached_loop/reference.py) with one
method or function written wrong, as a learner writes it into build_cached_loop.py: it
runs as if written there (grading.replaced rebinds it to the module's globals; the names
it reads are imported below from the reference solution). `# the mistake` marks the line.
"""

from __future__ import annotations

import torch

from rosecourse.builds.cached_loop.reference import StaticCache
from rosecourse.builds.grading import KnownWrong
from rosetrainer.model import GPT


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
