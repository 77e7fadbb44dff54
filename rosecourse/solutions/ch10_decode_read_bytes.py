"""Chapter 10: the bytes one decode step must read from memory."""

from __future__ import annotations

from rosetrainer.config import GPTConfig


def decode_read_bytes(
    config: GPTConfig, batch: int, context_len: int, bytes_per_number: int
) -> int:
    """Bytes a decode step reads: every weight of the model once, plus the cache.

    A decode step of `batch` rows, each with `context_len` tokens cached, reads every
    parameter of the GPT once (GPT-2 ties lm_head to wte: one matrix; biases and
    LayerNorms count) and every cached key and value of every layer and every row.
    Each number takes `bytes_per_number` bytes. The check measures the same on real
    objects: a real GPT's parameters and a real cache after a prefill.
    """
    c = config.n_embd
    attention = (c * 3 * c + 3 * c) + (c * c + c)  # c_attn, c_proj with their biases
    mlp = (c * 4 * c + 4 * c) + (4 * c * c + c)  # c_fc, c_proj
    layer_norms = 2 * (2 * c)  # ln_1, ln_2: a weight and a bias each
    per_layer = attention + mlp + layer_norms
    embeddings = config.vocab_size * c + config.block_size * c  # wte (also the head), wpe
    weights = embeddings + config.n_layer * per_layer + 2 * c  # + ln_f
    # Keys and values: per layer, per row, per cached token, n_embd numbers each.
    cache = 2 * config.n_layer * batch * context_len * c
    return (weights + cache) * bytes_per_number
