"""The model's linear layers with their weights packed once for oneDNN (CPU only).

A decode step multiplies a few dozen rows (one per running sequence) by every weight
matrix. PyTorch's default CPU matrix product takes the weight as it is stored and lays
it out for its kernel on every call; for so few rows that work rivals the product
itself. oneDNN (the CPU library PyTorch ships with) can lay each weight out once, for
the row count expected, and then read it straight through: on the 2-core build machine
the vocabulary projection of 32 rows took 41 ms plainly and 16 ms packed, the MLP's
output projection 4.0 ms and 0.8 ms. These are the calls PyTorch's own compiler makes
for a frozen CPU model (torch.compile with freezing); here they are made without
compiling anything.

`packed_linears(model)` returns a view of the model in which every `nn.Linear` is a
`PackedLinear`: the same forward, the same parameters for everything else (the
embeddings and layer norms are shared, not copied), and a packed copy of each linear
weight (so about one more copy of the weights in memory). The results are the plain
ones bit for bit on the machines measured; the tests compare the engine's logits with
the uncached oracle either way.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from rosetrainer.model import GPT


def can_pack(model: nn.Module) -> bool:
    """oneDNN packing applies: a CPU model in float32 or bfloat16, PyTorch built with oneDNN."""
    weight = next(model.parameters())
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
    )


class PackedLinear(nn.Module):
    """An nn.Linear whose weight oneDNN laid out once for products of about `rows` rows."""

    def __init__(self, linear: nn.Linear, rows: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, rows))
        self.bias = linear.bias  # shared with the plain layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packed_linears(model: GPT, rows: int) -> GPT:
    """The model with every nn.Linear packed for products of about `rows` rows; every
    other module (and parameter) shared with `model`, which is left as it was."""

    def rebuilt(module: nn.Module) -> nn.Module:
        if isinstance(module, nn.Linear):
            return PackedLinear(module, rows)
        clone = copy.copy(module)  # shares parameters and buffers; children are rebuilt
        clone._modules = {name: rebuilt(child) for name, child in module._modules.items()}
        return clone

    return rebuilt(model)
