"""The model's linear layers with their weights packed once for oneDNN (CPU only).

A decode step multiplies a few dozen rows (one per running sequence) by every weight
matrix. PyTorch's default CPU matrix product takes the weight as it is stored and lays
it out for its kernel on every call; for so few rows that work rivals the product
itself. oneDNN (the CPU library PyTorch ships with) can lay each weight out once, for
the row count expected, and then read it straight through, which takes a decode step's
products much less time (docs/benchmarks.md, "Figures behind the code", has the
measurements; `python -m benchmarks.kernel_choices` repeats them). These are operations
PyTorch's compiler (inductor) emits for a CPU model whose weights it freezes; here they
are called directly, without compiling anything.

`packed_linears(model)` returns a view of the model in which every `nn.Linear` is a
`PackedLinear`: the same forward, every parameter shared with the model (nothing is
copied), and beside each linear weight its packed copy (so about one more copy of
the weights in memory). The MLP's GELU goes into the product before it, which oneDNN
applies to each tile of the output while it is still in cache: a separate GELU reads
and writes the whole (tokens, 4 * n_embd) activation once more, which fusing saves. The
sums run in another order than the plain product's, so logits differ in their last bits
(within the oracle's tolerance, rosetrainer.numerics); the tests compare the engine's
tokens and logits with the uncached oracle with and without packing.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from rosetrainer.model import GPT, MLP

logger = logging.getLogger(__name__)


def bfloat16_packing_supported() -> bool:
    """oneDNN lays out and multiplies bfloat16 weights only on a processor with bfloat16
    conversion instructions (AVX-512 BW, VL and DQ, or AVX-NE-CONVERT); elsewhere, an AVX2-only
    CPU for one, the reorder raises. PyTorch asks the processor (and honours
    ONEDNN_MAX_CPU_ISA, which caps what oneDNN may use)."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def can_pack(model: nn.Module) -> bool:
    """oneDNN packing applies: a CPU model in float32, or in bfloat16 on a processor whose
    oneDNN has bfloat16 kernels, PyTorch built with oneDNN. A bfloat16 model on any other
    CPU keeps its weights as stored (PyTorch's default product), and says so once."""
    weight = next(model.parameters())
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16 and not bfloat16_packing_supported():
        _say_once(
            "bfloat16 weights not packed: this CPU lacks oneDNN's bfloat16 instructions "
            "(AVX-512 BW/VL/DQ or AVX-NE-CONVERT), so products use PyTorch's default kernel"
        )
        return False
    return weight.dtype in (torch.float32, torch.bfloat16)


_said: set[str] = set()


def _say_once(message: str) -> None:
    """One line on stderr through logging, the first time only (every engine, CLI run and
    benchmark asks can_pack; a user needs to read the choice once)."""
    if message not in _said:
        _said.add(message)
        logger.warning(message)


class PackedLinear(nn.Module):
    """An nn.Linear whose weight oneDNN laid out once for products of about `rows` rows
    (and, given a GELU, that applies it to its output)."""

    def __init__(self, linear: nn.Linear, rows: int, gelu: nn.GELU | None = None) -> None:
        """gelu: apply it to the product's output, in the same call."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The plain weight and bias stay, shared with the plain layer (no copy): code that
        # asks a layer for its weight's dtype or device, or saves it, still can.
        self.weight, self.bias = linear.weight, linear.bias
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)
        self.register_buffer("packed", packed, persistent=False)
        # oneDNN's post-op: its name, and GELU's form (tanh approximation or "none": erf)
        self.post_op = ("none", "") if gelu is None else ("gelu", gelu.approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op, algorithm = self.post_op
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, op, [], algorithm)


def packed_linears(model: GPT, rows: int) -> GPT:
    """The model with every nn.Linear packed for products of about `rows` rows, each
    MLP's GELU done by the product before it; every other module (and parameter) shared
    with `model`, which is left as it was."""

    def rebuilt(module: nn.Module, gelu: nn.GELU | None = None) -> nn.Module:
        if isinstance(module, nn.Linear):
            return PackedLinear(module, rows, gelu)
        clone = copy.copy(module)  # shares parameters and buffers; children are rebuilt
        fused = isinstance(module, MLP) and not module.swiglu  # (SwiGLU has no GELU to fuse)
        clone._modules = {
            name: rebuilt(child, module.gelu if fused and name == "c_fc" else None)
            for name, child in module._modules.items()
        }
        if fused:
            clone.gelu = nn.Identity()  # (MLP.forward still calls it: now it passes through)
        return clone

    return rebuilt(model)
