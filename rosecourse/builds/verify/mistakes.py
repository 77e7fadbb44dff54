"""The verify build's known answers, as data (rosecourse/exercises/answers.py says what
each kind is; tests/course/test_builds.py runs them against this build's check).

Each is the reference solution (reference.py, beside this file) with one class, function or
method replaced by the code below, as a learner writes it into build_verify.py: it runs as
if written there (grading.replaced rebinds a function to the module's globals, so the names
it reads are the module's; those imported below from the reference are for the reader and
the linter). First the known mistakes (`KNOWN_WRONG`: what `rose-course check verify` names
when a learner's module probes like one); then the other wrong answers (`build_mutant`) and
the right ones written another way (`build_alternative`); last the wrong answers written
blind (`blind_build`). Where a piece was written as an edit of the reference's text, `# the
mistake` marks the line.
"""

from __future__ import annotations

import torch

from rosecourse.builds.grading import KnownWrong
from rosecourse.builds.verify.reference import RollbackCache, accept_or_resample, score
from rosecourse.exercises.answers import blind_build, build_alternative, build_mutant
from roseinfer.cache.dense import DenseKVCache
from rosetrainer.model import GPT

# == The known mistakes: the check names each one it meets (KNOWN_WRONG) ======================


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


# == Other wrong answers (build_mutant), and right ones (build_alternative) ==================
# tests/course/test_builds.py asserts that each wrong one fails a part of the check without
# being taken for a known mistake, and that each right one passes every part.

# -- written as code -----------------------------------------------------------------------

# These run with the learner module's globals: score, accept_or_resample.


@build_mutant("verify", "accept_or_resample")
def rule_draws_from_the_global_rng(p, q, drafted, generator):
    if torch.rand(()) * q[drafted] < p[drafted]:  # no generator: the global RNG
        return drafted, True
    residual = (p - q).clamp(min=0)
    return int(torch.multinomial(residual, 1)), False


def _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus):
    """The reference's verify_sampled with the rule at each place replaced by
    judge(p_i, q_i, drafted, i) -> (token, kept) and the bonus by bonus(p, q) -> token."""
    with torch.no_grad():
        held = cache.seq_len
        p = torch.softmax(score(target, cache, last_token, drafts), dim=-1)  # noqa: F821
        tokens = []
        for i, drafted in enumerate(drafts):
            token, kept = judge(p[i], draft_probs[i].float(), drafted, i)
            tokens.append(token)
            if not kept:
                break
        else:
            tokens.append(bonus(p[len(drafts)], draft_probs[-1] if drafts else None))
        cache.truncate(held + len(tokens))
    return tokens


@build_mutant("verify", "verify_sampled")
def bonus_from_the_global_rng(target, cache, last_token, drafts, draft_probs, generator):
    def judge(p, q, drafted, i):
        return accept_or_resample(p, q, drafted, generator)  # noqa: F821

    def bonus(p, q):
        return int(torch.multinomial(p, 1))  # no generator: the global RNG

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_mutant("verify", "verify_sampled")
def one_uniform_for_the_step(target, cache, last_token, drafts, draft_probs, generator):
    u = torch.rand((), generator=generator)  # drawn once, read at every place

    def judge(p, q, drafted, i):
        if u * q[drafted] < p[drafted]:
            return drafted, True
        residual = (p - q).clamp(min=0)
        return int(torch.multinomial(residual, 1, generator=generator)), False

    def bonus(p, q):
        return int(torch.multinomial(p, 1, generator=generator))

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_mutant("verify", "verify_sampled")
def residual_drawn_from_p(target, cache, last_token, drafts, draft_probs, generator):
    # The rule written inline, a rejection drawing its token from p itself.
    def judge(p, q, drafted, i):
        if torch.rand((), generator=generator) * q[drafted] < p[drafted]:
            return drafted, True
        return int(torch.multinomial(p, 1, generator=generator)), False

    def bonus(p, q):
        return int(torch.multinomial(p, 1, generator=generator))

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_mutant("verify", "verify_sampled")
def sampled_step_judged_greedily(target, cache, last_token, drafts, draft_probs, generator):
    # A draft kept when it is p's argmax, the argmax taken in place of one that is not;
    # only the bonus sampled.
    def judge(p, q, drafted, i):
        best = int(p.argmax())
        return best, best == drafted

    def bonus(p, q):
        return int(torch.multinomial(p, 1, generator=generator))

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_mutant("verify", "verify_sampled")
def bonus_from_the_draft_distribution(target, cache, last_token, drafts, draft_probs, generator):
    def judge(p, q, drafted, i):
        return accept_or_resample(p, q, drafted, generator)  # noqa: F821

    def bonus(p, q):  # q: the last draft's distribution, not the target's after it
        return int(torch.multinomial(p if q is None else q.float(), 1, generator=generator))

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_mutant("verify", "verify_sampled")
def global_rng_seeded_from_the_generator(target, cache, last_token, drafts, draft_probs, generator):
    # Reproducible under one seed, but it draws from (and reseeds) the global RNG.
    torch.manual_seed(int(torch.randint(2**31, (), generator=generator)))

    def judge(p, q, drafted, i):
        if torch.rand(()) * q[drafted] < p[drafted]:
            return drafted, True
        residual = (p - q).clamp(min=0)
        return int(torch.multinomial(residual, 1)), False

    def bonus(p, q):
        return int(torch.multinomial(p, 1))

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_mutant("verify", "verify_sampled")
def rejected_place_keeps_its_draft_distribution(
    target, cache, last_token, drafts, draft_probs, generator
):
    # On a rejection, the token is drawn from max(0, q - p): what the drafter over-offers.
    def judge(p, q, drafted, i):
        if torch.rand((), generator=generator) * q[drafted] < p[drafted]:
            return drafted, True
        residual = (q - p).clamp(min=0)
        return int(torch.multinomial(residual, 1, generator=generator)), False

    def bonus(p, q):
        return int(torch.multinomial(p, 1, generator=generator))

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_alternative("verify", "verify_sampled")
def every_uniform_drawn_at_once(target, cache, last_token, drafts, draft_probs, generator):
    # One uniform per draft, all drawn together before any is read: right.
    uniforms = torch.rand(len(drafts), generator=generator)

    def judge(p, q, drafted, i):
        if uniforms[i] * q[drafted] < p[drafted]:
            return drafted, True
        residual = (p - q).clamp(min=0)
        return int(torch.multinomial(residual, 1, generator=generator)), False

    def bonus(p, q):
        return int(torch.multinomial(p, 1, generator=generator))

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_alternative("verify", "accept_or_resample")
def uniform_drawn_only_when_needed(p, q, drafted, generator):
    # p >= q keeps the draft for sure: no draw then; the residual by inverse CDF.
    ratio = float(p[drafted]) / float(q[drafted]) if float(q[drafted]) > 0 else 1.0
    if ratio >= 1 or float(torch.rand(1, generator=generator, dtype=torch.float64)) < ratio:
        return drafted, True
    cdf = (p - q).clamp(min=0).double().cumsum(0)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp(max=len(p) - 1)), False


# -- first written as edits of the reference's text: `# the mistake` marks the line ----------
# A mutant that replaces two pieces is registered twice under one name.


@build_mutant("verify", "RollbackCache.prepare")
def top_left_mask(
    self, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    past, kv_len = self.seq_len, self.seq_len + q_len
    query_pos = torch.arange(past, kv_len, device=device)
    key_pos = torch.arange(kv_len, device=device)
    # the mistake: was `return query_pos[None, :], key_pos[None, :] <= query_pos[:, None]`
    return query_pos[None, :], key_pos[None, :] <= query_pos[:, None] - past


@build_mutant("verify", "RollbackCache.prepare", name="positions_one_late")
def rollback_positions_one_late(
    self, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    past, kv_len = self.seq_len, self.seq_len + q_len
    # the mistake: was `query_pos = torch.arange(past, kv_len, device=device)`
    query_pos = torch.arange(past + 1, kv_len + 1, device=device)
    key_pos = torch.arange(kv_len, device=device)
    return query_pos[None, :], key_pos[None, :] <= query_pos[:, None]


@build_mutant("verify", "RollbackCache.truncate")
def truncate_keeps_one_more(self, n: int) -> None:
    # the mistake: was `self.past = [(k[:, :, :n], v[:, :, :n]) for k, v in self.past]`
    self.past = [(k[:, :, : n + 1], v[:, :, : n + 1]) for k, v in self.past]


@build_mutant("verify", "verify_greedy")
@torch.no_grad()
def rollback_one_too_far(
    target: GPT, cache: DenseKVCache | RollbackCache, last_token: int, drafts: list[int]
) -> list[int]:
    held = cache.seq_len
    choices = score(target, cache, last_token, drafts).argmax(dim=-1).tolist()
    accepted = 0
    for drafted, chosen in zip(drafts, choices, strict=False):
        if drafted != chosen:
            break
        accepted += 1
    tokens = drafts[:accepted] + [choices[accepted]]
    # the mistake: was `cache.truncate(held + len(tokens)) return tokens`
    cache.truncate(held + len(tokens) - 1)
    return tokens


@build_mutant("verify", "verify_greedy")
@torch.no_grad()
def drafts_read_against_the_next_row(
    target: GPT, cache: DenseKVCache | RollbackCache, last_token: int, drafts: list[int]
) -> list[int]:
    held = cache.seq_len
    choices = score(target, cache, last_token, drafts).argmax(dim=-1).tolist()
    accepted = 0
    # the mistake: was `for drafted, chosen in zip(drafts, choices, strict=False):`
    for drafted, chosen in zip(drafts, choices[1:], strict=False):
        if drafted != chosen:
            break
        accepted += 1
    tokens = drafts[:accepted] + [choices[accepted]]
    cache.truncate(held + len(tokens))
    return tokens


@build_mutant("verify", "verify_greedy")
@torch.no_grad()
def scored_one_token_a_call(
    target: GPT, cache: DenseKVCache | RollbackCache, last_token: int, drafts: list[int]
) -> list[int]:
    held = cache.seq_len
    # the mistake: was `choices = score(target, cache, last_token, drafts).argmax(dim=-1).tolist()`
    choices = [int(score(target, cache, t, []).argmax()) for t in [last_token, *drafts]]
    accepted = 0
    for drafted, chosen in zip(drafts, choices, strict=False):
        if drafted != chosen:
            break
        accepted += 1
    tokens = drafts[:accepted] + [choices[accepted]]
    cache.truncate(held + len(tokens))
    return tokens


@build_mutant("verify", "accept_or_resample")
def ratio_inverted(
    p: torch.Tensor, q: torch.Tensor, drafted: int, generator: torch.Generator
) -> tuple[int, bool]:
    u = torch.rand((), generator=generator)
    # the mistake: was `if u * q[drafted] < p[drafted]: # u < p / q, without dividing by a zero q`
    if u * p[drafted] < q[drafted]:  # u < p / q, without dividing by a zero q
        return drafted, True
    residual = (p - q).clamp(min=0)
    token = torch.multinomial(residual / residual.sum(), 1, generator=generator)
    return int(token), False


@build_mutant("verify", "accept_or_resample")
def residual_reversed(
    p: torch.Tensor, q: torch.Tensor, drafted: int, generator: torch.Generator
) -> tuple[int, bool]:
    u = torch.rand((), generator=generator)
    if u * q[drafted] < p[drafted]:  # u < p / q, without dividing by a zero q
        return drafted, True
    # the mistake: was `residual = (p - q).clamp(min=0)`
    residual = (q - p).clamp(min=0)
    token = torch.multinomial(residual / residual.sum(), 1, generator=generator)
    return int(token), False


@build_mutant("verify", "verify_sampled")
@torch.no_grad()
def bonus_from_the_last_draft_row(
    target: GPT,
    cache: DenseKVCache | RollbackCache,
    last_token: int,
    drafts: list[int],
    draft_probs: torch.Tensor,
    generator: torch.Generator,
) -> list[int]:
    held = cache.seq_len
    p = torch.softmax(score(target, cache, last_token, drafts), dim=-1)
    tokens = []
    for i, drafted in enumerate(drafts):
        token, kept = accept_or_resample(p[i], draft_probs[i].float(), drafted, generator)
        tokens.append(token)
        if not kept:
            break
    else:  # every draft kept: the bonus token
        # the mistake: was `tokens.append(int(torch.multinomial(p[len(drafts)], 1,
        # generator=generator)))`
        tokens.append(int(torch.multinomial(p[len(drafts) - 1], 1, generator=generator)))
    cache.truncate(held + len(tokens))
    return tokens


@build_mutant("verify", "verify_sampled")
@torch.no_grad()
def sampled_step_never_rolls_back(
    target: GPT,
    cache: DenseKVCache | RollbackCache,
    last_token: int,
    drafts: list[int],
    draft_probs: torch.Tensor,
    generator: torch.Generator,
) -> list[int]:
    p = torch.softmax(score(target, cache, last_token, drafts), dim=-1)
    tokens = []
    for i, drafted in enumerate(drafts):
        token, kept = accept_or_resample(p[i], draft_probs[i].float(), drafted, generator)
        tokens.append(token)
        if not kept:
            break
    else:  # every draft kept: the bonus token
        tokens.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator)))
    # the mistake: `cache.truncate(held + len(tokens))` left out (held: the cache's seq_len
    # before the pass), so the rejected drafts' keys stay
    return tokens


@build_mutant("verify", "verify_sampled")
@torch.no_grad()
def sampled_rows_shifted(
    target: GPT,
    cache: DenseKVCache | RollbackCache,
    last_token: int,
    drafts: list[int],
    draft_probs: torch.Tensor,
    generator: torch.Generator,
) -> list[int]:
    held = cache.seq_len
    p = torch.softmax(score(target, cache, last_token, drafts), dim=-1)
    tokens = []
    for i, drafted in enumerate(drafts):
        # the mistake: was `token, kept = accept_or_resample(p[i], draft_probs[i].float(), drafted,
        # generator)`
        token, kept = accept_or_resample(p[i + 1], draft_probs[i].float(), drafted, generator)
        tokens.append(token)
        if not kept:
            break
    else:  # every draft kept: the bonus token
        tokens.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator)))
    cache.truncate(held + len(tokens))
    return tokens


# == Written blind (blind_build; rosecourse/exercises/answers.py says how) ===================
# Each one's writer said in one line what is wrong: the `# WRONG:` comment above it.

# These run with the learner module's globals: score, accept_or_resample.


# WRONG: RollbackCache mask aligned top-left: new query i sees keys 0..i only
@blind_build("verify", "RollbackCache.prepare", name="mask_top_left")
def _rollback_mask_top_left(self, batch, q_len, device):
    past, kv_len = self.seq_len, self.seq_len + q_len
    query_pos = torch.arange(past, kv_len, device=device)
    key_pos = torch.arange(kv_len, device=device)
    # the mistake: was `key_pos[None, :] <= query_pos[:, None]`
    return query_pos[None, :], key_pos[None, :] <= torch.arange(q_len, device=device)[:, None]


# WRONG: truncate moves the length counter back but leaves the layers' tensors long
@blind_build("verify", "RollbackCache", name="truncate_counter_only")
class TruncateCounterOnly:
    """The writer's cache, which counts its length itself."""

    def __init__(self) -> None:
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._len = 0

    @property
    def seq_len(self) -> int:
        return self._len

    def prepare(self, batch, q_len, device):
        past, kv = self._len, self._len + q_len
        qpos = torch.arange(past, kv, device=device)
        self._len = kv
        return qpos[None, :], torch.arange(kv, device=device)[None, :] <= qpos[:, None]

    def update(self, layer, k, v):
        if layer < len(self.layers):
            pk, pv = self.layers[layer]
            self.layers[layer] = (torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2))
        else:
            self.layers.append((k, v))
        return self.layers[layer]

    def truncate(self, n: int) -> None:
        # the mistake: `self.layers = [(k[:, :, :n], v[:, :, :n]) for k, v in self.layers]`
        # left out
        self._len = n


def _blind_greedy(target, cache, last_token, drafts, kept_on_rejection=1, bonus=True):
    """The writer's greedy verify: on a rejection at draft i the cache keeps held +
    `kept_on_rejection` + i positions; `bonus` False: all drafts kept, no token after them."""
    held = cache.seq_len
    choices = score(target, cache, last_token, drafts).argmax(dim=-1).tolist()
    for i, drafted in enumerate(drafts):
        if drafted != choices[i]:
            cache.truncate(held + kept_on_rejection + i)
            return [*drafts[:i], choices[i]]
    cache.truncate(held + 1 + len(drafts))
    return [*drafts, choices[len(drafts)]] if bonus else list(drafts)


# WRONG: greedy verify returns only the drafts when all are kept (no bonus token)
@blind_build("verify", "verify_greedy")
@torch.no_grad()
def greedy_no_bonus(target, cache, last_token, drafts):
    return _blind_greedy(target, cache, last_token, drafts, bonus=False)


# WRONG: greedy rollback keeps held + i on a rejection: last_token's key is dropped too
@blind_build("verify", "verify_greedy")
@torch.no_grad()
def greedy_truncate_forgets_last(target, cache, last_token, drafts):
    # the mistake: was `held + 1 + i` on a rejection
    return _blind_greedy(target, cache, last_token, drafts, kept_on_rejection=0)


def _blind_rule(p, q, drafted, generator, uniform=None, kept=None, residual_of=None):
    """The reference's accept_or_resample: the draft kept when `kept(u, p, q)` (u < p / q by
    default, u drawn by `uniform()`, from `generator` by default), else a token drawn from
    `residual_of(p, q)` (max(0, p - q) by default)."""
    u = torch.rand((), generator=generator) if uniform is None else uniform()
    if (kept or (lambda u, p, q: u * q[drafted] < p[drafted]))(u, p, q):
        return drafted, True
    residual = (p - q).clamp(min=0) if residual_of is None else residual_of(p, q)
    if float(residual.sum()) <= 0:
        residual = p
    token = torch.multinomial(residual / residual.sum(), 1, generator=generator)
    return int(token), False


# WRONG: draft kept exactly when p(x) >= q(x) (no uniform draw), else resampled
@blind_build("verify", "accept_or_resample")
def deterministic_accept(p, q, drafted, generator):
    # the mistake: was `u * q[drafted] < p[drafted]`, u drawn from generator
    return _blind_rule(p, q, drafted, generator, kept=lambda u, p, q: p[drafted] >= q[drafted])


# WRONG: the acceptance uniform comes from the global RNG (torch.rand without the generator)
@blind_build("verify", "accept_or_resample")
def global_rng_u(p, q, drafted, generator):
    # the mistake: was `torch.rand((), generator=generator)`
    return _blind_rule(p, q, drafted, generator, uniform=lambda: torch.rand(()))


# WRONG: on rejection the token is drawn from p, not from the residual max(0, p - q)
@blind_build("verify", "accept_or_resample", known="no_residual")
def resample_from_p(p, q, drafted, generator):
    # the mistake: was `(p - q).clamp(min=0)`
    return _blind_rule(p, q, drafted, generator, residual_of=lambda p, q: p)


def _blind_sampled(
    target,
    cache,
    last_token,
    drafts,
    draft_probs,
    generator,
    row_shift=0,
    bonus_row=0,
    greedy_bonus=False,
    rollback=True,
):
    """The reference's sampled verify: draft i against the target's row i + `row_shift`,
    the bonus from row len(drafts) + `bonus_row` (its argmax if `greedy_bonus`), the cache
    rolled back after a rejection if `rollback`."""
    held = cache.seq_len
    p = torch.softmax(score(target, cache, last_token, drafts), dim=-1)
    tokens = []
    for i, drafted in enumerate(drafts):
        row = p[i + row_shift]
        token, kept = accept_or_resample(row, draft_probs[i].float(), drafted, generator)
        tokens.append(token)
        if not kept:
            if rollback:
                cache.truncate(held + len(tokens))
            return tokens
    last = p[len(drafts) + bonus_row]
    bonus = last.argmax() if greedy_bonus else torch.multinomial(last, 1, generator=generator)
    tokens.append(int(bonus))
    cache.truncate(held + len(tokens))
    return tokens


# WRONG: sampled verify takes the bonus token greedily (argmax), not drawn from p
@blind_build("verify", "verify_sampled")
@torch.no_grad()
def bonus_argmax(target, cache, last_token, drafts, draft_probs, generator):
    # the mistake: was `torch.multinomial(p[len(drafts)], 1, generator=generator)`
    return _blind_sampled(
        target, cache, last_token, drafts, draft_probs, generator, greedy_bonus=True
    )


# WRONG: sampled bonus drawn from the last draft's row (probs[k-1]), off by one
@blind_build("verify", "verify_sampled")
@torch.no_grad()
def bonus_wrong_row(target, cache, last_token, drafts, draft_probs, generator):
    # the mistake: was `p[len(drafts)]`
    return _blind_sampled(target, cache, last_token, drafts, draft_probs, generator, bonus_row=-1)


# WRONG: sampled verify never truncates the cache after a rejection
@blind_build("verify", "verify_sampled")
@torch.no_grad()
def sampled_no_rollback(target, cache, last_token, drafts, draft_probs, generator):
    # the mistake: `cache.truncate(held + len(tokens))` left out on a rejection
    return _blind_sampled(target, cache, last_token, drafts, draft_probs, generator, rollback=False)


# WRONG: sampled verify compares draft i with the target's row i + 1 (the row after it)
@blind_build("verify", "verify_sampled")
@torch.no_grad()
def sampled_q_from_p_row_shift(target, cache, last_token, drafts, draft_probs, generator):
    # the mistake: was `p[i]`
    return _blind_sampled(target, cache, last_token, drafts, draft_probs, generator, row_shift=1)


# == A whole module written another way (build_alternative's, not one piece: all) ==========
# Every class and function written afresh, as another learner would write the file;
# tests/course/test_builds.py asserts that it passes every part.

ALTERNATIVE_MODULE = """
import torch


class RollbackCache:
    def __init__(self):
        self.keys, self.values, self.length = {}, {}, 0

    @property
    def seq_len(self):
        return self.length

    def prepare(self, batch, q_len, device):
        start = self.length
        self.length += q_len
        mask = torch.ones(q_len, self.length, dtype=torch.bool, device=device).tril(start)
        return (start + torch.arange(q_len, device=device)).unsqueeze(0), mask

    def update(self, layer, k, v):
        if layer in self.keys:
            k = torch.cat((self.keys[layer], k), 2)
            v = torch.cat((self.values[layer], v), 2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def truncate(self, n):
        self.length = n
        for layer in self.keys:
            self.keys[layer] = self.keys[layer][..., :n, :]
            self.values[layer] = self.values[layer][..., :n, :]


def score(target, cache, last_token, drafts):
    ids = torch.tensor([last_token] + drafts).unsqueeze(0)
    with torch.inference_mode():
        return target(ids, cache=cache).logits.squeeze(0).float()


def verify_greedy(target, cache, last_token, drafts):
    start = cache.seq_len
    best = score(target, cache, last_token, drafts).argmax(-1)
    agree = (torch.tensor(drafts, dtype=torch.long) == best[:-1]).long().cumprod(0)
    n = int(agree.sum())
    out = best[: n + 1].tolist()
    cache.truncate(start + n + 1)
    return out


def accept_or_resample(p, q, drafted, generator):
    if float(torch.rand(1, generator=generator)) < min(1.0, float(p[drafted] / q[drafted])):
        return drafted, True
    left = torch.maximum(p - q, torch.zeros_like(p)).double().cumsum(0)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * left[-1]
    return int(torch.searchsorted(left, u, right=True).clamp(max=len(p) - 1)), False


def verify_sampled(target, cache, last_token, drafts, draft_probs, generator):
    start = cache.seq_len
    probs = score(target, cache, last_token, drafts).softmax(-1)
    out = []
    for i in range(len(drafts) + 1):
        if i == len(drafts):
            out.append(int(probs[i].multinomial(1, generator=generator)))
            break
        token, kept = accept_or_resample(probs[i], draft_probs[i], drafts[i], generator)
        out.append(token)
        if not kept:
            break
    cache.truncate(start + len(out))
    return out
"""
