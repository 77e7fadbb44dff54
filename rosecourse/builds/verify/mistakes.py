"""The verify build's known wrong answers (data: what `rose-course check verify` names).

Each is the reference solution (verify/reference.py) with one method or
function written wrong, as a learner writes it into build_verify.py: it runs as if written
there (grading.replaced rebinds it to the module's globals; the names it reads are imported
below from the reference solution). `# the mistake` marks the line.
"""

from __future__ import annotations

import torch

from rosecourse.builds.grading import KnownWrong
from rosecourse.builds.verify.reference import RollbackCache, score
from roseinfer.cache.dense import DenseKVCache
from rosetrainer.model import GPT


@torch.no_grad()
def _keys_left_in(
    target: GPT, cache: DenseKVCache | RollbackCache, last_token: int, drafts: list[int]
) -> list[int]:
    choices = score(target, cache, last_token, drafts).argmax(dim=-1).tolist()
    accepted = 0
    for drafted, chosen in zip(drafts, choices, strict=False):
        if drafted != chosen:
            break
        accepted += 1
    tokens = drafts[:accepted] + [choices[accepted]]
    # the mistake: `cache.truncate(held + len(tokens))` left out (held: the cache's seq_len
    # before the pass), so the rejected drafts' keys stay
    return tokens


@torch.no_grad()
def _no_bonus(
    target: GPT, cache: DenseKVCache | RollbackCache, last_token: int, drafts: list[int]
) -> list[int]:
    held = cache.seq_len
    choices = score(target, cache, last_token, drafts).argmax(dim=-1).tolist()
    accepted = 0
    for drafted, chosen in zip(drafts, choices, strict=False):
        if drafted != chosen:
            break
        accepted += 1
    # the mistake: was `tokens = drafts[:accepted] + [choices[accepted]]`
    tokens = drafts[:accepted] + [choices[accepted]] * (accepted < len(drafts) or not drafts)
    cache.truncate(held + len(tokens))
    return tokens


def _positions_not_offset(
    self, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    kv_len = self.seq_len + q_len
    # the mistake: was `query_pos = torch.arange(past, kv_len, device=device)`, past the cache's
    # seq_len
    query_pos = torch.arange(q_len, device=device)
    key_pos = torch.arange(kv_len, device=device)
    return query_pos[None, :], key_pos[None, :] <= query_pos[:, None]


@torch.no_grad()
def _keeps_first_rejected(
    target: GPT, cache: DenseKVCache | RollbackCache, last_token: int, drafts: list[int]
) -> list[int]:
    held = cache.seq_len
    choices = score(target, cache, last_token, drafts).argmax(dim=-1).tolist()
    accepted = 0
    for drafted, chosen in zip(drafts, choices, strict=False):
        # the mistake: was `if drafted != chosen: break accepted += 1`
        accepted += 1
        if drafted != chosen:
            break
    tokens = drafts[:accepted] + [choices[accepted]]
    cache.truncate(held + len(tokens))
    return tokens


def _accept_when_q_gt_p(
    p: torch.Tensor, q: torch.Tensor, drafted: int, generator: torch.Generator
) -> tuple[int, bool]:
    torch.rand((), generator=generator)  # u, drawn and never read
    # the mistake: was `if u * q[drafted] < p[drafted]:` (u < p / q, without dividing by a zero q)
    if q[drafted] > p[drafted]:
        return drafted, True
    residual = (p - q).clamp(min=0)
    token = torch.multinomial(residual / residual.sum(), 1, generator=generator)
    return int(token), False


def _no_residual(
    p: torch.Tensor, q: torch.Tensor, drafted: int, generator: torch.Generator
) -> tuple[int, bool]:
    u = torch.rand((), generator=generator)
    if u * q[drafted] < p[drafted]:  # u < p / q, without dividing by a zero q
        return drafted, True
    # the mistake: was `residual = (p - q).clamp(min=0)`
    residual = p
    token = torch.multinomial(residual / residual.sum(), 1, generator=generator)
    return int(token), False


KNOWN_WRONG = (
    KnownWrong(
        "keys_left_in",
        {"verify_greedy": _keys_left_in},
        "the rejected drafts' keys and values stay in the cache: every later query "
        "attends to tokens that are not in the text, at positions one further for each",
    ),
    KnownWrong(
        "no_bonus",
        {"verify_greedy": _no_bonus},
        "when every draft is kept, the target's logits after the last draft give one "
        "more token (the bonus): the step makes k + 1 tokens, not k",
    ),
    KnownWrong(
        "positions_not_offset",
        {"RollbackCache.prepare": _positions_not_offset},
        "the new tokens stand at positions 0..q_len - 1 as if nothing came before: "
        "after a past they continue where it ends",
    ),
    KnownWrong(
        "keeps_first_rejected",
        {"verify_greedy": _keeps_first_rejected},
        "the first rejected draft is kept: the target's own token takes its place, "
        "and nothing after it is read",
    ),
    KnownWrong(
        "accept_when_q_gt_p",
        {"accept_or_resample": _accept_when_q_gt_p},
        "a draft is kept when the drafter likes it more than the target does: it must "
        "be kept with probability min(1, p/q), so the tokens come out distributed as p",
    ),
    KnownWrong(
        "no_residual",
        {"accept_or_resample": _no_residual},
        "on a rejection the token is drawn from p itself: it must come from what p "
        "gives beyond q, max(0, p - q) normalised, or the drafts' tokens come out too often",
    ),
)
