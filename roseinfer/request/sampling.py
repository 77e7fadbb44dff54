"""How a request's next token is chosen (what it asks for: `SamplingParams`).

Every generation path (the uncached oracle, the cached loop, the serving engine)
calls `sample_next_token` on the logits of the last position, with the request's own
`torch.Generator`, so under one seed a request draws the same tokens on every path
and in any batch; `sample_rows` does that for each row of a batch, after
`apply_grammar_masks` has taken from each constrained request's row the tokens its
grammar forbids (roseinfer/request/structured.py).
"""

from __future__ import annotations

import numpy as np
import torch

from roseinfer.request.sampling_params import SamplingParams
from roseinfer.request.sequence import Sequence
from roseinfer.request.structured import allowed_tokens
from rosetrainer.errors import RoseError


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


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., vocab) logits -> the float32 distribution a sampled request draws from:
    temperature, then top-k, then top-p (speculative decoding's accept rule reads it)."""
    # Shift the maximum to 0 first: a tiny temperature then gives -inf, never inf - inf = nan.
    logits = logits.float()
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / params.temperature
    logits = top_k_filter(logits, params.top_k)
    logits = top_p_filter(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """(..., vocab) logits -> the id of each row's largest (the lowest id on a tie).

    In float32: every bfloat16 or float16 value is one exactly, so the answer is the
    same, and a CPU's argmax over bfloat16 is not vectorized, so converting first is
    faster. By `max`'s indices, not `argmax`: the same ids (both give a row's first
    largest, a NaN counting as largest) in a quarter of the time on a CPU for a batch of
    rows, where this was a fifth of a small model's engine step (docs/benchmarks.md,
    "Figures behind the code")."""
    return logits.float().max(dim=-1).indices


def sample_next_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """(B, vocab) logits -> (B,) token ids."""
    if params.greedy:
        return greedy_ids(logits)
    probs = sampling_probs(logits, params)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def apply_grammar_masks(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Set to -inf, in place, every logit a row's grammar forbids next (rows of requests
    without structured output, and finished ones, are left alone).

    The masks of the batch's constrained rows are filled into one array, then written
    into the logits; masked logits are what the row then samples from, greedy or not (and what its
    logprobs report: the distribution it was drawn from). A JSON output near max_tokens
    is closed in time: its mask then allows only the closing tokens.
    """
    rows = [i for i, seq in enumerate(seqs) if seq.matcher is not None and not seq.is_finished]
    if not rows:
        return
    tokens_left = [seqs[i].params.max_tokens - len(seqs[i].output_ids) for i in rows]
    allowed = allowed_tokens([seqs[i].matcher for i in rows], logits.size(-1), tokens_left)
    if not allowed.any(axis=1).all():
        raise RoseError("the grammar allows no token this model's vocabulary has")
    forbidden = ~allowed
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        # On the CPU, numpy writes the -inf through a view of the logits several times
        # faster than masked_fill_ does (the mask's cost is mostly this write).
        values = logits.detach().numpy()
        for k, row in enumerate(rows):
            np.copyto(values[row], -np.inf, where=forbidden[k])
        return
    forbidden = torch.from_numpy(forbidden).to(logits.device)
    # (inference mode: the model's logits are inference tensors, written in place only there)
    with torch.inference_mode():
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(forbidden, float("-inf"))


def sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row of (B, vocab) logits, each drawn with its own request's
    parameters and random stream (so a row samples as its prompt would alone), among
    the tokens its grammar allows when it has one (the logits are masked in place)."""
    apply_grammar_masks(logits, seqs)
    if all(seq.params.greedy for seq in seqs):
        return greedy_ids(logits).tolist()
    return [
        int(sample_next_token(logits[i : i + 1], seq.params, seq.generator))
        for i, seq in enumerate(seqs)
    ]
