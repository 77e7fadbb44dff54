"""Chapter 16's exercise: one pipeline stage's share of a model call.

The learner's function replaces PipelineStage.forward, and the model runs as one stage
per layer.

The contract is the docstring of rosecourse/exercises/ch16_stage_forward/reference.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from unittest import mock

import torch

from rosecourse.demo import (
    NEW_TOKENS,
    PROMPT,
)
from rosecourse.exercises.answers import known_mistakes
from rosecourse.exercises.common import (
    CheckResult,
    Exercise,
    Probe,
    check,
    encoded,
    oracle_model,
    outcome,
    reference_tokens,
)
from roseinfer.cache.dense import ConcatKVCache
from roseinfer.pipeline.stage import PipelineStage

_real_stage_forward = PipelineStage.forward


def stage_forward(stage: PipelineStage, x: torch.Tensor, cache) -> torch.Tensor:
    """The reference: PipelineStage.forward."""
    return _real_stage_forward(stage, x, cache)


def _swap_stage_forward(fn: Callable) -> contextlib.AbstractContextManager:
    return mock.patch.object(PipelineStage, "forward", fn)


def pipelined_greedy(n_stages: int, n_new: int, on_token) -> list[list[int]]:
    """The chapter prompt greedy through `n_stages` stages in this process, one cache each."""
    model = oracle_model()
    stages = [PipelineStage(model, s, n_stages) for s in range(n_stages)]
    caches = [ConcatKVCache() for _ in stages]
    ids, made = torch.tensor([encoded(PROMPT)]), []
    with torch.inference_mode():
        for _ in range(n_new):
            x = ids
            for stage, cache in zip(stages, caches, strict=True):
                x = stage(x, cache)
            token = int(x[0].argmax())
            made.append(token)
            on_token(0, token)
            ids = torch.tensor([[token]])
    return [made]


def _stage_runs() -> list[tuple[str, Callable, Callable]]:
    prompt = encoded(PROMPT)
    n_stages = oracle_model().config.n_layer  # one layer a stage: every stage but one is "late"
    return [
        (
            f"{n_stages} stages, one cache each",
            lambda: [reference_tokens(prompt, NEW_TOKENS)],
            lambda on_token: pipelined_greedy(n_stages, NEW_TOKENS, on_token),
        )
    ]


def _stage_probe(fn: Callable) -> Probe:
    """Two calls on one cache (3 tokens, then 1) of a batch of 2 rows, at the first of two
    stages (token ids in), the last of two (hidden states in), and a single stage holding
    every layer; and three calls (4 tokens, 3, 1) of a left-padded batch at the first and
    the last of two stages."""
    model = oracle_model()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 3), generator=generator)
    hidden = torch.randn(2, 3, model.config.n_embd, generator=generator)

    def two_calls(stage: PipelineStage, x: torch.Tensor) -> list[torch.Tensor]:
        cache = ConcatKVCache()
        with torch.inference_mode():
            return [fn(stage, x, cache), fn(stage, x[:, -1:], cache)]

    stages = {
        "the first of 2 stages": (PipelineStage(model, 0, 2), ids),
        "the last of 2 stages": (PipelineStage(model, 1, 2), hidden),
        "one stage of every layer": (PipelineStage(model, 0, 1), ids),
    }
    probe = {
        f"stage_forward at {name}, 2 rows, 3 tokens then 1": outcome(
            lambda s=stage, x=x: two_calls(s, x)
        )
        for name, (stage, x) in stages.items()
    }

    def padded_calls(stage: PipelineStage, x: torch.Tensor) -> list[torch.Tensor]:
        """Row 1 left-padded by 2: the positions and the mask are the cache's, per row."""
        cache = ConcatKVCache()
        cache.reset(torch.tensor([0, 2]))
        with torch.inference_mode():
            outs = [fn(stage, x[:, :4], cache), fn(stage, x[:, 4:7], cache)]
            outs.append(fn(stage, x[:, 7:], cache))
        first = outs[0]
        if isinstance(first, torch.Tensor) and first.dim() == 3 and first.size(1) == 4:
            first = first.clone()
            first[1, :2] = 0  # the padding's own outputs are never read: not compared
        return [first, *outs[1:]]

    long_ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=generator)
    long_hidden = torch.randn(2, 8, model.config.n_embd, generator=generator)
    padded = {
        "the first of 2 stages": (PipelineStage(model, 0, 2), long_ids),
        "the last of 2 stages": (PipelineStage(model, 1, 2), long_hidden),
    }
    for name, (stage, x) in padded.items():
        label = (
            f"stage_forward at {name}, 2 rows (row 1 left-padded by 2: positions and mask "
            "from the cache), 4 tokens, then 3 after that past, then 1"
        )
        probe[label] = outcome(lambda s=stage, x=x: padded_calls(s, x))
    return probe


EXERCISE = Exercise(
    name="stage_forward",
    reference=stage_forward,
    probe=_stage_probe,
    swapped_in=_swap_stage_forward,
    runs=_stage_runs(),
    known_wrong=known_mistakes(__name__),
    fallback="a stage's output is not what the same layers compute in one process",
)


def check_stage_forward(fn: Callable) -> CheckResult:
    """Chapter 16: `stage_forward(stage, x, cache) -> hidden states or last-token logits`."""
    return check(EXERCISE, fn)
