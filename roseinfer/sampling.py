"""What one request asks for (`SamplingParams`) and how its next token is chosen.

Every generation path (the uncached oracle, the cached loop, the serving engine)
calls `sample_next_token` on the logits of the last position, with the request's own
`torch.Generator`, so under one seed a request draws the same tokens on every path
and in any batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rosetrainer.errors import RoseError

# torch.Generator.manual_seed takes any integer that fits in 64 bits.
MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """Everything that belongs to one request (the engine's own settings live apart).

    The names follow the ones people know from vLLM and the OpenAI API.
    """

    max_tokens: int = 16  # new tokens at most
    temperature: float = 0.0  # 0 means greedy: argmax, no randomness
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    seed: int | None = None  # with sampling: one seed, one output (None: a fresh one)
    stop: tuple[str, ...] = ()  # stop once the text contains one of these
    stop_token_ids: tuple[int, ...] = ()  # stop once one of these is sampled (it is kept)
    ignore_eos: bool = False  # go on past end-of-text (it is then an ordinary token)
    logprobs: int | None = None  # also report the log-probabilities of this many top tokens

    def __post_init__(self) -> None:
        # Accept a single stop string and lists, as the OpenAI API does; store tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise RoseError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not (0 <= self.temperature < math.inf):
            raise RoseError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not _is_int(self.top_k) or self.top_k < 0:
            raise RoseError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise RoseError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise RoseError(f"seed must be an integer in [0, 2**64 - 1], got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RoseError(f"stop strings must be non-empty strings, got {list(self.stop)!r}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise RoseError(
                f"stop_token_ids must be token ids >= 0, got {list(self.stop_token_ids)!r}"
            )
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise RoseError(f"logprobs must be an integer >= 0, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The request's own random stream (None when greedy: nothing is drawn)."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


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
