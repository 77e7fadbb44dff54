"""Chapter 15: the positions and mask of an exported graph, its shapes kept symbolic."""

from __future__ import annotations

import torch

from roseinfer.loops.export_onnx import ExportCache
from rosetrainer.model import causal_mask, padding_mask


def export_prepare(
    cache: ExportCache, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The new tokens' positions and the mask their queries attend with, inside the graph.

    cache.attention_mask: (batch, past + q_len), 1 for real tokens, 0 for left padding;
    cache.position_ids: (batch, q_len), the graph's input. Return positions (batch,
    q_len) and a bool mask broadcastable to (batch, 1, q_len, past + q_len): causal and
    bottom-right aligned, and no query reads a padding slot (rosetrainer.model has the
    pieces). The function is traced once by torch.export on example shapes and the
    graph then runs at every other shape: every length must come from a tensor's size,
    never a Python number read out of one.
    """
    kv_len = cache.attention_mask.size(1)  # a size of an input: a symbol in the graph
    mask = causal_mask(q_len, kv_len, device)
    return cache.position_ids, padding_mask(mask, cache.attention_mask)


# `rose-course hint 15` gives these one at a time, the idea first and the near-code
# last (`rose-course check 15` counts how many were used); the stub leaves them out.
HINTS = (
    "The graph's inputs hold what is needed: the positions are cache.position_ids, and the "
    "mask is causal over past + new tokens and hides the padding that cache.attention_mask "
    "marks.",
    "Every length must come from a tensor's size: kv_len = cache.attention_mask.size(1) "
    "stays a symbol when the graph is traced, where an int read out of a tensor's values "
    "(or a shape computed from q_len and a past length you know) is baked in.",
    "rosetrainer.model has the pieces: causal_mask(q_len, kv_len, device), bottom-right "
    "aligned, and padding_mask(mask, attention_mask), which combines them into (batch, 1, "
    "q_len, kv_len) and opens a row that would see nothing.",
)
