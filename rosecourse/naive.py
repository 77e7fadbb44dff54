"""The three KV-cache bugs, one per invariant, for chapters and tests to swap in.

Each function has the signature of the invariant it breaks in `rosetrainer/model.py`
and is what a first attempt at a cache tends to write. Patch one in with
`unittest.mock.patch.object(rosetrainer.model, "causal_mask", top_left_causal_mask)`
(or "position_ids" with `positions_from_zero`, "concat_kv" with `lose_past_kv`) and the cached output parts from the uncached
oracle at the first decode step. The prefill is never affected: with no past, each
buggy version does exactly what the correct one does.
"""

from __future__ import annotations

import torch


def top_left_causal_mask(
    q_len: int, kv_len: int, device: torch.device | None = None
) -> torch.Tensor:
    """The bug: rows 0 .. q_len of the full (kv_len, kv_len) triangle, not the last q_len.

    This is what `is_causal=True` does. A decode query is the newest token, but it
    gets the mask row of the oldest one and sees only key 0.
    """
    return torch.ones(kv_len, kv_len, dtype=torch.bool, device=device).tril()[:q_len]


def positions_from_zero(
    past_len: int, q_len: int, device: torch.device | None = None
) -> torch.Tensor:
    """The bug: new tokens numbered from 0 as if nothing came before, ignoring past_len.

    Every decode token then gets position 0's embedding, wherever it really stands.
    """
    return torch.arange(q_len, device=device)


def lose_past_kv(
    layer_past: tuple[torch.Tensor, torch.Tensor] | None, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bug: the past's slots are there, but what was in them is lost (zeros).

    This is a cache that is allocated but never written, or rebuilt each step instead
    of extended. The shapes all line up, so nothing complains: the new token simply
    attends to keys and values that no longer say anything about the prompt.
    """
    if layer_past is None:
        return k, v
    past_k, past_v = layer_past
    return (
        torch.cat([torch.zeros_like(past_k), k], dim=2),
        torch.cat([torch.zeros_like(past_v), v], dim=2),
    )
