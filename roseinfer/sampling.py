"""Choosing the next token from the model's logits: greedy, temperature, top-k, top-p.

Both generation paths (uncached and cached) call `sample_next_token` on the logits of
the last position, with the same `torch.Generator`, so under one seed they draw the
same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rosetrainer.errors import RoseError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy: argmax, no randomness
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise RoseError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise RoseError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise RoseError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep exactly the k largest logits per row, the rest -> -inf.

    Ties go to the lower token id, as in argmax, so top_k=1 is greedy decoding.
    """
    if k <= 0 or k >= logits.size(-1):
        return logits
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]
    above = logits > kth_largest
    # Logits equal to the k-th largest share the places left, lowest ids first.
    tied = logits == kth_largest
    places_left = k - above.sum(dim=-1, keepdim=True)
    keep = above | (tied & (tied.cumsum(dim=-1) <= places_left))
    return logits.masked_fill(~keep, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches p.

    Sorted by probability, a token is kept when the mass of the tokens *before* it is
    still below p; so the most likely token is always kept, and the token that carries
    the mass over p is kept too. Equal probabilities are ordered by token id.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def sample_next_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """(B, vocab) logits -> (B,) token ids."""
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    # Shift the maximum to 0 first: a tiny temperature then gives -inf, never inf - inf = nan.
    logits = logits.float()
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / params.temperature
    logits = top_k_filter(logits, params.top_k)
    logits = top_p_filter(logits, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
