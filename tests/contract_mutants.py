"""Wrong answers by class (issue 54): each breaks a clause of its exercise's contract that
its values on the small probes and the runs do not show, and the one grading mechanism
(rosecourse/exercises/contract.py, the probes' large magnitudes and whole vocabulary)
must name that clause. Registered as mutants too (tests/mutants.py), so every check that
holds for a mutant holds for these; `CLAUSES` says what each one's FAILED line must name.
"""

from __future__ import annotations

import math

import torch
from mutants import mutant

CLAUSES: dict[str, str] = {}  # mutant name -> words its FAILED line must hold


def breaks(chapter: str, clause: str):
    def register(fn):
        CLAUSES[fn.__name__] = clause
        return mutant(chapter)(fn)

    return register


def _scores(q, k):
    t = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
    future = ~torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(future, -math.inf)


# -- device: made without the input's device, or kept from the first call's device


@breaks("00", "on another device (meta)")
def mask_made_on_the_cpu(q, k, v):
    t = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)
    return torch.softmax(scores, dim=-1) @ v


_masks: dict[tuple[int, int], torch.Tensor] = {}


@breaks("03", "on another device (meta)")
def mask_memoised_on_the_first_device(q_len, kv_len, device=None):
    if (q_len, kv_len) not in _masks:
        ones = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
        _masks[q_len, kv_len] = ones.tril(kv_len - q_len)
    return _masks[q_len, kv_len]


# -- dtype: a float32 softmax leaking into half-precision values; a float64 result


@breaks("00", "in bfloat16 your function returns torch.float32")
def softmax_in_float32_times_the_values(q, k, v):
    return torch.softmax(_scores(q.float(), k.float()), dim=-1) @ v.float()


@breaks("00", "torch.float64 where the contract's is torch.float32")
def attention_in_float64(q, k, v):
    return torch.softmax(_scores(q.double(), k.double()), dim=-1) @ v.double()


@breaks("04", "torch.int32 where the contract's is torch.int64")
def positions_in_int32(past_len, q_len, device=None):
    return torch.arange(past_len, past_len + q_len, device=device, dtype=torch.int32)


# -- numerics: no max subtracted; top-p in float16, or without the p >= 1 shortcut


@breaks("00", "gives NaN where the values are numbers")
def softmax_without_the_max(q, k, v):
    weights = _scores(q, k).exp()
    return weights / weights.sum(-1, keepdim=True) @ v


def _top_p(logits, p, dtype):
    sorted_logits, order = torch.sort(logits.to(dtype), dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    drop_sorted = torch.cumsum(probs, dim=-1) - probs >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


@breaks("05", "GPT-2's vocabulary), 0.5): from index")
def top_p_summed_in_float16(logits, p):
    return logits if p >= 1.0 else _top_p(logits, p, torch.float16)


@breaks("05", "GPT-2's vocabulary), 1.0): from index")
def top_p_without_the_shortcut(logits, p):
    return _top_p(logits, p, logits.dtype)


# -- side effects: the caller's logits or prompt changed in place


@breaks("05", "changes its argument logits in place")
def top_p_in_the_callers_logits(logits, p):
    if p < 1.0:
        logits[_top_p(logits, p, logits.dtype).isinf() & ~logits.isinf()] = float("-inf")
    return logits


@breaks("01", "changes its argument prompt_ids in place")
def greedy_decode_onto_the_prompt(model, prompt_ids, max_new_tokens):
    ids = prompt_ids
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(ids) - max_new_tokens :]
