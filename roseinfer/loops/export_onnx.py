"""One ONNX graph with past key/values, for every step (its command: roseinfer/cli/export_onnx.py).

The graph serves the first step (an empty past) and every later one, at any batch size,
prompt length and past length. Its inputs and outputs carry the names Hugging Face's
exporters use, so code written for those runs it unchanged:

    input_ids (B, T), attention_mask (B, P + T), position_ids (B, T),
    past_key_values.{i}.key / .value (B, kv_heads, P, head_dim)
        -> logits (B, T, vocab), present.{i}.key / .value (B, kv_heads, P + T, head_dim)

What makes one graph fit every step: nothing in it may be a number read off the example
inputs. The model is rose's one GPT (rosetrainer/model.py), called with `ExportCache`
(roseinfer/cache/export.py), a KVCache built from the graph's inputs: `update` concatenates each layer's past and new
keys/values (`concat_kv`), `prepare` cuts the causal mask's bottom rows for the new
tokens from the shapes (`causal_mask(T, P + T)`), adds the padding columns of
`attention_mask` (`padding_mask`), and hands the model the `position_ids` it was given.
The tracer sees sizes, not numbers, so each of these stays symbolic in the graph.

The exporter is torch.onnx.export(dynamo=True): torch.export traces the model into a
graph whose sizes are symbols (batch_size, sequence_length, past_sequence_length; each
Dim.DYNAMIC, which raises at export time if the code pins it to its example value), and
onnxscript translates it. The older TorchScript exporter (dynamo=False, dynamic_axes)
records whatever the example computed and trusts the declared axes, so a number it baked
in shows up only at run time, in onnxruntime (chapter 15 shows both ways of breaking it);
torch 2.9+ deprecates it. The example avoids sizes 0 and 1, which torch.export has
treated as special (2 rows, 3 past, 4 new tokens), and the export is then checked in
onnxruntime against PyTorch on other shapes: an empty past, one new token, other batches.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from roseinfer.cache.export import ExportCache
from roseinfer.loops.onnx_generate import (
    META_FILE,
    OnnxModel,
    input_names,
    output_names,
)
from rosetrainer import model as gpt
from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError
from rosetrainer.model import GPT, LayerPast
from rosetrainer.numerics import logit_tolerance

DEFAULT_OPSET = 18  # the lowest the dynamo exporter writes natively
# The example the graph is traced with: no size 0 or 1, which torch.export has treated as
# special (a dimension whose example is 0 or 1 could be pinned to it).
EXAMPLE_BATCH, EXAMPLE_PAST, EXAMPLE_NEW = 2, 3, 4


class DecoderWithPast(nn.Module):
    """rose's GPT as one step of a decoder: the graph's inputs in, logits and present out."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: tuple[LayerPast, ...],
    ) -> tuple[torch.Tensor, tuple[LayerPast, ...]]:
        cache = ExportCache(list(past_key_values), attention_mask, position_ids)
        # validate=False: the checks read values (int(ids.max())), which a graph cannot.
        logits = self.model(input_ids, cache=cache, validate=False).logits
        return logits, tuple(cache.present)


def example_inputs(
    config: GPTConfig, batch: int, past: int, new: int, pads: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[LayerPast, ...]]:
    """Random inputs of one step's shapes; `pads` left-pads rows (positions count real tokens)."""
    generator = torch.Generator().manual_seed(batch * 1000 + past * 10 + new)
    ids = torch.randint(0, config.vocab_size, (batch, new), generator=generator)
    pads = pads or [0] * batch
    slots = torch.arange(past + new)[None, :]
    attention_mask = (slots >= torch.tensor(pads)[:, None]).long()
    position_ids = gpt.padded_position_ids(attention_mask)[:, past:]
    shape = (batch, config.kv_heads, past, config.head_dim)
    past_kv = tuple(
        (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
        for _ in range(config.n_layer)
    )
    return ids, attention_mask, position_ids, past_kv


def dynamic_shapes(n_layer: int) -> dict[str, object]:
    """Which axes are symbols, named as Hugging Face's exporters name them."""
    batch, new, past = "batch_size", "sequence_length", "past_sequence_length"
    per_layer = ({0: batch, 2: past}, {0: batch, 2: past})
    return {
        "input_ids": {0: batch, 1: new},
        "attention_mask": {0: batch, 1: f"{past} + {new}"},
        "position_ids": {0: batch, 1: new},
        "past_key_values": tuple(per_layer for _ in range(n_layer)),
    }


def export(model: GPT, path: Path, opset: int = DEFAULT_OPSET) -> None:
    """Write the graph of `model` (float32) to `path`."""
    config = model.config
    if config.sliding_window is not None:
        raise RoseError(
            "the graph's past_key_values grow with the sequence and its mask is causal; a "
            "sliding-window model needs a rolling cache the graph does not have: run it "
            "with PyTorch (cli_generate --cache rolling)"
        )
    decoder = DecoderWithPast(model.eval())
    example = example_inputs(config, EXAMPLE_BATCH, EXAMPLE_PAST, EXAMPLE_NEW)
    # The exporter warns about torchvision ops it cannot register (rose has none) and about
    # deprecated names inside torch: nothing a user can act on.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            decoder,
            example,
            dynamo=True,
            dynamic_shapes=dynamic_shapes(config.n_layer),
            input_names=input_names(config.n_layer),
            output_names=output_names(config.n_layer),
            opset_version=opset,
            verbose=False,
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(path))


# Shapes the check runs, none of them the example's: (batch, left pads per row, prompt length).
CHECK_CASES = [(1, [0], 5), (3, [0, 2, 1], 4)]


def check_against_torch(
    model: GPT, onnx_model: OnnxModel, decode_steps: int = 2
) -> tuple[float, float]:
    """Run the graph and PyTorch side by side: a prefill on an empty past, then one-token
    steps on the graph's own `present`; return the largest logit difference and the float32
    tolerance at the largest logit seen (onnxruntime adds the same products in another order)."""
    decoder = DecoderWithPast(model.eval())
    largest, tolerance = 0.0, 0.0
    for batch, pads, length in CHECK_CASES:
        inputs = list(example_inputs(model.config, batch, 0, length, pads))
        for _ in range(1 + decode_steps):
            ids, attention_mask, position_ids, past = inputs
            with torch.no_grad():
                want, _ = decoder(ids, attention_mask, position_ids, past)
            flat_past = [t.numpy() for kv in past for t in kv]
            got, present = onnx_model(
                ids.numpy(), attention_mask.numpy(), position_ids.numpy(), flat_past
            )
            largest = max(largest, float(np.abs(got - want.numpy()).max()))
            tolerance = max(tolerance, logit_tolerance(want))
            # The next step: the argmax of each row on top of the graph's own present.
            present_t = [torch.from_numpy(t) for t in present]
            inputs = [
                torch.from_numpy(got[:, -1].argmax(-1))[:, None],
                torch.cat([attention_mask, torch.ones(batch, 1, dtype=torch.long)], dim=1),
                position_ids[:, -1:] + 1,
                tuple(zip(present_t[0::2], present_t[1::2], strict=True)),
            ]
    return largest, tolerance


def write_meta(
    model: GPT, directory: Path, eot_id: int, tokenizer_name: str, opset: int, source: str
) -> None:
    config = model.config
    meta = {
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_kv_head": config.kv_heads,
        "head_dim": config.head_dim,
        "n_embd": config.n_embd,
        "block_size": config.block_size,
        "vocab_size": config.vocab_size,
        "eot_id": eot_id,
        "tokenizer_name": tokenizer_name,
        "opset": opset,
        "source": source,
        "dtype": "float32",
        "inputs": input_names(config.n_layer),
        "outputs": output_names(config.n_layer),
        "dynamic_axes": {
            "batch_size": "rows of the batch",
            "sequence_length": "new tokens this step",
            "past_sequence_length": "positions already in past_key_values (0 on the first step)",
        },
    }
    (directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
