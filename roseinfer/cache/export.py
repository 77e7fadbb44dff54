"""The cache an ONNX export traces the model with: the graph's own inputs and outputs.

An exported decoder (roseinfer/loops/export_onnx.py) takes past key/values, an attention
mask and position ids as inputs and returns the present key/values. `ExportCache` is the
KVCache (rosetrainer.model) that hands the model exactly those for one call, computing
everything from the inputs' sizes so the tracer keeps each size a symbol.
"""

from __future__ import annotations

import torch

from rosetrainer import model as gpt
from rosetrainer.model import LayerPast


class ExportCache:
    """A KVCache (rosetrainer.model) made of the graph's inputs, for one model call.

    past: one (k, v) per layer, (B, n_head, P, head_dim), P may be 0;
    attention_mask: (B, P + T), 1 for real tokens, 0 for left padding;
    position_ids: (B, T), the new tokens' positions (counting real tokens only).
    `present` collects each layer's past + new keys/values, the graph's outputs.
    """

    def __init__(
        self, past: list[LayerPast], attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> None:
        self.past = past
        self.attention_mask = attention_mask
        self.position_ids = position_ids
        self.present: list[LayerPast] = []

    def prepare(
        self, batch: int, q_len: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # kv_len is a size of an input, so the mask's shape stays a symbol in the graph.
        kv_len = self.attention_mask.size(1)
        mask = gpt.padding_mask(gpt.causal_mask(q_len, kv_len, device), self.attention_mask)
        return self.position_ids, mask

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> LayerPast:
        present = gpt.concat_kv(self.past[layer], k, v)
        self.present.append(present)
        return present
