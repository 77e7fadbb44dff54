"""Chapter 03's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

import torch

from rosecourse.exercises.answers import alternative, blind, breaks, known, mutant
from rosecourse.naive import top_left_causal_mask

# The mistakes chapter 08's slices share.
TOP_LEFT = (
    "your mask lets the decode query see nothing but key 0: top-left alignment (what "
    "is_causal=True does), the mask rows of the oldest positions, not the newest"
)
SQUARE = (
    "your mask is the (q_len, q_len) triangle of the new tokens alone, nanoGPT's "
    "bias[:, :, :T, :T]: a single decode query broadcasts it over every key and passes, "
    "but a chunk of several tokens after a past has more keys than queries"
)


# -- the known mistakes: the check names each one it meets (answers.known) ----------


known("03", TOP_LEFT, name="top_left")(top_left_causal_mask)


@known("03", SQUARE, name="square")
def _square_mask(q_len, kv_len, device=None):
    return torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()


@known(
    "03",
    "your mask hides nothing: a decode query may see every "
    "key anyway, but a chunk's queries now see the tokens after them",
    name="open",
)
def _open_mask(q_len, kv_len, device=None):
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device)


@known(
    "03",
    "your mask hides each query's own key (< where <= "
    "is right): the newest token never reads itself",
    name="strict",
)
def _strict_mask(q_len, kv_len, device=None):
    query = torch.arange(kv_len - q_len, kv_len, device=device)
    return torch.arange(kv_len, device=device)[None, :] < query[:, None]


# -- 03: causal_mask(q_len, kv_len, device) -------------------------------------------------


def _full(kv_len: int, diagonal: int = 0) -> torch.Tensor:
    return torch.ones(kv_len, kv_len, dtype=torch.bool).tril(diagonal)


@mutant("03")
def sees_the_next_key(q_len, kv_len, device=None):
    return _full(kv_len, 1)[kv_len - q_len :]


@mutant("03")
def mask_rows_one_early(q_len, kv_len, device=None):
    return _full(kv_len)[kv_len - q_len - 1 : kv_len - 1]


@mutant("03")
def zeros_and_ones(q_len, kv_len, device=None):
    return _full(kv_len)[kv_len - q_len :].float()


@mutant("03")
def mask_inverted(q_len, kv_len, device=None):
    return ~_full(kv_len)[kv_len - q_len :]


@mutant("03")
def mask_transposed(q_len, kv_len, device=None):
    return _full(kv_len).T[kv_len - q_len :]


@mutant("03")
def last_row_only(q_len, kv_len, device=None):
    return _full(kv_len)[-1:]


@alternative("03")
def key_at_or_before_query(q_len, kv_len, device=None):
    query = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    return torch.arange(kv_len, device=device)[None, :] <= query


@alternative("03")
def tril_with_an_offset(q_len, kv_len, device=None):
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)


# -- Written blind (issue 45) --


# WRONG: handles only decode (q_len 1: all True) and a full prefill; a chunk after a past
# gets the top-left triangle
@blind("03")
def only_decode_and_full(q_len, kv_len, device=None):
    if q_len == 1:
        return torch.ones(1, kv_len, dtype=torch.bool, device=device)
    qpos = torch.arange(q_len, device=device)
    kpos = torch.arange(kv_len, device=device)
    return kpos[None, :] <= qpos[:, None]


# WRONG: off by one: each query also sees the key after it
@blind("03")
def sees_next_key(q_len, kv_len, device=None):
    qpos = torch.arange(kv_len - q_len, kv_len, device=device)
    kpos = torch.arange(kv_len, device=device)
    return kpos[None, :] <= qpos[:, None] + 1


# WRONG: mask aligned top-left: tril of (q_len, kv_len)
@blind("03", known="top_left")
def top_left(q_len, kv_len, device=None):
    qpos = torch.arange(0, q_len, device=device)
    kpos = torch.arange(kv_len, device=device)
    return kpos[None, :] <= qpos[:, None]


# -- By class (issue 54): each breaks a clause its values do not show --

_masks: dict[tuple[int, int], torch.Tensor] = {}


@breaks("03", "on another device (meta)")
def mask_memoised_on_the_first_device(q_len, kv_len, device=None):
    if (q_len, kv_len) not in _masks:
        ones = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
        _masks[q_len, kv_len] = ones.tril(kv_len - q_len)
    return _masks[q_len, kv_len]
