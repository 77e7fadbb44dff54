"""Chapter 15's exercise: the exported graph's positions and mask, its shapes kept symbolic.

The learner's function replaces ExportCache.prepare, eager and through torch.export.

The contract is the docstring of rosecourse/exercises/ch15_export_prepare/reference.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from unittest import mock

import torch

from rosecourse.exercises.answers import known_mistakes
from rosecourse.exercises.common import (
    BATCH_TEXTS,
    CheckResult,
    Exercise,
    Probe,
    check,
    encoded,
    oracle_model,
    outcome,
    reference_tokens,
)
from roseinfer.loops.export_onnx import DecoderWithPast, ExportCache, example_inputs

_real_export_prepare = ExportCache.prepare


def export_prepare(cache: ExportCache, batch: int, q_len: int, device: torch.device):
    """The reference: ExportCache.prepare."""
    return _real_export_prepare(cache, batch, q_len, device)


def _swap_export_prepare(fn: Callable) -> contextlib.AbstractContextManager:
    return mock.patch.object(ExportCache, "prepare", fn)


def _export_probe(fn: Callable) -> Probe:
    """(positions, mask) for left-padded batches, the mask broadcast to (batch, 1, q_len,
    past + q_len): the contract allows any shape that broadcasts there."""
    config = oracle_model().config
    # (batch, past, new, left padding per row)
    cases = [(2, 3, 4, [0, 2]), (1, 0, 5, None), (3, 6, 1, [1, 0, 3]), (2, 2, 2, [3, 0])]

    def prepared(cache: ExportCache, batch: int, q_len: int) -> object:
        got = fn(cache, batch, q_len, torch.device("cpu"))
        shape = (batch, 1, q_len, cache.attention_mask.size(1))
        if isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], torch.Tensor):
            with contextlib.suppress(RuntimeError):  # a mask of another shape shows as it is
                return got[0], got[1].broadcast_to(shape)
        return got

    probe: Probe = {}
    for batch, past, new, pads in cases:
        _, attention_mask, position_ids, past_kv = example_inputs(config, batch, past, new, pads)
        cache = ExportCache(list(past_kv), attention_mask, position_ids)
        call = f"export_prepare(batch {batch}, past {past}, {new} new, left padding {pads})"
        probe[call] = outcome(lambda c=cache, b=batch, n=new: prepared(c, b, n))
    # The device the model asks for (rose passes the input's): the runs are on the CPU,
    # where a mask made without `device` passes; inputs and device on meta tell.
    _, attention_mask, position_ids, past_kv = example_inputs(config, 2, 3, 4, [0, 2])
    meta = torch.device("meta")
    moved = ExportCache(
        [tuple(t.to(meta) for t in layer) for layer in past_kv],
        attention_mask.to(meta),
        position_ids.to(meta),
    )
    call = "export_prepare(batch 2, past 3, 4 new, on meta, torch.device('meta')): its devices"
    probe[call] = outcome(lambda: [t.device.type for t in fn(moved, 2, 4, meta)])
    return probe


def padded_greedy(
    step: Callable, prompts: list[tuple[int, ...]], n_new: int, on_token
) -> list[list[int]]:
    """Greedy decoding of left-padded rows through `step(ids, attention_mask, position_ids,
    past)` -> (logits, present): the graph's interface, driven as onnxruntime's loop does."""
    config = oracle_model().config
    width = max(map(len, prompts))
    pads = torch.tensor([width - len(p) for p in prompts])
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    attention_mask = (torch.arange(width)[None, :] >= pads[:, None]).long()
    empty = torch.zeros(len(prompts), config.n_head, 0, config.head_dim)
    past = tuple((empty, empty) for _ in range(config.n_layer))
    made: list[list[int]] = [[] for _ in prompts]
    for _ in range(n_new):
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.size(1) :].clone()
        logits, past = step(ids, attention_mask, positions, past)
        ids = logits[:, -1].argmax(-1, keepdim=True)
        for row, token in enumerate(ids[:, 0].tolist()):
            made[row].append(token)
            on_token(row, token)
        attention_mask = torch.cat([attention_mask, torch.ones_like(ids)], dim=1)
    return made


class Prepared(torch.nn.Module):
    """`prepare` on the exported decoder's inputs, as DecoderWithPast and the model call it:
    the cache made of them, the batch and the new tokens' count the input ids' sizes."""

    def __init__(self, prepare: Callable) -> None:
        super().__init__()
        self.prepare = prepare

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: tuple,
    ) -> object:
        cache = ExportCache(list(past_key_values), attention_mask, position_ids)
        batch, q_len = input_ids.shape
        return self.prepare(cache, batch, q_len, input_ids.device)


EXPORT_NEW = 6  # tokens per row through the exported graph (a few, each a graph run)


def _export_runs() -> list[tuple[str, Callable, Callable]]:
    prompts = [encoded(text) for text in BATCH_TEXTS]

    def expected() -> list[tuple[int, ...]]:
        return [reference_tokens(p, EXPORT_NEW) for p in prompts]

    def eager(on_token: Callable[[int, int], None]) -> list[list[int]]:
        module = DecoderWithPast(oracle_model())
        with torch.inference_mode():
            return padded_greedy(module, prompts, EXPORT_NEW, on_token)

    def exported(on_token: Callable[[int, int], None]) -> list[list[int]]:
        # The function swapped in, traced alone by torch.export as the decoder's export
        # traces it (the same inputs, its sizes symbols), then its graph run in the model
        # at every step's shapes: what exporting the whole decoder does to it, in a fraction
        # of the tracing.
        prepare = ExportCache.prepare
        dynamic = torch.export.Dim.DYNAMIC
        config = oracle_model().config
        shapes = (
            {0: dynamic, 1: dynamic},
            {0: dynamic, 1: dynamic},
            {0: dynamic, 1: dynamic},
            tuple(
                ({0: dynamic, 2: dynamic}, {0: dynamic, 2: dynamic}) for _ in range(config.n_layer)
            ),
        )
        # Fresh tensors, not views (torch.export guards a view's base, which later steps lack).
        example = torch.utils._pytree.tree_map(torch.clone, example_inputs(config, 2, 3, 4))
        graph = torch.export.export(Prepared(prepare), example, dynamic_shapes=shapes).module()

        def traced(cache: ExportCache, batch: int, q_len: int, device: torch.device):
            ids = torch.zeros(batch, q_len, dtype=torch.long, device=device)  # its shape only
            return graph(ids, cache.attention_mask, cache.position_ids, tuple(cache.past))

        module = DecoderWithPast(oracle_model())
        with mock.patch.object(ExportCache, "prepare", traced), torch.no_grad():
            return padded_greedy(module, prompts, EXPORT_NEW, on_token)

    return [
        ("eager, a left-padded batch", expected, eager),
        (
            "torch.export'ed once (batch 2, past 3, new 4), run at every step's shapes",
            expected,
            exported,
        ),
    ]


EXERCISE = Exercise(
    name="export_prepare",
    reference=export_prepare,
    probe=_export_probe,
    swapped_in=_swap_export_prepare,
    runs=_export_runs(),
    known_wrong=known_mistakes(__name__),
    fallback="the positions or the mask the graph computes differ from the uncached run's",
)


def check_export_prepare(fn: Callable) -> CheckResult:
    """Chapter 15: `export_prepare(cache, batch, q_len, device) -> (position_ids, mask)`."""
    return check(EXERCISE, fn)
