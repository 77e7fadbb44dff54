"""Build (chapter 19): speculative decoding's verify-and-rollback step, and the sampled rule.

A drafter has guessed k tokens after a request's newest token. The target reads the
newest token and the k guesses in one call over its KV cache; the request keeps the
guesses the target agrees with and one token of the target's own; the cache forgets the
rest. rose's model is stateless: `target(ids, cache=cache)` (rosetrainer/model.py) asks
the cache `pos, mask = cache.prepare(batch, q_len, device)` before any layer runs, then
`k, v = cache.update(layer, k_new, v_new)` in each layer. Read the `KVCache` protocol
and `CausalSelfAttention.forward` there for the shapes.

The verify functions are given rose's own caches (roseinfer/cache/dense.py) as well as
your RollbackCache. When they are called, a cache holds the keys and values of every
token of the text but the newest (`cache.seq_len` of them), and keeps only the first n
with `cache.truncate(n)`; so must it when they return, the text being the request's
tokens with the ones they return.

`rose-course check verify` runs rose's GPT on your cache and compares its logits with
the uncached oracle's (a pass of k + 1 tokens after a past, and after a rollback); runs
your greedy verify step, on rose's own caches and with rose's drafters (prompt lookup,
the self-draft) and with drafts scripted to be rejected at every place, for k = 1..8,
checking the cache's length after every call and every token against the uncached
greedy run; and holds your sampled rule and sampled verify step to the target's
distribution (a chi-square test on seeded draws), on a five-token target to the exact
law of the step's outcomes (which drafts are kept, which token comes after), and to
their `generator`: the same seed twice gives the same draws, and the global RNG's state
is left as it was.
"""

from __future__ import annotations

import torch

from roseinfer.cache.dense import DenseKVCache

# The sampled rule is rose's own (roseinfer/speculative/verify.py), which the engine runs; the
# stub leaves this line out, with the body below.
from roseinfer.speculative.verify import accept_or_resample as rose_accept_or_resample
from rosetrainer.model import GPT


class RollbackCache:
    """rose's KVCache protocol for one row (batch 1), grown by concatenation, that can
    roll back: what the verify step needs of a cache."""

    def __init__(self) -> None:
        """An empty cache."""
        self.past: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer (1, heads, T, d)

    @property
    def seq_len(self) -> int:
        """How many positions the cache holds."""
        return self.past[0][0].size(2) if self.past else 0

    def prepare(
        self, batch: int, q_len: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The q_len new tokens follow the held ones. Returns their positions (1, q_len) and
        the mask (q_len, seq_len + q_len), True where new query i (a row) may attend to a
        key (a column): every held key, and the new ones up to its own."""
        past, kv_len = self.seq_len, self.seq_len + q_len
        query_pos = torch.arange(past, kv_len, device=device)
        key_pos = torch.arange(kv_len, device=device)
        return query_pos[None, :], key_pos[None, :] <= query_pos[:, None]

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep layer `layer`'s new keys and values (1, heads, q_len, d) after the held ones;
        return all of that layer's keys and values, held then new, along time."""
        if layer == len(self.past):  # the first call: this layer holds nothing yet
            self.past.append((k, v))
        else:
            past_k, past_v = self.past[layer]
            self.past[layer] = (torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2))
        return self.past[layer]

    def truncate(self, n: int) -> None:
        """Keep the first n positions (0 <= n <= seq_len) of every layer, forget the rest."""
        self.past = [(k[:, :, :n], v[:, :, :n]) for k, v in self.past]


def score(
    target: GPT, cache: DenseKVCache | RollbackCache, last_token: int, drafts: list[int]
) -> torch.Tensor:
    """The target's next-token logits (len(drafts) + 1, vocab) after each of last_token and
    the drafts, from one call of `target` over `cache`; row i is the target's logits
    after draft i - 1 (row 0: after last_token)."""
    ids = torch.tensor([[last_token, *drafts]], device=target.lm_head.weight.device)
    return target(ids, cache=cache).logits[0].float()


@torch.no_grad()
def verify_greedy(
    target: GPT, cache: DenseKVCache | RollbackCache, last_token: int, drafts: list[int]
) -> list[int]:
    """One greedy verify step: the tokens the request takes, in order. Those are the
    drafts the target agrees with (each the argmax of the target's logits at its place),
    up to the first it does not, then one token of the target's own: in place of the
    first rejected draft, or after the last draft when every draft is kept. Between 1
    and len(drafts) + 1 tokens, each the one the uncached greedy loop would choose.
    `cache` holds every token before last_token; on return it holds last_token and every
    kept draft, nothing of a rejected one."""
    held = cache.seq_len
    choices = score(target, cache, last_token, drafts).argmax(dim=-1).tolist()
    accepted = 0
    for drafted, chosen in zip(drafts, choices, strict=False):
        if drafted != chosen:
            break
        accepted += 1
    tokens = drafts[:accepted] + [choices[accepted]]
    cache.truncate(held + len(tokens))
    return tokens


def accept_or_resample(
    p: torch.Tensor, q: torch.Tensor, drafted: int, generator: torch.Generator
) -> tuple[int, bool]:
    """The sampled rule at one position: (the token the request takes, whether it is the
    drafted one). p, q: the target's and the drafter's distributions (vocab,) there;
    `drafted` was drawn from q. Whatever q is, the token must be distributed as p, and
    the draft kept as often as that allows. Every random draw comes from `generator`."""
    return rose_accept_or_resample(p, q, drafted, generator)


@torch.no_grad()
def verify_sampled(
    target: GPT,
    cache: DenseKVCache | RollbackCache,
    last_token: int,
    drafts: list[int],
    draft_probs: torch.Tensor,
    generator: torch.Generator,
) -> list[int]:
    """One sampled verify step (temperature 1: p is the softmax of the target's logits).
    draft_probs (len(drafts), vocab): the distribution q each draft was drawn from. Each
    draft in turn goes through `accept_or_resample`; the first one not kept ends the step
    with the token drawn in its place; when every draft is kept, one more token is drawn
    from the target's distribution after the last draft. Returns the tokens the request
    takes; `cache` as in `verify_greedy`."""
    held = cache.seq_len
    p = torch.softmax(score(target, cache, last_token, drafts), dim=-1)
    tokens = []
    for i, drafted in enumerate(drafts):
        token, kept = accept_or_resample(p[i], draft_probs[i].float(), drafted, generator)
        tokens.append(token)
        if not kept:
            break
    else:  # every draft kept: the bonus token
        tokens.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator)))
    cache.truncate(held + len(tokens))
    return tokens


# `rose-course hint verify` gives these one at a time, the idea first and the near-code
# last (`rose-course check verify` counts how many were used); the stub leaves them out.
HINTS = (
    "One target call scores every draft: feed [last_token, *drafts] over the cache, and "
    "row i of the logits is the target's view after draft i - 1. The verify functions "
    "then only read those rows, and cut the cache back to what the request keeps.",
    "RollbackCache: hold per layer the keys and values concatenated along time (dim 2); "
    "truncate(n) slices every layer to [:, :, :n]. The new queries stand at seq_len .. "
    "seq_len + q_len - 1 and see every key at or before their own position.",
    "verify_greedy: take the argmax of every row; the drafts are kept while each equals "
    "the argmax at its place; the token after them is the argmax at the first mismatch "
    "(or at the last row when all matched). The cache held `held` positions before the "
    "call: keep held + len(tokens) (the newest token and the kept drafts).",
    "accept_or_resample: keep the draft with probability min(1, p[d] / q[d]): one uniform "
    "u from the generator, kept when u * q[d] < p[d] (no division by a zero q). When "
    "rejected, draw from the residual max(0, p - q), normalised; and where that is empty "
    "(p equal to q up to rounding) from p itself.",
    "verify_sampled: p is the softmax of the target's logits (float32); each draft in "
    "turn goes through accept_or_resample with its own q = draft_probs[i]; a rejection "
    "ends the step with the drawn token; when every draft is kept, one more token comes "
    "from p's last row (the bonus). Every draw from `generator`, none from torch's global "
    "one.",
    "accept_or_resample, near-code:\n"
    "    u = torch.rand((), generator=generator)\n"
    "    if u * q[drafted] < p[drafted]: return drafted, True\n"
    "    residual = (p - q).clamp(min=0)  # p itself if it sums to 0\n"
    "    return int(torch.multinomial(residual / residual.sum(), 1, generator=generator)), False",
)
