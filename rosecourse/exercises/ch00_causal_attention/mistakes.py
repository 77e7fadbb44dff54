"""Chapter 00's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

import math

import torch

from rosecourse.exercises.answers import alternative, blind, breaks, known, mutant

# -- the known mistakes: the check names each one it meets (answers.known) ----------


def _scaled_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    return (q @ k.transpose(-2, -1)) * scale


@known(
    "00",
    "no causal mask: every position reads the tokens after it, so training would "
    "learn to copy the answer; the last position cannot tell, but from layer 2 on "
    "every earlier position it reads has seen the future",
)
def _future_visible(q, k, v):
    return torch.softmax(_scaled_scores(q, k, q.size(-1) ** -0.5), dim=-1) @ v


@known(
    "00",
    "the scores are not divided by sqrt(head_dim): the softmax is sharper than the "
    "model was built for",
)
def _unscaled(q, k, v):
    t = q.size(-2)
    scores = _scaled_scores(q, k, 1.0).masked_fill(
        ~torch.ones(t, t, dtype=torch.bool).tril(), -torch.inf
    )
    return torch.softmax(scores, dim=-1) @ v


@known(
    "00",
    "the softmax runs over the queries (dim -2): each query's weights over its keys "
    "must sum to 1, so normalise along the keys (dim -1)",
)
def _softmax_over_queries(q, k, v):
    t = q.size(-2)
    scores = _scaled_scores(q, k, q.size(-1) ** -0.5)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -torch.inf)
    return torch.softmax(scores, dim=-2).nan_to_num() @ v


@known(
    "00",
    "your mask is the upper triangle: each position reads itself and the future, never the past",
)
def _mask_upper(q, k, v):
    t = q.size(-2)
    scores = _scaled_scores(q, k, q.size(-1) ** -0.5)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).triu(), -torch.inf)
    return torch.softmax(scores, dim=-1) @ v


# -- 00: causal_attention(q, k, v) --------------------------------------------------------


def _attend(q, k, v, scale: float, allowed: torch.Tensor, fill: float = -math.inf):
    scores = (q @ k.transpose(-2, -1)) * scale
    return torch.softmax(scores.masked_fill(~allowed, fill), dim=-1) @ v


def _lower(t: int, diagonal: int = 0) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool).tril(diagonal)


@mutant("00")
def scaled_by_head_dim(q, k, v):
    return _attend(q, k, v, 1 / q.size(-1), _lower(q.size(-2)))


@mutant("00")
def scale_of_the_probe_head_dim(q, k, v):
    return _attend(q, k, v, 1 / math.sqrt(8), _lower(q.size(-2)))


@mutant("00")
def own_key_hidden(q, k, v):
    return _attend(q, k, v, q.size(-1) ** -0.5, _lower(q.size(-2), -1)).nan_to_num()


@mutant("00")
def masked_with_zero(q, k, v):
    return _attend(q, k, v, q.size(-1) ** -0.5, _lower(q.size(-2)), fill=0.0)


@mutant("00")
def first_row_attends_for_all(q, k, v):
    y = _attend(q[:1], k[:1], v[:1], q.size(-1) ** -0.5, _lower(q.size(-2)))
    return y.expand_as(q)


@mutant("00")
def keys_query_the_queries(q, k, v):
    scores = (k @ q.transpose(-2, -1)) * q.size(-1) ** -0.5
    return torch.softmax(scores.masked_fill(~_lower(q.size(-2)), -math.inf), dim=-1) @ v


@alternative("00")
def attention_with_a_float_mask(q, k, v):
    t = q.size(-2)
    bias = torch.full((t, t), -math.inf, dtype=q.dtype, device=q.device).triu(1)
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + bias, dim=-1) @ v


# -- Written blind (issue 45) --


def _blind_00(q, k, v, scale: float, softmax_dim: int = -1):
    T = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) / scale
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=softmax_dim) @ v


# WRONG: scores not scaled at all
@blind("00", known="unscaled")
def no_scaling(q, k, v):
    return _blind_00(q, k, v, 1.0)


# WRONG: scores divided by head_dim, not its square root
@blind("00")
def scale_by_head_dim(q, k, v):
    return _blind_00(q, k, v, q.size(-1))


# WRONG: softmax taken over the query axis (dim=-2)
@blind("00", known="softmax_over_queries")
def softmax_over_queries(q, k, v):
    return _blind_00(q, k, v, math.sqrt(q.size(-1)), softmax_dim=-2)


# -- By class (issue 54): each breaks a clause its values do not show --


def _scores(q, k):
    t = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
    future = ~torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(future, -math.inf)


@breaks("00", "on another device (meta)")
def mask_made_on_the_cpu(q, k, v):
    t = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)
    return torch.softmax(scores, dim=-1) @ v


@breaks("00", "in bfloat16 your function returns torch.float32")
def softmax_in_float32_times_the_values(q, k, v):
    return torch.softmax(_scores(q.float(), k.float()), dim=-1) @ v.float()


@breaks("00", "torch.float64 where the contract's is torch.float32")
def attention_in_float64(q, k, v):
    return torch.softmax(_scores(q.double(), k.double()), dim=-1) @ v.double()


@breaks("00", "gives NaN where the values are numbers")
def softmax_without_the_max(q, k, v):
    weights = _scores(q, k).exp()
    return weights / weights.sum(-1, keepdim=True) @ v
