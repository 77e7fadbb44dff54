"""The verify step: which drafted tokens a request keeps, decided one position at a time.

The target has scored the request's last accepted token and its d drafts in one call:
`logits` row i is the target's next-token logits after draft i - 1 (row 0: after the
last accepted token). Position by position, the request's own next token is chosen
from its row and handed to the request (`take_tokens`, so the request's stop rules,
stop strings and end-of-text apply to every token, and a grammar's matcher moves on
accepted tokens only); the first disagreement ends the run.

A request with structured output: its row j is masked by its grammar as it stands
after the tokens taken at rows 0 .. j - 1 (each position masks after the previous one's
`take_tokens` advanced the matcher), so every kept token is the one its constrained
plain run would choose; a grammar completed inside the run ends the request there. The
matcher never holds a rejected draft: only taken tokens advance it. Before the target
spends a row on them, drafts are cut at the first token the grammar forbids
(`within_grammar`): such a draft could only be rejected (a sampled draft keeps that
token, for the accept rule's sake; see there).

Greedy: the token is `sample_rows` on that row (the argmax, exactly as a plain decode
step chooses it), and a draft is accepted when it is that token. After the first
rejection the target's own token stands in its place; when all d agree, row d gives a
bonus token. So every kept token is the one the uncached greedy loop would choose.

Sampled (Leviathan et al. 2023, Chen et al. 2023): with p the target's distribution
and q the draft's at a position, draft x is accepted with probability min(1, p(x) /
q(x)); on rejection the token is drawn from the residual norm(max(0, p - q)). Then
P(token = y) = q(y) min(1, p(y)/q(y)) + (1 - sum_x min(p(x), q(x))) * residual(y)
             = min(p(y), q(y)) + max(0, p(y) - q(y)) = p(y):
the target's distribution exactly, whatever the draft. A deterministic drafter (prompt
lookup, a greedy draft) has q one-hot at its token: x is kept with probability p(x),
and a rejection draws from p with x removed. Under a grammar p is the masked
distribution (a forbidden draft has p(x) = 0: always rejected), so the output is
distributed as the constrained plain run's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from roseinfer.request.sampling import apply_grammar_masks, sample_rows, sampling_probs
from roseinfer.request.sequence import Sequence
from roseinfer.request.token_step import TokenCallback, take_tokens


class Draft(NamedTuple):
    tokens: list[int]
    # (len(tokens), vocab) float32: the distribution each token was drawn from (q), for
    # the sampled rule; None when the drafter chose them deterministically (q one-hot)
    probs: torch.Tensor | None = None


NO_DRAFT = Draft([])


def accept_or_resample(
    p: torch.Tensor, q: torch.Tensor, drafted: int, generator: torch.Generator | None
) -> tuple[int, bool]:
    """The sampled rule at one position: (the token, whether it is the drafted one).

    p, q: the target's and the draft's distributions (vocab,) there.
    """
    u = torch.rand((), generator=generator, device=p.device)
    if u * q[drafted] < p[drafted]:  # u < p/q, without dividing by a zero q
        return drafted, True
    residual = (p - q).clamp(min=0)
    if float(residual.sum()) <= 0:  # p == q up to rounding: rejection had probability ~0
        residual = p
    token = torch.multinomial(residual / residual.sum(), 1, generator=generator)
    return int(token), False


def verify_drafts(
    seq: Sequence,
    logits: torch.Tensor,
    draft: Draft,
    *,
    max_len: int | None = None,
    on_token: TokenCallback | None = None,
) -> int:
    """Give `seq` the tokens its target chose over `draft`; return how many drafts it kept.

    logits: (len(draft.tokens) + 1, vocab), row i scored after draft i - 1. The request
    takes one token per position until a draft is rejected (the target's token is the
    last one taken) or the request finishes; all drafts accepted, row d's token is the
    bonus. max_len, on_token: as in `take_tokens` (on_token sees row 0 for this request).
    """
    for row, drafted in enumerate([*draft.tokens, None]):
        if seq.params.greedy:
            (token,) = sample_rows(logits[row : row + 1], [seq])
            agreed = token == drafted
        else:
            apply_grammar_masks(logits[row : row + 1], [seq])  # (in place; unconstrained: none)
            p = sampling_probs(logits[row], seq.params)
            if drafted is None:  # the bonus position: the target's own draw
                token, agreed = int(torch.multinomial(p, 1, generator=seq.generator)), False
            else:
                q = one_hot(drafted, p) if draft.probs is None else draft.probs[row]
                token, agreed = accept_or_resample(p, q, drafted, seq.generator)
        take_tokens([seq], [token], on_token=on_token, max_len=max_len)
        if not agreed or seq.is_finished:
            return row + int(agreed)
    raise AssertionError("unreachable: the bonus position never agrees")


def within_grammar(seq: Sequence, draft: Draft) -> Draft:
    """`draft` cut at its first token that seq's grammar forbids from where seq's output
    stands (or that comes after the grammar is complete); whole without a grammar.

    Verifying a forbidden token is wasted work: its row's mask sets its logit to -inf,
    so the target always rejects it, and everything drafted after it. The matcher looks
    ahead and comes back (`GrammarMatcher.allowed_prefix`): it still holds the output.

    A deterministic draft is cut before the forbidden token: the target's draw there is
    then its own, from p, which is what rejecting it would draw (the residual of a
    one-hot q at a token p gives no mass is p). A draft drawn from q keeps the forbidden
    token and drops only what follows it: that the draw landed there is part of what the
    accept rule's proof averages over, and the rule rejects it and draws from the
    residual; dropping it would draw from p instead, biased towards where q is large.
    """
    if seq.matcher is None or not draft.tokens:
        return draft
    keep = seq.matcher.allowed_prefix(draft.tokens)
    if draft.probs is not None:
        keep += 1
    if keep >= len(draft.tokens):
        return draft
    return Draft(draft.tokens[:keep], None if draft.probs is None else draft.probs[:keep])


def one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    """The distribution of a deterministic draft: all mass on its token."""
    q = torch.zeros_like(like)
    q[token] = 1.0
    return q


@dataclass
class SpeculativeStats:
    """Counted as vLLM counts them: drafts (verify steps with at least one drafted token),
    drafted tokens, accepted drafted tokens."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.num_drafts += 1
            self.num_draft_tokens += drafted
            self.num_accepted_tokens += accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafted tokens / drafted tokens (nan before any draft)."""
        return (
            self.num_accepted_tokens / self.num_draft_tokens
            if self.num_draft_tokens
            else float("nan")
        )

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step makes on average: its accepted drafts plus the target's own
        (vLLM's "mean acceptance length"; 1.0 means no draft ever helped)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else float("nan")
