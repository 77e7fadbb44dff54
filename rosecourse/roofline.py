"""The roofline's counts for one decode step: the bytes it must read, the work it does.

Chapter 01 draws the roofline from them, chapter 06 counts a cache's bytes, chapter 10
holds measured steps against them, and the benchmarks (benchmarks/decode.py,
benchmarks/engine.py) use the same counts.
"""

from __future__ import annotations

import torch

from roseinfer.cache.quantized import kv_bytes_per_token
from rosetrainer.model import GPT


def weight_bytes(model: GPT) -> int:
    """Bytes a decode step reads of the weights: every matrix once (the tied one once too);
    of the position table only one row, so it is left out."""
    wpe = model.transformer.wpe.weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not wpe)


def cache_bytes(model: GPT, positions: float) -> float:
    """Bytes of `positions` tokens' keys and values, every layer, in the model's dtype."""
    itemsize = model.lm_head.weight.element_size()
    return positions * kv_bytes_per_token(model.config, "auto", itemsize=itemsize)


def decode_flops(model: GPT, kv_len: int, batch: int = 1) -> int:
    """Floating-point operations of one decode step (a multiply-add counts two).

    Per row: every matrix of a Linear layer once (the output head included; the
    embeddings are lookups), and in each layer the query against kv_len keys and the
    weights against kv_len values.
    """
    cfg = model.config
    matrices = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    attention = 2 * cfg.n_layer * cfg.n_embd * kv_len
    return batch * 2 * (matrices + attention)
