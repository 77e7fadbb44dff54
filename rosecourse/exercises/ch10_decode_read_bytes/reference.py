"""Chapter 10: the bytes one decode step must read from memory."""

from __future__ import annotations

from rosetrainer.config import GPTConfig


def decode_read_bytes(
    config: GPTConfig, batch: int, context_len: int, bytes_per_number: int
) -> int:
    """Bytes a decode step reads: every weight of the model once, plus the cache.

    A decode step of `batch` rows, each with `context_len` tokens cached, reads every
    parameter of the GPT once (GPT-2 ties lm_head to wte: one matrix; biases and
    LayerNorms count; with `config.bias` False no Linear or LayerNorm has a bias) and
    every cached key and value of every layer and every row.
    Each number takes `bytes_per_number` bytes. The check measures the same on real
    objects: a real GPT's parameters and a real cache after a prefill.
    """
    c = config.n_embd
    b = 1 if config.bias else 0  # a bias in every Linear and LayerNorm, or in none
    attention = (c * 3 * c + b * 3 * c) + (c * c + b * c)  # c_attn, c_proj
    mlp = (c * 4 * c + b * 4 * c) + (4 * c * c + b * c)  # c_fc, c_proj
    norm = c + b * c  # a LayerNorm: a weight (and a bias)
    per_layer = attention + mlp + 2 * norm  # ln_1, ln_2
    embeddings = config.vocab_size * c + config.block_size * c  # wte (also the head), wpe
    weights = embeddings + config.n_layer * per_layer + norm  # + ln_f
    # Keys and values: per layer, per row, per cached token, n_embd numbers each.
    cache = 2 * config.n_layer * batch * context_len * c
    return (weights + cache) * bytes_per_number


# `rose-course hint 10` gives these one at a time, the idea first and the near-code
# last (`rose-course check 10` counts how many were used); the stub leaves them out.
HINTS = (
    "Two parts: the weights, read once per step whatever the batch, and the cache, read for "
    "every row: 2 (keys and values) * n_layer * batch * context_len * n_embd numbers.",
    "The weights of a layer: c_attn (n_embd x 3 n_embd), c_proj (n_embd x n_embd), c_fc "
    "(n_embd x 4 n_embd), the MLP's c_proj (4 n_embd x n_embd) and two LayerNorms (n_embd "
    "each); with config.bias every Linear has a bias of its output's size and every "
    "LayerNorm one of n_embd. Then wte (vocab_size x n_embd, the head too: once), wpe "
    "(block_size x n_embd) and ln_f.",
    "Test your formula on a real model: sum(p.numel() for p in GPT(config).parameters()) "
    "counts the tied weight once.",
)
