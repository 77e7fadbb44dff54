"""Chapter 01's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rosecourse.exercises.answers import alternative, blind, breaks, known, mutant
from rosetrainer.model import GPT

# -- the known mistakes: the check names each one it meets (answers.known) ----------


@known(
    "01",
    "you take the logits of the first position (logits[0, 0]): the next token is "
    "predicted by the last one, logits[0, -1]",
)
def _first_position(model, prompt_ids, max_new_tokens):
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits
        ids.append(int(logits[0, 0].argmax()))
    return ids[len(prompt_ids) :]


@known(
    "01",
    "you run the prompt once and repeat its token: each step must feed the sequence "
    "with every token chosen so far",
)
def _prompt_only(model, prompt_ids, max_new_tokens):
    logits = model(torch.tensor([prompt_ids])).logits
    return [int(logits[0, -1].argmax())] * max_new_tokens


@known(
    "01",
    "after the first step you feed only the newest token: without a cache the model "
    "must re-read the whole sequence (that re-reading is what chapter 02's cache saves)",
)
def _last_token_only(model, prompt_ids, max_new_tokens):
    new, ids = [], list(prompt_ids)
    for _ in range(max_new_tokens):
        new.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        ids = new[-1:]
    return new


@known("01", "you return the prompt with the new tokens: return only the new ones")
def _with_prompt(model, prompt_ids, max_new_tokens):
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids


# -- 01: greedy_decode(model, prompt_ids, max_new_tokens) ---------------------------------


def _greedy(model, prompt_ids, steps: int, pick: Callable, feed: Callable = list) -> list[int]:
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(pick(model(torch.tensor([feed(ids)])).logits[0])))
    return ids[len(prompt_ids) :]


@mutant("01")
def one_token_short(model, prompt_ids, max_new_tokens):
    return _greedy(model, prompt_ids, max_new_tokens - 1, lambda logits: logits[-1].argmax())


@mutant("01")
def one_token_too_many(model, prompt_ids, max_new_tokens):
    return _greedy(model, prompt_ids, max_new_tokens + 1, lambda logits: logits[-1].argmax())


@mutant("01")
def next_to_last_position(model, prompt_ids, max_new_tokens):
    return _greedy(model, prompt_ids, max_new_tokens, lambda logits: logits[-2].argmax())


@mutant("01")
def least_likely(model, prompt_ids, max_new_tokens):
    return _greedy(model, prompt_ids, max_new_tokens, lambda logits: logits[-1].argmin())


@mutant("01")
def runner_up(model, prompt_ids, max_new_tokens):
    return _greedy(model, prompt_ids, max_new_tokens, lambda logits: logits[-1].topk(2)[1][1])


@mutant("01")
def sequence_reversed(model, prompt_ids, max_new_tokens):
    pick = lambda logits: logits[-1].argmax()  # noqa: E731
    return _greedy(model, prompt_ids, max_new_tokens, pick, feed=lambda ids: ids[::-1])


@alternative("01")
def greedy_on_a_tensor(model, prompt_ids, max_new_tokens):
    ids = torch.tensor([prompt_ids], device=next(model.parameters()).device)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            next_id = model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
    return ids[0, len(prompt_ids) :].tolist()


# -- Written blind (issue 45) --


def _blind_01(model: GPT, prompt_ids, steps: int, position: int = -1, with_prompt=False):
    device = model.lm_head.weight.device
    ids = list(prompt_ids)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids], device=device)).logits
            t = int(logits[0, position].argmax())
            ids.append(t)
            new.append(t)
    return ids if with_prompt else new


# WRONG: picks the argmax of the first position's logits, not the last
@blind("01", known="first_position")
def argmax_first_position(model, prompt_ids, max_new_tokens):
    return _blind_01(model, prompt_ids, max_new_tokens, position=0)


# WRONG: loop runs max_new_tokens - 1 times
@blind("01")
def loop_runs_one_short(model, prompt_ids, max_new_tokens):
    return _blind_01(model, prompt_ids, max_new_tokens - 1)


# WRONG: returns the prompt plus the new tokens
@blind("01", known="with_prompt")
def returns_prompt_too(model, prompt_ids, max_new_tokens):
    return _blind_01(model, prompt_ids, max_new_tokens, with_prompt=True)


# -- By class (issue 54): each breaks a clause its values do not show --


@breaks("01", "changes its argument prompt_ids in place")
def greedy_decode_onto_the_prompt(model, prompt_ids, max_new_tokens):
    ids = prompt_ids
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(ids) - max_new_tokens :]


@breaks("01", "on another device (meta)")
def ids_grown_on_the_cpu(model, prompt_ids, max_new_tokens):
    ids = torch.tensor([prompt_ids])  # on the CPU, whatever the model's device
    with torch.no_grad():
        for _ in range(max_new_tokens):
            next_id = model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
    return ids[0, len(prompt_ids) :].tolist()
