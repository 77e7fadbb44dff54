"""Chapter 01's exercise: the uncached greedy loop.

The check calls the learner's loop on the chapters' model and compares its tokens with
the teaching loop's.

The contract is the docstring of rosecourse/exercises/ch01_greedy_decode/reference.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rosecourse.demo import (
    NEW_TOKENS,
    PROMPT,
)
from rosecourse.exercises.common import (
    CheckResult,
    Exercise,
    KnownWrong,
    Probe,
    check,
    encoded,
    held_function,
    hold,
    oracle_model,
    outcome,
    reference_tokens,
)
from roseinfer.loops.generate import generate
from roseinfer.request.sampling import SamplingParams
from rosetrainer.model import GPT


def greedy_decode(model: GPT, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The reference: the teaching loop, uncached."""
    params = SamplingParams(max_tokens=max_new_tokens, ignore_eos=True)
    return generate(model, prompt_ids, params, use_cache=False).token_ids


def _greedy_probe(fn: Callable) -> Probe:
    model = oracle_model()
    cases = [((464, 3290, 318), 3), ((50,), 4), ((50, 464), 1)]
    return {
        f"greedy_decode(model, {list(p)}, {n})": outcome(lambda p=p, n=n: fn(model, list(p), n))
        for p, n in cases
    }


def _greedy_runs() -> list[tuple[str, Callable, Callable]]:
    prompt = encoded(PROMPT)

    def go(on_token: Callable[[int, int], None]) -> list[list[int]]:
        with torch.no_grad():
            return [list(held_function()(oracle_model(), list(prompt), NEW_TOKENS))]

    return [("the chapter's prompt", lambda: [reference_tokens(prompt, NEW_TOKENS)], go)]


def _first_position(model, prompt_ids, max_new_tokens):
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits
        ids.append(int(logits[0, 0].argmax()))
    return ids[len(prompt_ids) :]


def _prompt_only(model, prompt_ids, max_new_tokens):
    logits = model(torch.tensor([prompt_ids])).logits
    return [int(logits[0, -1].argmax())] * max_new_tokens


def _last_token_only(model, prompt_ids, max_new_tokens):
    new, ids = [], list(prompt_ids)
    for _ in range(max_new_tokens):
        new.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        ids = new[-1:]
    return new


def _with_prompt(model, prompt_ids, max_new_tokens):
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids


EXERCISE = Exercise(
    name="greedy_decode",
    reference=greedy_decode,
    probe=_greedy_probe,
    swapped_in=hold,
    runs=_greedy_runs(),
    known_wrong=[
        KnownWrong(
            "first_position",
            _first_position,
            "you take the logits of the first position (logits[0, 0]): the next token is "
            "predicted by the last one, logits[0, -1]",
        ),
        KnownWrong(
            "prompt_only",
            _prompt_only,
            "you run the prompt once and repeat its token: each step must feed the sequence "
            "with every token chosen so far",
        ),
        KnownWrong(
            "last_token_only",
            _last_token_only,
            "after the first step you feed only the newest token: without a cache the model "
            "must re-read the whole sequence (that re-reading is what chapter 02's cache saves)",
        ),
        KnownWrong(
            "with_prompt",
            _with_prompt,
            "you return the prompt with the new tokens: return only the new ones",
        ),
    ],
    fallback="your loop does not choose, at each step, the argmax after the whole sequence",
)


def check_greedy_decode(fn: Callable) -> CheckResult:
    """Chapter 01: `greedy_decode(model, prompt_ids, max_new_tokens) -> new token ids`."""
    return check(EXERCISE, fn)
