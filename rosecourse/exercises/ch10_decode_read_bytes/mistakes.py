"""Chapter 10's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

from dataclasses import replace

from rosecourse.exercises.answers import alternative, blind, known, mutant
from rosecourse.exercises.ch10_decode_read_bytes.reference import decode_read_bytes
from rosetrainer.config import GPTConfig

# -- the known mistakes: the check names each one it meets (answers.known) ----------


@known(
    "10",
    "you count the weights alone: every decode step also reads every cached key "
    "and value of every row, and at long contexts that is most of the bytes",
)
def _weights_only(config, batch, context_len, bytes_per_number):
    return decode_read_bytes(config, 0, context_len, bytes_per_number)


@known("10", "you count the keys but not the values: the cache holds both, per layer")
def _keys_only(config, batch, context_len, bytes_per_number):
    kv = 2 * config.n_layer * batch * context_len * config.n_embd * bytes_per_number
    return decode_read_bytes(config, batch, context_len, bytes_per_number) - kv // 2


@known("10", "you count lm_head apart from wte: GPT-2 ties them, one matrix read once")
def _untied_head(config, batch, context_len, bytes_per_number):
    head = config.vocab_size * config.n_embd * bytes_per_number
    return decode_read_bytes(config, batch, context_len, bytes_per_number) + head


@known("10", "your cache bytes are one row's: every row of the batch has its own keys/values")
def _one_row(config, batch, context_len, bytes_per_number):
    return decode_read_bytes(config, 1, context_len, bytes_per_number)


@known(
    "10",
    "you count biases the model does not have: with config.bias False no Linear "
    "or LayerNorm holds one (count every parameter the config gives the model)",
)
def _biases_always(config, batch, context_len, bytes_per_number):
    return decode_read_bytes(replace(config, bias=True), batch, context_len, bytes_per_number)


@known(
    "10",
    "you read the weights once per row: a batched step reads them once for all "
    "rows, which is why batching raises the arithmetic intensity",
)
def _weights_per_row(config, batch, context_len, bytes_per_number):
    weights = decode_read_bytes(config, 0, context_len, bytes_per_number)
    return decode_read_bytes(config, batch, context_len, bytes_per_number) + (batch - 1) * weights


# -- 10: decode_read_bytes(config, batch, context_len, bytes_per_number) --------------------


def _read_bytes(config, batch, context_len, bytes_per_number, **drop: bool) -> int:
    c = config.n_embd
    bias = 0 if drop.get("biases") else 1
    norms = 0 if drop.get("norms") else 2 * c
    per_layer = (
        norms + (c * 3 * c + bias * 3 * c) + (c * c + bias * c)
        + norms + (c * 4 * c + bias * 4 * c) + (0 if drop.get("mlp_out") else 4 * c * c + bias * c)
    )  # fmt: skip
    wpe = 0 if drop.get("wpe") else config.block_size * c
    weights = config.vocab_size * c + wpe + config.n_layer * per_layer + norms
    kv = 2 * config.n_layer * batch * context_len * c
    return (weights + kv) * bytes_per_number


@mutant("10")
def no_biases(config, batch, context_len, bytes_per_number):
    return _read_bytes(config, batch, context_len, bytes_per_number, biases=True)


@mutant("10")
def no_layer_norms(config, batch, context_len, bytes_per_number):
    return _read_bytes(config, batch, context_len, bytes_per_number, norms=True)


@mutant("10")
def no_position_embeddings(config, batch, context_len, bytes_per_number):
    return _read_bytes(config, batch, context_len, bytes_per_number, wpe=True)


@mutant("10")
def half_the_mlp(config, batch, context_len, bytes_per_number):
    return _read_bytes(config, batch, context_len, bytes_per_number, mlp_out=True)


@mutant("10")
def the_new_token_cached_too(config, batch, context_len, bytes_per_number):
    return _read_bytes(config, batch, context_len + 1, bytes_per_number)


@mutant("10")
def cache_in_two_bytes(config, batch, context_len, bytes_per_number):
    kv = 2 * config.n_layer * batch * context_len * config.n_embd
    return _read_bytes(config, 0, 0, bytes_per_number) + kv * 2


@alternative("10")
def counted_from_a_real_model(config, batch, context_len, bytes_per_number):
    from rosetrainer.model import GPT

    weights = sum(p.numel() for p in GPT(config).parameters())
    return (weights + 2 * config.n_layer * batch * context_len * config.n_embd) * bytes_per_number


# -- Written blind (issue 45) --


def _blind_10(
    config: GPTConfig, batch, context_len, bytes_per_number, bias=None, wte=1, wpe=1, kv=2
):
    C, V, L = config.n_embd, config.vocab_size, config.n_layer
    b = (1 if config.bias else 0) if bias is None else bias
    ln = C + b * C
    per_layer = (
        ln + C * 3 * C + b * 3 * C + C * C + b * C + ln + C * 4 * C + b * 4 * C + 4 * C * C + b * C
    )
    params = wte * V * C + wpe * config.block_size * C + L * per_layer + ln
    cache = kv * L * batch * context_len * C
    return (params + cache) * bytes_per_number


# WRONG: biases always counted (config.bias ignored)
@blind("10", known="biases_always")
def bias_always(config, batch, context_len, bytes_per_number):
    return _blind_10(config, batch, context_len, bytes_per_number, bias=1)


# WRONG: cache counts keys only, not values
@blind("10", known="keys_only")
def keys_only(config, batch, context_len, bytes_per_number):
    return _blind_10(config, batch, context_len, bytes_per_number, kv=1)


# WRONG: position table left out (non-embedding habit)
@blind("10")
def no_wpe(config, batch, context_len, bytes_per_number):
    return _blind_10(config, batch, context_len, bytes_per_number, wpe=0)


# WRONG: counts lm_head's weight besides wte (the tied matrix twice)
@blind("10", known="untied_head")
def tied_counted_twice(config, batch, context_len, bytes_per_number):
    return _blind_10(config, batch, context_len, bytes_per_number, wte=2)
