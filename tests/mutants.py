"""Plausible wrong answers to every chapter's exercise, beyond its known-wrong list.

Each is written against the exercise's contract (rosecourse/solutions/chNN_*.py) the way
a learner might get it wrong: off by one, the wrong axis, one row only, a constant where
a parameter belongs, a missing comparison, rounding the wrong way. tests/test_mutants.py
asserts that each fails its check without being taken for a known mistake, and that the
alternatives (other answers that meet the contract) pass.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from rosecourse.solutions import build_block_manager as reference_block_manager
from rosecourse.solutions import build_cached_loop as reference_cached_loop
from rosecourse.solutions import build_model as reference_model
from rosecourse.solutions import build_training_step as reference_training_step

# The names the builds' mutants read (each runs with the learner module's globals: these
# are the reference's, for the reader and the linter).
from rosecourse.solutions.build_block_manager import chain_hash
from rosecourse.solutions.build_cached_loop import StaticCache, StaticLayer
from rosecourse.solutions.build_model import MLP, Block, CausalSelfAttention
from rosecourse.solutions.build_training_step import (
    AdamW,
    clip_gradients,
    learning_rate,
    parameter_groups,
)
from rosecourse.solutions.build_verify import RollbackCache, accept_or_resample, score
from roseinfer.cache.dense import DenseKVCache
from roseinfer.engine.sequence import EngineSequence
from rosetrainer.config import GPTConfig, TrainConfig
from rosetrainer.model import GPT

MUTANTS: dict[str, list[Callable]] = {}
ALTERNATIVES: dict[str, list[Callable]] = {}


def mutant(chapter: str) -> Callable[[Callable], Callable]:
    def register(fn: Callable) -> Callable:
        MUTANTS.setdefault(chapter, []).append(fn)
        return fn

    return register


def alternative(chapter: str) -> Callable[[Callable], Callable]:
    def register(fn: Callable) -> Callable:
        ALTERNATIVES.setdefault(chapter, []).append(fn)
        return fn

    return register


# -- 00: causal_attention(q, k, v) --------------------------------------------------------


def _attend(q, k, v, scale: float, allowed: torch.Tensor, fill: float = -math.inf):
    scores = (q @ k.transpose(-2, -1)) * scale
    return torch.softmax(scores.masked_fill(~allowed, fill), dim=-1) @ v


def _lower(t: int, diagonal: int = 0) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool).tril(diagonal)


@mutant("00")
def scaled_by_head_dim(q, k, v):
    return _attend(q, k, v, 1 / q.size(-1), _lower(q.size(-2)))


@mutant("00")
def scale_of_the_probe_head_dim(q, k, v):
    return _attend(q, k, v, 1 / math.sqrt(8), _lower(q.size(-2)))


@mutant("00")
def own_key_hidden(q, k, v):
    return _attend(q, k, v, q.size(-1) ** -0.5, _lower(q.size(-2), -1)).nan_to_num()


@mutant("00")
def masked_with_zero(q, k, v):
    return _attend(q, k, v, q.size(-1) ** -0.5, _lower(q.size(-2)), fill=0.0)


@mutant("00")
def first_row_attends_for_all(q, k, v):
    y = _attend(q[:1], k[:1], v[:1], q.size(-1) ** -0.5, _lower(q.size(-2)))
    return y.expand_as(q)


@mutant("00")
def keys_query_the_queries(q, k, v):
    scores = (k @ q.transpose(-2, -1)) * q.size(-1) ** -0.5
    return torch.softmax(scores.masked_fill(~_lower(q.size(-2)), -math.inf), dim=-1) @ v


@alternative("00")
def attention_with_a_float_mask(q, k, v):
    t = q.size(-2)
    bias = torch.full((t, t), -math.inf, dtype=q.dtype, device=q.device).triu(1)
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + bias, dim=-1) @ v


# -- 01: greedy_decode(model, prompt_ids, max_new_tokens) ---------------------------------


def _greedy(model, prompt_ids, steps: int, pick: Callable, feed: Callable = list) -> list[int]:
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(pick(model(torch.tensor([feed(ids)])).logits[0])))
    return ids[len(prompt_ids) :]


@mutant("01")
def one_token_short(model, prompt_ids, max_new_tokens):
    return _greedy(model, prompt_ids, max_new_tokens - 1, lambda logits: logits[-1].argmax())


@mutant("01")
def one_token_too_many(model, prompt_ids, max_new_tokens):
    return _greedy(model, prompt_ids, max_new_tokens + 1, lambda logits: logits[-1].argmax())


@mutant("01")
def next_to_last_position(model, prompt_ids, max_new_tokens):
    return _greedy(model, prompt_ids, max_new_tokens, lambda logits: logits[-2].argmax())


@mutant("01")
def least_likely(model, prompt_ids, max_new_tokens):
    return _greedy(model, prompt_ids, max_new_tokens, lambda logits: logits[-1].argmin())


@mutant("01")
def runner_up(model, prompt_ids, max_new_tokens):
    return _greedy(model, prompt_ids, max_new_tokens, lambda logits: logits[-1].topk(2)[1][1])


@mutant("01")
def sequence_reversed(model, prompt_ids, max_new_tokens):
    pick = lambda logits: logits[-1].argmax()  # noqa: E731
    return _greedy(model, prompt_ids, max_new_tokens, pick, feed=lambda ids: ids[::-1])


@alternative("01")
def greedy_on_a_tensor(model, prompt_ids, max_new_tokens):
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            next_id = model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
    return ids[0, len(prompt_ids) :].tolist()


# -- 02: concat_kv(layer_past, k, v) -------------------------------------------------------


def _concat(layer_past, k, v, join: Callable):
    if layer_past is None:
        return k, v
    return join(layer_past[0], k), join(layer_past[1], v)


@mutant("02")
def first_row_only(layer_past, k, v):
    return _concat(layer_past, k, v, lambda past, new: torch.cat([past[:1], new[:1]], dim=2))


@mutant("02")
def along_head_dim(layer_past, k, v):
    return _concat(layer_past, k, v, lambda past, new: torch.cat([past, new], dim=3))


@mutant("02")
def oldest_dropped(layer_past, k, v):
    return _concat(layer_past, k, v, lambda past, new: torch.cat([past[:, :, 1:], new], dim=2))


@mutant("02")
def newest_past_only(layer_past, k, v):
    return _concat(layer_past, k, v, lambda past, new: torch.cat([past[:, :, -1:], new], dim=2))


@mutant("02")
def past_only(layer_past, k, v):
    return layer_past if layer_past is not None else (k, v)


@mutant("02")
def keys_for_values(layer_past, k, v):
    if layer_past is None:
        return k, v
    return torch.cat([layer_past[0], k], dim=2), torch.cat([layer_past[0], v], dim=2)


@alternative("02")
def concatenated_at_negative_two(layer_past, k, v):
    if layer_past is not None:
        k, v = (torch.cat(pair, dim=-2) for pair in zip(layer_past, (k, v), strict=True))
    return k, v


# -- 03: causal_mask(q_len, kv_len, device) -------------------------------------------------


def _full(kv_len: int, diagonal: int = 0) -> torch.Tensor:
    return torch.ones(kv_len, kv_len, dtype=torch.bool).tril(diagonal)


@mutant("03")
def sees_the_next_key(q_len, kv_len, device=None):
    return _full(kv_len, 1)[kv_len - q_len :]


@mutant("03")
def mask_rows_one_early(q_len, kv_len, device=None):
    return _full(kv_len)[kv_len - q_len - 1 : kv_len - 1]


@mutant("03")
def zeros_and_ones(q_len, kv_len, device=None):
    return _full(kv_len)[kv_len - q_len :].float()


@mutant("03")
def mask_inverted(q_len, kv_len, device=None):
    return ~_full(kv_len)[kv_len - q_len :]


@mutant("03")
def mask_transposed(q_len, kv_len, device=None):
    return _full(kv_len).T[kv_len - q_len :]


@mutant("03")
def last_row_only(q_len, kv_len, device=None):
    return _full(kv_len)[-1:]


@alternative("03")
def key_at_or_before_query(q_len, kv_len, device=None):
    query = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    return torch.arange(kv_len, device=device)[None, :] <= query


@alternative("03")
def tril_with_an_offset(q_len, kv_len, device=None):
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)


# -- 04: position_ids(past_len, q_len, device) ----------------------------------------------


@mutant("04")
def end_is_q_len(past_len, q_len, device=None):
    return torch.arange(past_len, q_len, device=device)


@mutant("04")
def one_too_early(past_len, q_len, device=None):
    return torch.arange(past_len - 1, past_len + q_len - 1, device=device).clamp(min=0)


@mutant("04")
def every_position_so_far(past_len, q_len, device=None):
    return torch.arange(past_len + q_len, device=device)


@mutant("04")
def counting_down(past_len, q_len, device=None):
    return torch.arange(past_len + q_len - 1, past_len - 1, -1, device=device)


@mutant("04")
def all_at_the_last(past_len, q_len, device=None):
    return torch.full((q_len,), past_len + q_len - 1, device=device)


@mutant("04")
def float_positions(past_len, q_len, device=None):
    return torch.arange(past_len, past_len + q_len, dtype=torch.float32, device=device)


@alternative("04")
def offset_added(past_len, q_len, device=None):
    return past_len + torch.arange(q_len, device=device)


# -- 05: top_p_filter(logits, p) ----------------------------------------------------------


def _nucleus(logits, p, drop: Callable, fill: float = -math.inf, descending: bool = True):
    sorted_logits, order = torch.sort(logits, dim=-1, descending=descending, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    dropped = drop(probs, probs.cumsum(-1) - probs, p)
    return logits.masked_fill(torch.zeros_like(dropped).scatter(-1, order, dropped), fill)


@mutant("05")
def keeps_a_token_at_exactly_p(logits, p):
    return _nucleus(logits, p, lambda probs, before, p: before > p)


@mutant("05")
def constant_p(logits, p):
    return _nucleus(logits, p, lambda probs, before, p: before >= 0.9)


@mutant("05")
def keeps_the_tail(logits, p):
    return _nucleus(logits, p, lambda probs, before, p: before < p)


@mutant("05")
def dropped_to_zero(logits, p):
    return _nucleus(logits, p, lambda probs, before, p: before >= p, fill=0.0)


@mutant("05")
def sorted_ascending(logits, p):
    return _nucleus(logits, p, lambda probs, before, p: before >= p, descending=False)


@mutant("05")
def softmax_over_rows(logits, p):
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=0)
    dropped = probs.cumsum(-1) - probs >= p
    return logits.masked_fill(torch.zeros_like(dropped).scatter(-1, order, dropped), -math.inf)


@mutant("05")
def first_row_decides(logits, p):
    kept = _nucleus(logits[..., :1, :], p, lambda probs, before, p: before >= p).isfinite()
    return logits.masked_fill(~kept.expand_as(logits), -math.inf)


@alternative("05")
def kept_count_per_row(logits, p):
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    before = torch.softmax(sorted_logits, dim=-1).cumsum(-1) - torch.softmax(sorted_logits, dim=-1)
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(logits.size(-1)).expand_as(order)
    )
    kept = (before < p).sum(-1, keepdim=True)
    return logits.masked_fill(rank >= kept, -math.inf)


# -- 06: static_update(k_buffer, v_buffer, input_pos, k_new, v_new) ----------------------


@mutant("06")
def first_new_token_only(k_buffer, v_buffer, input_pos, k_new, v_new):
    k_buffer[:, :, input_pos[0]] = k_new[:, :, 0]
    v_buffer[:, :, input_pos[0]] = v_new[:, :, 0]
    return k_buffer, v_buffer


@mutant("06")
def one_slot_late(k_buffer, v_buffer, input_pos, k_new, v_new):
    k_buffer[:, :, input_pos + 1] = k_new
    v_buffer[:, :, input_pos + 1] = v_new
    return k_buffer, v_buffer


@mutant("06")
def written_slots_only(k_buffer, v_buffer, input_pos, k_new, v_new):
    k_buffer[:, :, input_pos] = k_new
    v_buffer[:, :, input_pos] = v_new
    return k_buffer[:, :, input_pos], v_buffer[:, :, input_pos]


@mutant("06")
def keys_and_values_swapped(k_buffer, v_buffer, input_pos, k_new, v_new):
    k_buffer[:, :, input_pos] = v_new
    v_buffer[:, :, input_pos] = k_new
    return k_buffer, v_buffer


@mutant("06")
def values_written_as_keys(k_buffer, v_buffer, input_pos, k_new, v_new):
    k_buffer[:, :, input_pos] = k_new
    v_buffer[:, :, input_pos] = k_new
    return k_buffer, v_buffer


@mutant("06")
def up_to_the_last_written(k_buffer, v_buffer, input_pos, k_new, v_new):
    k_buffer[:, :, input_pos] = k_new
    v_buffer[:, :, input_pos] = v_new
    end = int(input_pos[-1]) + 1
    return k_buffer[:, :, :end], v_buffer[:, :, :end]


@alternative("06")
def index_copy_in_place(k_buffer, v_buffer, input_pos, k_new, v_new):
    return k_buffer.index_copy_(2, input_pos, k_new), v_buffer.index_copy_(2, input_pos, v_new)


@alternative("06")
def slice_from_the_first_slot(k_buffer, v_buffer, input_pos, k_new, v_new):
    start = int(input_pos[0])
    k_buffer[:, :, start : start + k_new.size(2)] = k_new
    v_buffer[:, :, start : start + v_new.size(2)] = v_new
    return k_buffer, v_buffer


# -- 07: padded_position_ids(attention_mask) ------------------------------------------------


@mutant("07")
def counted_down_the_batch(attention_mask):
    return (attention_mask.long().cumsum(0) - 1).clamp(min=0)


@mutant("07")
def first_row_positions_for_all(attention_mask):
    return (attention_mask[:1].long().cumsum(-1) - 1).clamp(min=0).expand(attention_mask.shape)


@mutant("07")
def counted_from_the_right(attention_mask):
    return attention_mask.long().sum(-1, keepdim=True) - attention_mask.long().cumsum(-1)


@mutant("07")
def padding_counted(attention_mask):
    return (1 - attention_mask.long()).cumsum(-1)


@mutant("07")
def slot_numbers(attention_mask):
    return (torch.arange(attention_mask.size(1)) - 1).clamp(min=0).expand(attention_mask.shape)


@mutant("07")
def real_tokens_in_the_row(attention_mask):
    return attention_mask.long().sum(-1, keepdim=True).expand(attention_mask.shape) - 1


@alternative("07")
def slot_minus_padding(attention_mask):
    padding = (attention_mask == 0).sum(-1, keepdim=True)
    slots = torch.arange(attention_mask.size(1), device=attention_mask.device)
    return (slots - padding).clamp(min=0)


@alternative("07")
def tokens_before(attention_mask):
    mask = attention_mask.long()
    return mask.cumsum(-1) - mask


@alternative("07")
def padding_at_position_one(attention_mask):
    return (attention_mask.long().cumsum(-1) - 1).abs()


# -- 08: mask_slice(bias, past_len, q_len) --------------------------------------------------


@mutant("08")
def bias_rows_one_early(bias, past_len, q_len):
    start = max(past_len - 1, 0)
    return bias[start : start + q_len, : past_len + q_len]


@mutant("08")
def one_column_short(bias, past_len, q_len):
    return bias[past_len : past_len + q_len, : past_len + q_len - 1]


@mutant("08")
def bias_transposed(bias, past_len, q_len):
    return bias[: past_len + q_len, past_len : past_len + q_len].T


@mutant("08")
def last_rows_of_the_bias(bias, past_len, q_len):
    return bias[-q_len:, : past_len + q_len]


@mutant("08")
def bias_inverted(bias, past_len, q_len):
    return ~bias[past_len : past_len + q_len, : past_len + q_len]


@mutant("08")
def rows_counted_by_q_len(bias, past_len, q_len):
    return bias[q_len - 1 : 2 * q_len - 1, : past_len + q_len]


@alternative("08")
def narrowed(bias, past_len, q_len):
    return bias.narrow(0, past_len, q_len).narrow(1, 0, past_len + q_len)


# -- 09: window_start(start, seq_len, block_size, keep) -------------------------------------


def _cut(start, seq_len, block_size, keep, full: Callable, to: Callable):
    return to(start, seq_len, block_size, keep) if full(seq_len - start, block_size) else start


@mutant("09")
def half_the_context_kept(start, seq_len, block_size, keep):
    return _cut(start, seq_len, block_size, keep, int.__gt__, lambda s, n, b, k: n - b // 2)


@mutant("09")
def one_token_fewer_kept(start, seq_len, block_size, keep):
    return _cut(start, seq_len, block_size, keep, int.__gt__, lambda s, n, b, k: n - k + 1)


@mutant("09")
def moved_on_by_keep(start, seq_len, block_size, keep):
    return _cut(start, seq_len, block_size, keep, int.__gt__, lambda s, n, b, k: s + k)


@mutant("09")
def measured_against_keep(start, seq_len, block_size, keep):
    return seq_len - keep if seq_len - start > keep else start


@mutant("09")
def keep_as_the_start(start, seq_len, block_size, keep):
    return _cut(start, seq_len, block_size, keep, int.__gt__, lambda s, n, b, k: k)


@mutant("09")
def cut_from_the_start(start, seq_len, block_size, keep):
    return _cut(start, seq_len, block_size, keep, int.__gt__, lambda s, n, b, k: s + n - k)


@alternative("09")
def cut_at_one_token_too_many(start, seq_len, block_size, keep):
    return seq_len - keep if seq_len - start == block_size + 1 else start


# -- 18: rolling_slot(pos, window, sinks) ---------------------------------------------------


@mutant("18")
def window_of_eight(pos, window, sinks):
    return torch.where(pos < sinks, pos, sinks + (pos - sinks) % 8)


@mutant("18")
def sinks_of_two(pos, window, sinks):
    return torch.where(pos < 2, pos, 2 + (pos - 2) % window)


@mutant("18")
def last_sink_in_the_window(pos, window, sinks):
    return torch.where(pos < sinks - 1, pos, sinks + (pos - sinks) % window)


@mutant("18")
def one_slot_short(pos, window, sinks):
    return torch.where(pos < sinks, pos, sinks + (pos - sinks) % max(window - 1, 1))


@mutant("18")
def window_rounds_down(pos, window, sinks):
    return torch.where(pos < sinks, pos, sinks + (pos - sinks) // window)


@mutant("18")
def no_sinks_branch(pos, window, sinks):
    return sinks + (pos - sinks) % window


@mutant("18")
def sinks_not_skipped(pos, window, sinks):
    return torch.where(pos < sinks, pos, (pos - sinks) % window)


@alternative("18")
def window_counted_from_zero(pos, window, sinks):
    return torch.where(pos < sinks, pos, sinks + pos % window)


@alternative("18")
def sinks_in_reverse(pos, window, sinks):
    return torch.where(pos < sinks, sinks - 1 - pos, sinks + (pos - sinks) % window)


@alternative("18")
def slots_as_int32(pos, window, sinks):
    # int32 indexes as int64 does; the contract names no dtype beyond that.
    slots = torch.where(pos < sinks, pos, sinks + (pos - sinks) % window)
    return slots.to(torch.int32)


@mutant("18")
def slots_as_int16(pos, window, sinks):
    # A tensor cannot be indexed with int16.
    return torch.where(pos < sinks, pos, sinks + (pos - sinks) % window).to(torch.int16)


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


# -- 11: slot_mapping(block_tables, seq_of_token, positions, kv_block_size) -----------------


@mutant("11")
def offset_one_late(block_tables, seq_of_token, positions, kv_block_size):
    block = block_tables[seq_of_token, positions // kv_block_size]
    return block * kv_block_size + (positions + 1) % kv_block_size


@mutant("11")
def next_logical_block(block_tables, seq_of_token, positions, kv_block_size):
    logical = (positions // kv_block_size + 1).clamp(max=block_tables.size(1) - 1)
    return block_tables[seq_of_token, logical] * kv_block_size + positions % kv_block_size


@mutant("11")
def blocks_as_wide_as_the_table(block_tables, seq_of_token, positions, kv_block_size):
    block = block_tables[seq_of_token, positions // kv_block_size]
    return block * block_tables.size(1) + positions % kv_block_size


@mutant("11")
def block_rounded_up(block_tables, seq_of_token, positions, kv_block_size):
    logical = torch.ceil(positions / kv_block_size).long().clamp(max=block_tables.size(1) - 1)
    return block_tables[seq_of_token, logical] * kv_block_size + positions % kv_block_size


@mutant("11")
def first_block_then_contiguous(block_tables, seq_of_token, positions, kv_block_size):
    return block_tables[seq_of_token, 0] * kv_block_size + positions


@mutant("11")
def block_size_from_the_table(block_tables, seq_of_token, positions, kv_block_size):
    size = block_tables.size(1)
    return block_tables[seq_of_token, positions // size] * size + positions % size


@alternative("11")
def table_indexed_block_first(block_tables, seq_of_token, positions, kv_block_size):
    block = block_tables.T[positions // kv_block_size, seq_of_token]
    return block * kv_block_size + positions % kv_block_size


@alternative("11")
def divmod_then_gather(block_tables, seq_of_token, positions, kv_block_size):
    logical, offset = (
        torch.div(positions, kv_block_size, rounding_mode="floor"),
        positions.remainder(kv_block_size),
    )
    rows = block_tables.index_select(0, seq_of_token)
    return rows.gather(1, logical[:, None])[:, 0] * kv_block_size + offset


# -- 12: schedule(scheduler) ----------------------------------------------------------------


def _schedule(scheduler, **mistake: bool):
    """The policy of rosecourse/solutions/ch12_schedule.py with one `mistake` in it."""
    from roseinfer.engine.scheduler import ScheduledBatch

    batch = ScheduledBatch()
    budget = scheduler.config.max_num_batched_tokens
    manager = scheduler.block_manager
    index = 0
    while index < len(scheduler.running) and budget > 0:
        seq = scheduler.running[index]
        num_new = seq.num_tokens - seq.num_computed_tokens
        if not mistake.get("running_uncapped"):
            num_new = min(num_new, budget)
        while not manager.can_grow(seq, seq.num_computed_tokens + num_new):
            victim = scheduler.running.pop(0 if mistake.get("oldest_preempted") else -1)
            scheduler._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                break
            if mistake.get("oldest_preempted"):
                index = max(index - 1, 0)
        else:
            manager.grow(seq, seq.num_computed_tokens + num_new)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= 0 if mistake.get("running_free") else num_new
            index += 1
    position = -1 if mistake.get("newest_waiting_first") else 0
    limit = scheduler.config.max_num_seqs + (1 if mistake.get("one_seq_too_many") else 0)
    stopped = bool(batch.preempted) and not mistake.get("admits_after_preempting")
    passed_over = []  # heads the pool could not take, when a later one may overtake them
    while not stopped and scheduler.waiting and budget > 0 and len(scheduler.running) < limit:
        seq = scheduler.waiting[position]
        cached = [] if mistake.get("no_prefix_cache") else manager.cached_prefix(seq.all_ids)
        num_cached = len(cached) * manager.kv_block_size
        num_new = min(seq.num_tokens - num_cached, budget)
        if mistake.get("whole_prompts_only") and num_new < seq.num_tokens - num_cached:
            break
        if not manager.can_start(cached, num_cached + num_new):
            if not mistake.get("blocked_head_overtaken"):
                break
            passed_over.append(scheduler.waiting.popleft())
            continue
        scheduler.waiting.remove(seq)
        manager.start(seq, cached, num_cached + num_new)
        scheduler.running.append(seq)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)
        budget -= num_new + (num_cached if mistake.get("cached_tokens_charged") else 0)
    scheduler.waiting.extendleft(reversed(passed_over))
    if mistake.get("sorted_by_request_id"):
        scheduler.running.sort(key=lambda seq: seq.request_id)  # "r10" < "r2"
    else:
        scheduler.running.sort(key=scheduler.arrival_order.__getitem__)
    return batch


@mutant("12")
def oldest_preempted(scheduler):
    return _schedule(scheduler, oldest_preempted=True)


@mutant("12")
def running_free(scheduler):
    return _schedule(scheduler, running_free=True)


@mutant("12")
def newest_waiting_first(scheduler):
    return _schedule(scheduler, newest_waiting_first=True)


@mutant("12")
def one_seq_too_many(scheduler):
    return _schedule(scheduler, one_seq_too_many=True)


@mutant("12")
def running_uncapped(scheduler):
    return _schedule(scheduler, running_uncapped=True)


@mutant("12")
def no_prefix_cache(scheduler):
    return _schedule(scheduler, no_prefix_cache=True)


@mutant("12")
def whole_prompts_only(scheduler):
    return _schedule(scheduler, whole_prompts_only=True)


@mutant("12")
def running_sorted_by_request_id(scheduler):
    return _schedule(scheduler, sorted_by_request_id=True)


@mutant("12")
def admits_after_preempting(scheduler):
    return _schedule(scheduler, admits_after_preempting=True)


@mutant("12")
def blocked_head_overtaken(scheduler):
    return _schedule(scheduler, blocked_head_overtaken=True)


@mutant("12")
def cached_tokens_charged(scheduler):
    return _schedule(scheduler, cached_tokens_charged=True)


@alternative("12")
def the_policy_written_out(scheduler):
    return _schedule(scheduler)


# -- 13: cached_prefix(manager, token_ids) --------------------------------------------------


def _lookup(manager, token_ids, blocks: int, key: Callable, size: int | None = None):
    from roseinfer.engine.block_manager import chain_hash

    size = size or manager.kv_block_size
    found, parent = [], b""
    for i in range(blocks):
        tokens = tuple(token_ids[i * size : (i + 1) * size])
        parent = key(chain_hash, parent, tokens, token_ids[: (i + 1) * size])
        block_id = manager.cached.get(parent)
        if block_id is None or manager.blocks[block_id].token_ids != tokens:
            break
        found.append(block_id)
    return found


def _chained(chain_hash, parent, tokens, prefix):
    return chain_hash(parent, tokens)


@mutant("13")
def one_block_fewer(manager, token_ids):
    return _lookup(manager, token_ids, manager.lookup_blocks(len(token_ids)) - 1, _chained)


@mutant("13")
def blocks_of_four(manager, token_ids):
    blocks = (len(token_ids) - 1) // 4
    return _lookup(manager, token_ids, blocks, _chained, size=4)


@mutant("13")
def keyed_by_the_whole_prefix(manager, token_ids):
    blocks = manager.lookup_blocks(len(token_ids))
    return _lookup(manager, token_ids, blocks, lambda h, parent, t, prefix: h(b"", tuple(prefix)))


@mutant("13")
def parent_never_moves(manager, token_ids):
    from roseinfer.engine.block_manager import chain_hash

    found = []
    for i in range(manager.lookup_blocks(len(token_ids))):
        size = manager.kv_block_size
        tokens = tuple(token_ids[i * size : (i + 1) * size])
        block_id = manager.cached.get(chain_hash(chain_hash(b"", tuple(token_ids[:size])), tokens))
        if i and block_id is None:
            break
        found.append(manager.cached.get(chain_hash(b"", tokens)) if i == 0 else block_id)
    return [block for block in found if block is not None]


@mutant("13")
def last_block_dropped(manager, token_ids):
    return _lookup(manager, token_ids, manager.lookup_blocks(len(token_ids)), _chained)[:-1]


@mutant("13")
def first_block_only(manager, token_ids):
    return _lookup(manager, token_ids, min(manager.lookup_blocks(len(token_ids)), 1), _chained)


@mutant("13")
def skips_a_missing_block(manager, token_ids):
    # A block not found is skipped and the run goes on: a later block still cached after
    # its block 0 was evicted is served without the blocks before it.
    from roseinfer.engine.block_manager import chain_hash

    size, found, parent = manager.kv_block_size, [], b""
    for i in range(manager.lookup_blocks(len(token_ids))):
        tokens = tuple(token_ids[i * size : (i + 1) * size])
        parent = chain_hash(parent, tokens)
        block_id = manager.cached.get(parent)
        if block_id is not None and manager.blocks[block_id].token_ids == tokens:
            found.append(block_id)
    return found


@alternative("13")
def while_loop(manager, token_ids):
    from roseinfer.engine.block_manager import chain_hash

    size, key, found = manager.kv_block_size, b"", []
    while len(found) < manager.lookup_blocks(len(token_ids)):
        tokens = tuple(token_ids[len(found) * size : (len(found) + 1) * size])
        key = chain_hash(key, tokens)
        if key not in manager.cached or manager.blocks[manager.cached[key]].token_ids != tokens:
            return found
        found.append(manager.cached[key])
    return found


# -- 14: held_back(text, stops) ---------------------------------------------------------------


@mutant("14")
def first_letter_only(text, stops):
    return 1 if any(stop and text.endswith(stop[0]) for stop in stops) else 0


@mutant("14")
def shortest_tail(text, stops):
    lengths = [n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])]
    return min(lengths, default=0)


@mutant("14")
def beginning_of_the_text(text, stops):
    lengths = [n for stop in stops for n in range(1, len(stop)) if text.startswith(stop[:n])]
    return max(lengths, default=0)


@mutant("14")
def whole_stop_minus_one(text, stops):
    begins = any(text.endswith(stop[:n]) for stop in stops for n in range(1, len(stop)))
    return max((len(stop) - 1 for stop in stops), default=0) if begins else 0


@mutant("14")
def last_stop_wins(text, stops):
    held = 0
    for stop in stops:
        held = next(
            (n for n in range(min(len(stop) - 1, len(text)), 0, -1) if text.endswith(stop[:n])), 0
        )
    return held


@mutant("14")
def one_character_short(text, stops):
    lengths = [n for stop in stops for n in range(1, len(stop) - 1) if text.endswith(stop[:n])]
    return max(lengths, default=0)


@alternative("14")
def suffixes_of_the_text(text, stops):
    return max(
        (
            n
            for n in range(1, len(text) + 1)
            for stop in stops
            if len(stop) > n and stop.startswith(text[-n:])
        ),
        default=0,
    )


# -- 15: export_prepare(cache, batch, q_len, device) ----------------------------------------


def _prepared(cache, q_len, device, mask=None, positions=None, padding=None):
    from rosetrainer.model import causal_mask, padding_mask

    kv_len = cache.attention_mask.size(1)
    mask = causal_mask(q_len, kv_len, device) if mask is None else mask
    padding = cache.attention_mask if padding is None else padding
    return cache.position_ids if positions is None else positions, padding_mask(mask, padding)


@mutant("15")
def padding_only(cache, batch, q_len, device):
    kv_len = cache.attention_mask.size(1)
    return _prepared(cache, q_len, device, mask=torch.ones(q_len, kv_len, dtype=torch.bool))


@mutant("15")
def graph_positions_from_zero(cache, batch, q_len, device):
    positions = torch.arange(q_len, device=device)[None, :].expand(batch, q_len)
    return _prepared(cache, q_len, device, positions=positions)


@mutant("15")
def mask_of_the_new_tokens(cache, batch, q_len, device):
    from rosetrainer.model import causal_mask

    mask = causal_mask(q_len, q_len, device)
    return _prepared(cache, q_len, device, padding=cache.attention_mask[:, -q_len:], mask=mask)


@mutant("15")
def inverted_mask(cache, batch, q_len, device):
    positions, mask = _prepared(cache, q_len, device)
    return positions, ~mask


@mutant("15")
def first_row_padding_for_all(cache, batch, q_len, device):
    padding = cache.attention_mask[:1].expand_as(cache.attention_mask)
    return _prepared(cache, q_len, device, padding=padding)


@mutant("15")
def positions_one_late(cache, batch, q_len, device):
    return _prepared(cache, q_len, device, positions=cache.position_ids + 1)


@alternative("15")
def mask_built_by_hand(cache, batch, q_len, device):
    kv_len = cache.attention_mask.size(1)
    causal = torch.ones(kv_len, kv_len, dtype=torch.bool, device=device).tril()[kv_len - q_len :]
    mask = causal[None, None] & cache.attention_mask[:, None, None, :].bool()
    return cache.position_ids, mask | ~mask.any(-1, keepdim=True)


# -- 16: stage_forward(stage, x, cache) ----------------------------------------------------


def _stage(stage, x, cache, **mistake: bool):
    batch, q_len = x.shape[:2]
    past = cache.seq_len
    positions, mask = cache.prepare(batch, q_len, x.device)
    if mistake.get("positions_from_zero"):
        positions = torch.arange(q_len)[None, :].expand(batch, q_len)
    if mistake.get("positions_from_the_cache_length"):  # padding counted
        positions = torch.arange(past, past + q_len)[None, :].expand(batch, q_len)
    if mistake.get("row_0_positions"):
        positions = positions[:1].expand(batch, q_len)
    if mistake.get("no_mask"):
        mask = None  # plain causal attention: aligned top-left, and padding seen
    if mistake.get("row_0_mask") and mask is not None and mask.dim() == 4:
        mask = mask[:1]
    parts = stage.transformer
    if stage.is_first:
        position_part = 0 if mistake.get("no_positions") else parts.wpe(positions)
        x = parts.drop(parts.wte(x) + position_part)
    blocks = parts.h[:1] if mistake.get("first_block_only") else parts.h
    for local, block in enumerate(blocks):
        x = block(x, mask, cache, local)
    if mistake.get("ln_f_everywhere"):
        x = parts.ln_f(x) if stage.is_last else stage.transformer.h[0].ln_1(x)
    if stage.is_last:
        x = x if mistake.get("ln_f_everywhere") else parts.ln_f(x)
        if mistake.get("head_on_every_row"):  # not a mistake: more work, the same answer
            return stage.lm_head(x)[:, -1]
        row = 0 if mistake.get("first_position") else -1
        return x[:, row, :] if mistake.get("no_head") else stage.lm_head(x[:, row, :])
    return x


@mutant("16")
def stage_positions_from_zero(stage, x, cache):
    return _stage(stage, x, cache, positions_from_zero=True)


@mutant("16")
def no_positions(stage, x, cache):
    return _stage(stage, x, cache, no_positions=True)


@mutant("16")
def first_block_of_the_stage_only(stage, x, cache):
    return _stage(stage, x, cache, first_block_only=True)


@mutant("16")
def normalised_between_stages(stage, x, cache):
    return _stage(stage, x, cache, ln_f_everywhere=True)


@mutant("16")
def first_position(stage, x, cache):
    return _stage(stage, x, cache, first_position=True)


@mutant("16")
def no_head(stage, x, cache):
    return _stage(stage, x, cache, no_head=True)


@mutant("16")
def blocks_given_no_mask(stage, x, cache):
    return _stage(stage, x, cache, no_mask=True)


@mutant("16")
def positions_from_the_cache_length(stage, x, cache):
    return _stage(stage, x, cache, positions_from_the_cache_length=True)


@mutant("16")
def row_0_positions_for_every_row(stage, x, cache):
    return _stage(stage, x, cache, row_0_positions=True)


@mutant("16")
def row_0_mask_for_every_row(stage, x, cache):
    return _stage(stage, x, cache, row_0_mask=True)


@alternative("16")
def head_on_every_row_then_the_last(stage, x, cache):
    return _stage(stage, x, cache, head_on_every_row=True)


# -- 17: quantize(x, bits, group_size, dim) ---------------------------------------------------


def _quantized(x, bits, group_size, dim, *, to_half=None, rounding=torch.round, **mistake):
    from roseinfer.cache.quantized import Quantized, _to_float16

    to_half = to_half or _to_float16
    levels = 2**bits - 1
    moved = x.float().movedim(dim, -1)
    if mistake.get("strided_groups"):  # every n-th number in a group, not n in a row
        groups = moved.unflatten(-1, (group_size, -1)).transpose(-1, -2)
    else:
        groups = moved.unflatten(-1, (-1, group_size))
    low = (
        groups.amax(-1, keepdim=True)
        if mistake.get("zero_at_max")
        else groups.amin(-1, keepdim=True)
    )
    zero = to_half(low, -float("inf"))
    base = low if mistake.get("unrounded_minimum") else zero.float()
    scale = to_half((groups.amax(-1, keepdim=True) - base) / levels, float("inf"))
    divisor = torch.where(scale == 0, 1.0, scale.float())
    codes = rounding((groups - zero.float()) / divisor).clamp(0, levels)
    codes = codes.to(torch.int64 if mistake.get("long_codes") else torch.uint8)
    if mistake.get("strided_groups"):
        codes = codes.transpose(-1, -2)
    return Quantized(
        codes.flatten(-2).movedim(-1, dim),
        scale.squeeze(-1).movedim(-1, dim),
        zero.squeeze(-1).movedim(-1, dim),
    )


def _nearest_half(t, direction):
    return t.to(torch.float16)


@mutant("17")
def float16_to_nearest(x, bits, group_size, dim):
    return _quantized(x, bits, group_size, dim, to_half=_nearest_half)


@mutant("17")
def rounded_up(x, bits, group_size, dim):
    return _quantized(x, bits, group_size, dim, rounding=torch.ceil)


@mutant("17")
def zero_at_the_maximum(x, bits, group_size, dim):
    return _quantized(x, bits, group_size, dim, zero_at_max=True)


@mutant("17")
def strided_groups(x, bits, group_size, dim):
    return _quantized(x, bits, group_size, dim, strided_groups=True)


@mutant("17")
def scale_from_the_unrounded_minimum(x, bits, group_size, dim):
    return _quantized(x, bits, group_size, dim, unrounded_minimum=True)


@mutant("17")
def codes_in_int64(x, bits, group_size, dim):
    return _quantized(x, bits, group_size, dim, long_codes=True)


@alternative("17")
def quantized_as_written_out(x, bits, group_size, dim):
    return _quantized(x, bits, group_size, dim)


# -- 20: choice_mask(vocab, choices, prefix, eot_id) ----------------------------------------


def _choice_mask(vocab, choices, prefix, eot_id, fits=None, wanted=None, eot=None):
    """The contract's mask, with one of its parts swapped: whether the output with a
    token's bytes added `fits` a choice, the choices `wanted` as bytes, end-of-text."""
    wanted = wanted or [c.encode() for c in choices]
    fits = fits or (lambda choice, text: choice.startswith(text))
    allowed = [any(fits(c, prefix + token) for c in wanted) for token in vocab]
    allowed[eot_id] = eot(wanted, prefix) if eot else prefix in wanted
    return torch.tensor(allowed)


@mutant("20")
def end_of_text_id_of_gpt2(vocab, choices, prefix, eot_id):
    return _choice_mask(vocab, choices, prefix, 50256)


@mutant("20")
def first_choice_only(vocab, choices, prefix, eot_id):
    return _choice_mask(vocab, choices[:1], prefix, eot_id)


@mutant("20")
def completing_token_forbidden(vocab, choices, prefix, eot_id):
    return _choice_mask(
        vocab, choices, prefix, eot_id, fits=lambda c, t: c.startswith(t) and c != t
    )


@mutant("20")
def choice_inside_the_output(vocab, choices, prefix, eot_id):
    return _choice_mask(vocab, choices, prefix, eot_id, fits=lambda c, t: t.startswith(c))


@mutant("20")
def end_of_text_whenever_on_a_choice(vocab, choices, prefix, eot_id):
    return _choice_mask(
        vocab, choices, prefix, eot_id, eot=lambda wanted, p: any(c.startswith(p) for c in wanted)
    )


@mutant("20")
def bytes_that_do_not_decode_dropped(vocab, choices, prefix, eot_id):
    def text(data: bytes) -> bytes:
        return data.decode("utf-8", errors="ignore").encode()

    return _choice_mask([text(token) for token in vocab], choices, text(prefix), eot_id)


@mutant("20")
def ids_one_off(vocab, choices, prefix, eot_id):
    return _choice_mask(vocab, choices, prefix, eot_id).roll(1)


@mutant("20")
def spaces_stripped(vocab, choices, prefix, eot_id):
    return _choice_mask([token.strip() for token in vocab], choices, prefix, eot_id)


@mutant("20")
def last_choice_decides(vocab, choices, prefix, eot_id):
    return _choice_mask(vocab, choices[-1:], prefix, eot_id)


@mutant("20")
def choices_encoded_in_latin_1(vocab, choices, prefix, eot_id):
    wanted = [c.encode("latin-1", errors="replace") for c in choices]
    return _choice_mask(vocab, choices, prefix, eot_id, wanted=wanted)


@mutant("20")
def end_of_text_found_by_its_gpt2_name(vocab, choices, prefix, eot_id):
    eot = vocab.index(b"<|endoftext|>") if b"<|endoftext|>" in vocab else eot_id
    wanted = [c.encode() for c in choices]
    allowed = [
        t != eot and any(c.startswith(prefix + tok) for c in wanted) for t, tok in enumerate(vocab)
    ]
    allowed[eot] = prefix in wanted
    return torch.tensor(allowed)


@mutant("20")
def decided_on_text_decoded_ignoring_errors(vocab, choices, prefix, eot_id):
    # Half a character dropped: "no" + b"\xc3" reads as "no".
    text = prefix.decode("utf-8", errors="ignore")
    allowed = [
        any(c.startswith((prefix + token).decode("utf-8", errors="ignore")) for c in choices)
        for token in vocab
    ]
    allowed[eot_id] = text in choices
    return torch.tensor(allowed)


@mutant("20")
def end_of_text_is_the_last_token(vocab, choices, prefix, eot_id):
    return _choice_mask(vocab, choices, prefix, len(vocab) - 1)


@mutant("20")
def end_of_text_decided_on_decoded_text(vocab, choices, prefix, eot_id):
    # The tokens right, end-of-text allowed when the text read so far is a whole choice.
    def whole(wanted, prefix):
        return prefix.decode("utf-8", errors="ignore") in choices

    return _choice_mask(vocab, choices, prefix, eot_id, eot=whole)


@alternative("20")
def choice_mask_by_lookup(vocab, choices, prefix, eot_id):
    # Each open choice's rest, cut after every byte, looked up among the tokens: no loop
    # over the vocabulary (the tokens are all different).
    ids = {token: t for t, token in enumerate(vocab) if t != eot_id}
    allowed = torch.zeros(len(vocab), dtype=torch.bool)
    for choice in (c.encode() for c in choices):
        if choice.startswith(prefix):
            rest = choice[len(prefix) :]
            for end in range(1, len(rest) + 1):
                if rest[:end] in ids:
                    allowed[ids[rest[:end]]] = True
            allowed[eot_id] |= not rest
    return allowed


@alternative("20")
def choice_mask_on_latin_1_text(vocab, choices, prefix, eot_id):
    # Latin-1 reads every byte as one character: strings compare as the bytes would.
    wanted = [c.encode().decode("latin-1") for c in choices]
    text = prefix.decode("latin-1")
    allowed = [any(c.startswith(text + t.decode("latin-1")) for c in wanted) for t in vocab]
    allowed[eot_id] = text in wanted
    return torch.tensor(allowed)


# -- 21: grouped_attention(q, k, v, attn_mask) --------------------------------------------


def _grouped(q, k, v, attn_mask, scale=None, fill=-math.inf, keep_float32=False, mask=None):
    """The contract's attention (a group's queries as a view), with one part swapped: the
    scale, what a hidden key's score becomes, the output's dtype, how the mask is read."""
    b, n_head, _, d = q.shape
    scores = q.view(b, k.size(1), -1, d) @ k.transpose(-2, -1) * (scale or d**-0.5)
    if attn_mask is not None:
        scores = scores.masked_fill(mask(attn_mask) if mask else ~attn_mask, fill)
    weights = torch.softmax(scores.float(), dim=-1)
    out = weights @ v.float() if keep_float32 else weights.to(v.dtype) @ v
    return out.reshape(b, n_head, 1, d)


@mutant("21")
def scaled_by_head_dim_not_its_root(q, k, v, attn_mask):
    return _grouped(q, k, v, attn_mask, scale=1 / q.size(-1))


@mutant("21")
def hidden_keys_scored_zero(q, k, v, attn_mask):
    return _grouped(q, k, v, attn_mask, fill=0.0)


@mutant("21")
def mask_read_upside_down(q, k, v, attn_mask):
    return _grouped(q, k, v, attn_mask, mask=lambda allowed: allowed)


@mutant("21")
def output_left_in_float32(q, k, v, attn_mask):
    return _grouped(q, k, v, attn_mask, keep_float32=True)


@mutant("21")
def group_of_three_hard_coded(q, k, v, attn_mask):
    # Chapter 21's model has groups of 3 (6 heads over 2), and so does this view.
    b, n_head, _, d = q.shape
    scores = q.view(b, -1, 3, d) @ k.transpose(-2, -1) / math.sqrt(d)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -math.inf)
    return (torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v).reshape(b, n_head, 1, d)


@mutant("21")
def first_key_value_head_for_all(q, k, v, attn_mask):
    return _grouped(q, k[:, :1].expand_as(k), v[:, :1].expand_as(v), attn_mask)


@mutant("21")
def last_key_left_out(q, k, v, attn_mask):
    mask = None if attn_mask is None else attn_mask[..., :-1]
    return _grouped(q, k[:, :, :-1], v[:, :, :-1], mask)


@mutant("21")
def mask_of_the_first_row_for_every_row(q, k, v, attn_mask):
    return _grouped(q, k, v, None if attn_mask is None else attn_mask[:1])


@alternative("21")
def both_repeat_interleaved(q, k, v, attn_mask):
    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


@alternative("21")
def sdpa_with_groups(q, k, v, attn_mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)


@alternative("21")
def by_einsum(q, k, v, attn_mask):
    b, n_head, _, d = q.shape
    queries = q.view(b, k.size(1), n_head // k.size(1), d)
    scores = torch.einsum("bkgd,bksd->bkgs", queries, k) / math.sqrt(d)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -math.inf)
    weights = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.einsum("bkgs,bksd->bkgd", weights, v).reshape(b, n_head, 1, d)


@alternative("21")
def head_by_head(q, k, v, attn_mask):
    group = q.size(1) // k.size(1)
    outputs = []
    for h in range(q.size(1)):
        scores = q[:, h] @ k[:, h // group].transpose(-2, -1) / math.sqrt(q.size(-1))
        if attn_mask is not None:  # (B, 1, 1, S) or (1, S): (B or 1, 1, S), as scores
            scores = scores.masked_fill(~attn_mask.reshape(-1, 1, k.size(2)), -math.inf)
        weights = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        outputs.append(weights @ v[:, h // group])
    return torch.stack(outputs, dim=1)


# == The builds: wrong answers written as code ===============================================
#
# Each is the build's reference solution (rosecourse/solutions/build_NAME.py) with one
# class or function replaced by the code below. A replacing function runs with the
# learner module's globals (so it builds the StaticCache the check swaps in), a replacing
# class may subclass the reference's. tests/test_builds.py asserts that each fails a part
# of its build, and that each alternative passes every part.

BUILD_MUTANTS: dict[str, list[tuple[str, dict[str, object]]]] = {}
BUILD_ALTERNATIVES: dict[str, list[tuple[str, dict[str, object]]]] = {}


def build_mutant(build: str, replaces: str, name: str | None = None) -> Callable:
    """Register the decorated function or class as a wrong answer: the reference with
    `replaces` (a module-level name, or "Class.method") swapped for it. Registered again
    under the same name, it replaces that piece too (one mistake in two places)."""

    def register(obj: Callable) -> Callable:
        mutants = BUILD_MUTANTS.setdefault(build, [])
        key = name or obj.__name__
        same = [replacements for named, replacements in mutants if named == key]
        if same:
            assert replaces not in same[0], f"{build}: {key} replaces {replaces} twice"
            same[0][replaces] = obj
        else:
            mutants.append((key, {replaces: obj}))
        return obj

    return register


def build_alternative(build: str, replaces: str, name: str | None = None) -> Callable:
    """Register the decorated function or class as an answer that meets the contract."""

    def register(obj: Callable) -> Callable:
        BUILD_ALTERNATIVES.setdefault(build, []).append((name or obj.__name__, {replaces: obj}))
        return obj

    return register


# -- build cached_loop: StaticLayer, StaticCache, generate_cached ---------------------------
# These functions run with the learner module's globals: StaticCache is whatever the
# module holds under that name (rose's own static cache while the loop is checked).

END_OF_TEXT = 50256  # GPT-2's <|endoftext|>


def _padded(prompts: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    longest = max(map(len, prompts))
    pads = [longest - len(p) for p in prompts]
    return torch.tensor([[0] * pad + p for pad, p in zip(pads, prompts, strict=True)]), pads


@build_mutant("cached_loop", "generate_cached")
def loop_without_a_cache(model, prompts, max_new_tokens, prefill_chunk=None):
    # The whole sequence through the model every step, one prompt at a time: right tokens,
    # and no cache at all.
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_new_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(prompt) :])
    return out


@build_mutant("cached_loop", "generate_cached")
def one_prompt_at_a_time(model, prompts, max_new_tokens, prefill_chunk=None):
    out = []
    with torch.no_grad():
        for prompt in prompts:
            cache = StaticCache(model, 1, len(prompt) + max_new_tokens)  # noqa: F821
            ids = torch.tensor([prompt])
            chunk = prefill_chunk or len(prompt)
            for start in range(0, len(prompt), chunk):
                logits = model(ids[:, start : start + chunk], cache=cache).logits[:, -1]
            tokens = []
            for _ in range(max_new_tokens):
                tokens.append(int(logits.argmax()))
                logits = model(torch.tensor([[tokens[-1]]]), cache=cache).logits[:, -1]
            out.append(tokens)
    return out


def _cached_loop(model, prompts, max_new_tokens, chunks, stop=None):
    """The reference's loop with the prefill split as `chunks(longest)` says and an
    optional stop(new_tokens) -> bool checked after every step."""
    ids, pads = _padded(prompts)
    longest = ids.size(1)
    cache = StaticCache(model, len(prompts), longest + max_new_tokens, pads)  # noqa: F821
    with torch.no_grad():
        start = 0
        for size in chunks(longest):
            logits = model(ids[:, start : start + size], cache=cache).logits[:, -1]
            start += size
        new_tokens = [[] for _ in prompts]
        for step in range(max_new_tokens):
            next_ids = logits.argmax(dim=-1)
            for row, token in zip(new_tokens, next_ids.tolist(), strict=True):
                row.append(token)
            if stop is not None and stop(new_tokens):
                break
            if step + 1 < max_new_tokens:
                logits = model(next_ids[:, None], cache=cache).logits[:, -1]
    return new_tokens


@build_mutant("cached_loop", "generate_cached")
def prefill_ignores_the_chunk(model, prompts, max_new_tokens, prefill_chunk=None):
    return _cached_loop(model, prompts, max_new_tokens, lambda n: [n])


@build_mutant("cached_loop", "generate_cached")
def stops_at_end_of_text(model, prompts, max_new_tokens, prefill_chunk=None):
    def chunks(n):
        size = prefill_chunk or n
        return [min(size, n - s) for s in range(0, n, size)]

    return _cached_loop(
        model, prompts, max_new_tokens, chunks, lambda rows: END_OF_TEXT in rows[0][-1:]
    )


@build_mutant("cached_loop", "generate_cached")
def prefill_leaves_the_last_token(model, prompts, max_new_tokens, prefill_chunk=None):
    # All but the last prompt token in one call, the last fed as a first decode step.
    return _cached_loop(model, prompts, max_new_tokens, lambda n: [n - 1, 1])


@build_mutant("cached_loop", "generate_cached")
def a_fresh_cache_every_step(model, prompts, max_new_tokens, prefill_chunk=None):
    # A cache, but rebuilt and refilled with the whole sequence every step.
    ids, pads = _padded(prompts)
    new_tokens = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            cache = StaticCache(model, len(prompts), ids.size(1), pads)  # noqa: F821
            next_ids = model(ids, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
            new_tokens.append(next_ids)
            ids = torch.cat([ids, next_ids], dim=1)
    return torch.cat(new_tokens, dim=1).tolist()


@build_mutant("cached_loop", "generate_cached")
def cache_for_the_prefill_alone(model, prompts, max_new_tokens, prefill_chunk=None):
    # The prompts through the cache, then every decode step over each whole sequence.
    ids, pads = _padded(prompts)
    cache = StaticCache(model, len(prompts), ids.size(1), pads)  # noqa: F821
    with torch.no_grad():
        first = model(ids, cache=cache).logits[:, -1].argmax(-1).tolist()
    out = []
    for prompt, token in zip(prompts, first, strict=True):
        seq = [*prompt, token]
        with torch.no_grad():
            for _ in range(max_new_tokens - 1):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        out.append(seq[len(prompt) :])
    return out


@build_mutant("cached_loop", "generate_cached")
def each_row_stops_at_end_of_text(model, prompts, max_new_tokens, prefill_chunk=None):
    def chunks(n):
        size = prefill_chunk or n
        return [min(size, n - s) for s in range(0, n, size)]

    rows = _cached_loop(model, prompts, max_new_tokens, chunks)
    return [row[: row.index(END_OF_TEXT) + 1] if END_OF_TEXT in row else row for row in rows]


@build_mutant("cached_loop", "generate_cached")
def the_last_prompt_tokens_alone_when_chunked(model, prompts, max_new_tokens, prefill_chunk=None):
    # Chunks of prefill_chunk, but a remainder shorter than a chunk fed a token a call.
    def chunks(n):
        size = prefill_chunk or n
        whole = [size] * (n // size)
        return whole + [1] * (n - sum(whole))

    return _cached_loop(model, prompts, max_new_tokens, chunks)


@build_mutant("cached_loop", "StaticCache", name="buffers_in_the_default_dtype")
class DefaultDtypeCache(reference_cached_loop.StaticCache):
    def __init__(self, model, batch_size, max_len, pad_lengths=None):
        super().__init__(model, batch_size, max_len, pad_lengths)
        for layer in self.layers:  # torch.zeros(shape): float32 whatever the model's dtype
            layer.k, layer.v = torch.zeros(layer.k.shape), torch.zeros(layer.v.shape)


@build_mutant("cached_loop", "StaticCache", name="values_in_the_default_dtype")
class DefaultDtypeValues(reference_cached_loop.StaticCache):
    def __init__(self, model, batch_size, max_len, pad_lengths=None):
        super().__init__(model, batch_size, max_len, pad_lengths)
        for layer in self.layers:
            layer.v = torch.zeros(layer.v.shape)


class _CastingLayer(reference_cached_loop.StaticLayer):
    def update(self, input_pos, k, v):
        self.k[:, :, input_pos] = k.to(self.k.dtype)
        self.v[:, :, input_pos] = v.to(self.v.dtype)
        return self.k.to(k.dtype), self.v.to(v.dtype)  # cast back: the dtype looks right


@build_mutant("cached_loop", "StaticCache", name="float32_buffers_cast_back")
class Float32BuffersCastBack(reference_cached_loop.StaticCache):
    def __init__(self, model, batch_size, max_len, pad_lengths=None):
        super().__init__(model, batch_size, max_len, pad_lengths)
        self.layers = [
            _CastingLayer(torch.zeros(layer.k.shape), torch.zeros(layer.v.shape))
            for layer in self.layers
        ]


@build_mutant("cached_loop", "StaticCache", name="padding_queries_see_nothing")
class PaddingQueriesSeeNothing(reference_cached_loop.StaticCache):
    def prepare(self, batch, q_len, device):
        self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
        self.filled += q_len
        slots = torch.arange(self.max_len, device=device)
        causal = slots[None, :] <= self.input_pos[:, None]
        mask = causal[None, None, :, :] & self.real[:, None, None, :]  # all False: NaN rows
        pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)
        return pos, mask


@build_alternative("cached_loop", "generate_cached")
def loop_that_feeds_the_last_token_too(model, prompts, max_new_tokens, prefill_chunk=None):
    # Remainder first, logits of the last position alone, and one decode call a token
    # (the last one's logits unused): a cached loop all the same.
    ids, pads = _padded(prompts)
    longest = ids.size(1)
    size = prefill_chunk or longest
    cache = StaticCache(model, len(prompts), longest + max_new_tokens, pads)  # noqa: F821
    cuts = [0, *range(longest % size or size, longest + 1, size)]
    out = []
    with torch.inference_mode():
        for start, end in zip(cuts, cuts[1:], strict=False):
            logits = model.forward(idx=ids[:, start:end], cache=cache, last_only=True).logits
        for _ in range(max_new_tokens):
            out.append(logits[:, -1].argmax(-1, keepdim=True))
            logits = model(out[-1], cache=cache, last_only=True).logits
    return torch.cat(out, dim=1).tolist()


@build_alternative("cached_loop", "StaticCache", name="padding_queries_see_themselves")
class PaddingQueriesSeeThemselves(reference_cached_loop.StaticCache):
    def prepare(self, batch, q_len, device):
        self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
        self.filled += q_len
        slots = torch.arange(self.max_len, device=device)
        causal = slots[None, :] <= self.input_pos[:, None]
        mask = causal[None, None, :, :] & self.real[:, None, None, :]
        # A padding slot's query sees its own slot alone (no NaN, and nothing real).
        own = slots[None, :] == self.input_pos[:, None]  # (q_len, max_len)
        padding_query = self.input_pos[None, :] < self.pads[:, None]  # (B, q_len)
        mask = mask | (own[None, None] & padding_query[:, None, :, None])
        pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)
        return pos, mask


# -- build verify: accept_or_resample, verify_sampled (chapter 19) ---------------------------
# These run with the learner module's globals: score, accept_or_resample.


@build_mutant("verify", "accept_or_resample")
def rule_draws_from_the_global_rng(p, q, drafted, generator):
    if torch.rand(()) * q[drafted] < p[drafted]:  # no generator: the global RNG
        return drafted, True
    residual = (p - q).clamp(min=0)
    return int(torch.multinomial(residual, 1)), False


def _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus):
    """The reference's verify_sampled with the rule at each place replaced by
    judge(p_i, q_i, drafted, i) -> (token, kept) and the bonus by bonus(p, q) -> token."""
    with torch.no_grad():
        held = cache.seq_len
        p = torch.softmax(score(target, cache, last_token, drafts), dim=-1)  # noqa: F821
        tokens = []
        for i, drafted in enumerate(drafts):
            token, kept = judge(p[i], draft_probs[i].float(), drafted, i)
            tokens.append(token)
            if not kept:
                break
        else:
            tokens.append(bonus(p[len(drafts)], draft_probs[-1] if drafts else None))
        cache.truncate(held + len(tokens))
    return tokens


@build_mutant("verify", "verify_sampled")
def bonus_from_the_global_rng(target, cache, last_token, drafts, draft_probs, generator):
    def judge(p, q, drafted, i):
        return accept_or_resample(p, q, drafted, generator)  # noqa: F821

    def bonus(p, q):
        return int(torch.multinomial(p, 1))  # no generator: the global RNG

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_mutant("verify", "verify_sampled")
def one_uniform_for_the_step(target, cache, last_token, drafts, draft_probs, generator):
    u = torch.rand((), generator=generator)  # drawn once, read at every place

    def judge(p, q, drafted, i):
        if u * q[drafted] < p[drafted]:
            return drafted, True
        residual = (p - q).clamp(min=0)
        return int(torch.multinomial(residual, 1, generator=generator)), False

    def bonus(p, q):
        return int(torch.multinomial(p, 1, generator=generator))

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_mutant("verify", "verify_sampled")
def residual_drawn_from_p(target, cache, last_token, drafts, draft_probs, generator):
    # The rule written inline, a rejection drawing its token from p itself.
    def judge(p, q, drafted, i):
        if torch.rand((), generator=generator) * q[drafted] < p[drafted]:
            return drafted, True
        return int(torch.multinomial(p, 1, generator=generator)), False

    def bonus(p, q):
        return int(torch.multinomial(p, 1, generator=generator))

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_mutant("verify", "verify_sampled")
def sampled_step_judged_greedily(target, cache, last_token, drafts, draft_probs, generator):
    # A draft kept when it is p's argmax, the argmax taken in place of one that is not;
    # only the bonus sampled.
    def judge(p, q, drafted, i):
        best = int(p.argmax())
        return best, best == drafted

    def bonus(p, q):
        return int(torch.multinomial(p, 1, generator=generator))

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_mutant("verify", "verify_sampled")
def bonus_from_the_draft_distribution(target, cache, last_token, drafts, draft_probs, generator):
    def judge(p, q, drafted, i):
        return accept_or_resample(p, q, drafted, generator)  # noqa: F821

    def bonus(p, q):  # q: the last draft's distribution, not the target's after it
        return int(torch.multinomial(p if q is None else q.float(), 1, generator=generator))

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_mutant("verify", "verify_sampled")
def global_rng_seeded_from_the_generator(target, cache, last_token, drafts, draft_probs, generator):
    # Reproducible under one seed, but it draws from (and reseeds) the global RNG.
    torch.manual_seed(int(torch.randint(2**31, (), generator=generator)))

    def judge(p, q, drafted, i):
        if torch.rand(()) * q[drafted] < p[drafted]:
            return drafted, True
        residual = (p - q).clamp(min=0)
        return int(torch.multinomial(residual, 1)), False

    def bonus(p, q):
        return int(torch.multinomial(p, 1))

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_mutant("verify", "verify_sampled")
def rejected_place_keeps_its_draft_distribution(
    target, cache, last_token, drafts, draft_probs, generator
):
    # On a rejection, the token is drawn from max(0, q - p): what the drafter over-offers.
    def judge(p, q, drafted, i):
        if torch.rand((), generator=generator) * q[drafted] < p[drafted]:
            return drafted, True
        residual = (q - p).clamp(min=0)
        return int(torch.multinomial(residual, 1, generator=generator)), False

    def bonus(p, q):
        return int(torch.multinomial(p, 1, generator=generator))

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_alternative("verify", "verify_sampled")
def every_uniform_drawn_at_once(target, cache, last_token, drafts, draft_probs, generator):
    # One uniform per draft, all drawn together before any is read: right.
    uniforms = torch.rand(len(drafts), generator=generator)

    def judge(p, q, drafted, i):
        if uniforms[i] * q[drafted] < p[drafted]:
            return drafted, True
        residual = (p - q).clamp(min=0)
        return int(torch.multinomial(residual, 1, generator=generator)), False

    def bonus(p, q):
        return int(torch.multinomial(p, 1, generator=generator))

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_alternative("verify", "accept_or_resample")
def uniform_drawn_only_when_needed(p, q, drafted, generator):
    # p >= q keeps the draft for sure: no draw then; the residual by inverse CDF.
    ratio = float(p[drafted]) / float(q[drafted]) if float(q[drafted]) > 0 else 1.0
    if ratio >= 1 or float(torch.rand(1, generator=generator, dtype=torch.float64)) < ratio:
        return drafted, True
    cdf = (p - q).clamp(min=0).double().cumsum(0)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp(max=len(p) - 1)), False


# -- build training_step: AdamW, train_step (chapter 00) -------------------------------------
# These run with the learner module's globals: learning_rate, clip_gradients, math, torch.


def _train_step(model, optimizer, batches, step, cfg, norm_of):
    """The reference's train_step, its returned norm norm_of(norm before clipping,
    max_norm, model)."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, cfg)  # noqa: F821
    total = 0.0
    for _ in range(cfg.grad_accum_steps):
        x, y = next(batches)
        loss = model(x, y).loss / cfg.grad_accum_steps
        loss.backward()
        total += loss.item()
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    norm = clip_gradients(model.parameters(), max_norm)  # noqa: F821
    returned = norm_of(norm, max_norm, model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, returned


@build_mutant("training_step", "train_step")
def norm_zero_when_not_clipped(model, optimizer, batches, step, cfg):
    return _train_step(
        model,
        optimizer,
        batches,
        step,
        cfg,
        lambda norm, max_norm, m: norm if cfg.grad_clip else 0.0,
    )


@build_mutant("training_step", "train_step")
def norm_measured_after_clipping(model, optimizer, batches, step, cfg):
    def after(norm, max_norm, m):
        grads = [p.grad for p in m.parameters() if p.grad is not None]
        return float(torch.stack([g.norm() for g in grads]).norm())

    return _train_step(model, optimizer, batches, step, cfg, after)


@build_mutant("training_step", "train_step")
def norm_capped_at_the_threshold(model, optimizer, batches, step, cfg):
    return _train_step(
        model, optimizer, batches, step, cfg, lambda norm, max_norm, m: min(norm, max_norm)
    )


@build_mutant("training_step", "train_step")
def norm_per_micro_batch(model, optimizer, batches, step, cfg):
    return _train_step(
        model, optimizer, batches, step, cfg,
        lambda norm, max_norm, m: norm / cfg.grad_accum_steps,
    )  # fmt: skip


@build_mutant("training_step", "train_step")
def gradients_cleared_first(model, optimizer, batches, step, cfg):
    # Cleared at the start of the step instead of after it: the same updates, and the
    # gradients left set on return.
    optimizer.zero_grad(set_to_none=True)
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, cfg)  # noqa: F821
    total = 0.0
    for _ in range(cfg.grad_accum_steps):
        x, y = next(batches)
        loss = model(x, y).loss / cfg.grad_accum_steps
        loss.backward()
        total += loss.item()
    norm = clip_gradients(model.parameters(), cfg.grad_clip or math.inf)  # noqa: F821
    optimizer.step()
    return total, norm


@build_mutant("training_step", "clip_gradients")
def clip_iterates_the_parameters_twice(parameters, max_norm):
    # Right for a list; a generator (model.parameters()) is empty the second time round.
    norm = torch.stack([p.grad.norm() for p in parameters if p.grad is not None]).norm().item()
    if max_norm / (norm + 1e-6) < 1.0:
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(max_norm / (norm + 1e-6))
    return norm


@build_mutant("training_step", "parameter_groups")
def frozen_parameters_grouped(model, weight_decay):
    params = list(model.parameters())  # those that do not require a gradient too
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


class _AdamReading(reference_training_step.AdamW):
    """The reference's AdamW with each group's settings read through `setting`."""

    def setting(self, group, name):
        return group[name]

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr = group["lr"]
            beta1, beta2 = self.setting(group, "betas")
            eps = self.setting(group, "eps")
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                state["t"] += 1
                t, m, v, grad = state["t"], state["m"], state["v"], p.grad
                p.mul_(1 - lr * group["weight_decay"])
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                p.sub_(lr * (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps))


@build_mutant("training_step", "AdamW", name="betas_from_the_constructor")
class BetasFromTheConstructor(_AdamReading):
    def setting(self, group, name):
        return self.defaults[name] if name == "betas" else group[name]


@build_mutant("training_step", "AdamW", name="eps_from_the_constructor")
class EpsFromTheConstructor(_AdamReading):
    def setting(self, group, name):
        return self.defaults[name] if name == "eps" else group[name]


@build_mutant("training_step", "AdamW", name="settings_kept_from_the_constructor")
class SettingsKeptFromTheConstructor(_AdamReading):
    # betas and eps copied onto the optimizer when it is built, as plain attributes.
    def __init__(self, params, lr, betas, eps=1e-8, weight_decay=0.0):
        super().__init__(params, lr, betas, eps, weight_decay)
        self.betas, self.eps = betas, eps

    def setting(self, group, name):
        return getattr(self, name)


@build_alternative("training_step", "AdamW", name="adam_reading_every_group_setting")
class AdamReadingEveryGroupSetting(_AdamReading):
    pass


# -- build model: CausalSelfAttention, MLP, Block, GPT (chapter 00) --------------------------
# The contract: the model runs without dropout (config.dropout is 0 here), in train mode too.


@build_mutant("model", "Block", name="dropout_hard_coded_on")
class DropoutHardCodedOn(reference_model.Block):
    def __init__(self, config):
        super().__init__(config)
        self.dropout = nn.Dropout(0.1)  # nanoGPT's value, whatever the config says

    def forward(self, x):
        x = x + self.dropout(self.attn(self.ln_1(x)))
        return x + self.dropout(self.mlp(self.ln_2(x)))


@build_mutant("model", "CausalSelfAttention", name="attention_weights_dropped")
class AttentionWeightsDropped(reference_model.CausalSelfAttention):
    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (
            t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            for t in self.c_attn(x).split(C, dim=2)
        )
        y = nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=0.1 if self.training else 0.0
        )
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


@build_mutant("model", "GPT", name="embeddings_dropped")
class EmbeddingsDropped(reference_model.GPT):
    def __init__(self, config):
        super().__init__(config)
        self.drop = nn.Dropout(0.1)

    def forward(self, idx):
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


@build_mutant("model", "MLP", name="dropout_defaulted_when_zero")
class DropoutDefaultedWhenZero(reference_model.MLP):
    def __init__(self, config):
        super().__init__(config)
        self.dropout = nn.Dropout(config.dropout or 0.1)

    def forward(self, x):
        return self.dropout(super().forward(x))


@build_alternative("model", "Block", name="dropout_read_from_the_config")
class DropoutReadFromTheConfig(reference_model.Block):
    # Dropout as rose's model has it, at config.dropout (0 here): right.
    def __init__(self, config):
        super().__init__(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = x + self.dropout(self.attn(self.ln_1(x)))
        return x + self.dropout(self.mlp(self.ln_2(x)))


# -- build block_manager: BlockManager (chapters 11-13) ---------------------------------------

_chain_hash = reference_block_manager.chain_hash


@build_mutant("block_manager", "BlockManager", name="cache_version_never_changes")
class CacheVersionNeverChanges(reference_block_manager.BlockManager):
    # the mistake: keys enter and leave `cached`, and cache_version stays 0 (the scheduler
    # keeps serving a waiting request its first lookup's blocks)
    cache_version = property(lambda self: 0, lambda self, value: None)


@build_mutant("block_manager", "BlockManager", name="lookup_skips_a_missing_block")
class LookupSkipsAMissingBlock(reference_block_manager.BlockManager):
    def cached_prefix(self, token_ids):
        found, parent, size = [], b"", self.kv_block_size
        for i in range(self.lookup_blocks(len(token_ids))):
            tokens = tuple(token_ids[i * size : (i + 1) * size])
            parent = _chain_hash(parent, tokens)
            block_id = self.cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                continue  # on to the next block: the table no longer lines up with the text
            found.append(block_id)
        return found


class _AdvanceOf(reference_block_manager.BlockManager):
    """The reference's advance, the blocks keyed up to keyed_end(seq) tokens, each keyed by
    tokens_of(seq, i)."""

    def keyed_end(self, seq):
        return seq.num_computed_tokens

    def tokens_of(self, seq, i):
        return tuple(seq.all_ids[i * self.kv_block_size : (i + 1) * self.kv_block_size])

    def keying(self):
        return self.enable_prefix_caching

    def advance(self, seq, num_new):
        seq.num_computed_tokens += num_new
        if not self.keying():
            return
        while len(seq.block_hashes) < self.keyed_end(seq) // self.kv_block_size:
            i = len(seq.block_hashes)
            tokens = self.tokens_of(seq, i)
            key = _chain_hash(seq.block_hashes[-1] if seq.block_hashes else b"", tokens)
            seq.block_hashes.append(key)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and key not in self.cached:
                block.hash, block.token_ids = key, tokens
                self.cached[key] = block.block_id
                self.cache_version += 1


@build_mutant("block_manager", "BlockManager", name="generated_blocks_never_cached")
class GeneratedBlocksNeverCached(_AdvanceOf):
    def keyed_end(self, seq):
        return min(seq.num_computed_tokens, len(seq.prompt_ids))


@build_mutant("block_manager", "BlockManager", name="blocks_keyed_from_the_prompt_alone")
class BlocksKeyedFromThePromptAlone(_AdvanceOf):
    def tokens_of(self, seq, i):
        return tuple(seq.prompt_ids[i * self.kv_block_size : (i + 1) * self.kv_block_size])


@build_mutant("block_manager", "BlockManager", name="blocks_keyed_with_prefix_caching_off")
class BlocksKeyedWithPrefixCachingOff(_AdvanceOf):
    def keying(self):
        return True  # lookup_blocks still finds nothing without prefix caching


@build_mutant("block_manager", "BlockManager", name="evicted_keys_left_in_the_map")
class EvictedKeysLeftInTheMap(reference_block_manager.BlockManager):
    def grow(self, seq, num_tokens):
        while len(seq.block_table) * self.kv_block_size < num_tokens:
            if self.free_ids:
                block_id = self.free_ids.pop()
            else:
                block_id, _ = self.evictable.popitem(last=False)
                block = self.blocks[block_id]
                block.hash, block.token_ids = None, ()  # its key left in self.cached
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)


@build_mutant("block_manager", "BlockManager", name="queries_counted_by_the_tokens_to_hold")
class QueriesCountedByTheTokensToHold(reference_block_manager.BlockManager):
    def start(self, seq, cached_ids, num_tokens):
        queries = self.prefix_cache_queries + self.lookup_blocks(num_tokens)
        super().start(seq, cached_ids, num_tokens)
        self.prefix_cache_queries = queries  # by the tokens this start holds, not the text's


@build_mutant("block_manager", "BlockManager", name="hits_counted_at_lookup")
class HitsCountedAtLookup(reference_block_manager.BlockManager):
    def cached_prefix(self, token_ids):
        found = super().cached_prefix(token_ids)
        self.prefix_cache_hits += len(found)  # a lookup that starts nothing counted too
        return found

    def start(self, seq, cached_ids, num_tokens):
        hits = self.prefix_cache_hits
        super().start(seq, cached_ids, num_tokens)
        self.prefix_cache_hits = hits


@build_mutant("block_manager", "BlockManager", name="unkeyed_blocks_kept_evictable")
class UnkeyedBlocksKeptEvictable(reference_block_manager.BlockManager):
    def release(self, seq):
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:  # every block kept for later, keyed or not
                self.evictable[block_id] = None
        seq.block_table, seq.block_hashes, seq.num_computed_tokens = [], [], 0


@build_mutant("block_manager", "BlockManager", name="num_used_sums_ref_counts")
class NumUsedSumsRefCounts(reference_block_manager.BlockManager):
    @property
    def num_used(self):
        return sum(block.ref_count for block in self.blocks)  # a shared block counted twice


# == The builds: wrong answers first written as edits of the reference's text ==============
#
# Each is the reference solution (rosecourse/solutions/build_NAME.py) with the method or
# function named in its decorator written wrong: "# the mistake" marks the line. A mutant
# that replaces two pieces is registered twice under one name.


# -- build model: CausalSelfAttention, MLP, Block, GPT -----------------------------------


@build_mutant("model", "CausalSelfAttention.forward")
def scaled_by_sqrt_n_embd(self, x: torch.Tensor) -> torch.Tensor:
    B, T, C = x.shape
    head_dim = C // self.n_head
    q, k, v = self.c_attn(x).split(C, dim=2)
    # (B, T, C) -> (B, n_head, T, head_dim): each head its own (T, head_dim) matrix.
    q = q.view(B, T, self.n_head, head_dim).transpose(1, 2)
    k = k.view(B, T, self.n_head, head_dim).transpose(1, 2)
    v = v.view(B, T, self.n_head, head_dim).transpose(1, 2)
    # the mistake: was `scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)`
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(C)
    # Query i (a row) may read key j (a column) only when j <= i: the lower triangle.
    allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    y = torch.softmax(scores, dim=-1) @ v
    # Back to (B, T, C): the heads side by side along the features.
    y = y.transpose(1, 2).contiguous().view(B, T, C)
    return self.c_proj(y)


@build_mutant("model", "CausalSelfAttention.forward")
def softmax_over_queries(self, x: torch.Tensor) -> torch.Tensor:
    B, T, C = x.shape
    head_dim = C // self.n_head
    q, k, v = self.c_attn(x).split(C, dim=2)
    # (B, T, C) -> (B, n_head, T, head_dim): each head its own (T, head_dim) matrix.
    q = q.view(B, T, self.n_head, head_dim).transpose(1, 2)
    k = k.view(B, T, self.n_head, head_dim).transpose(1, 2)
    v = v.view(B, T, self.n_head, head_dim).transpose(1, 2)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
    # Query i (a row) may read key j (a column) only when j <= i: the lower triangle.
    allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    # the mistake: was `y = torch.softmax(scores, dim=-1) @ v`
    y = torch.softmax(scores, dim=-2) @ v
    # Back to (B, T, C): the heads side by side along the features.
    y = y.transpose(1, 2).contiguous().view(B, T, C)
    return self.c_proj(y)


@build_mutant("model", "CausalSelfAttention.forward")
def keys_first(self, x: torch.Tensor) -> torch.Tensor:
    B, T, C = x.shape
    head_dim = C // self.n_head
    # the mistake: was `q, k, v = self.c_attn(x).split(C, dim=2)`
    k, q, v = self.c_attn(x).split(C, dim=2)
    # (B, T, C) -> (B, n_head, T, head_dim): each head its own (T, head_dim) matrix.
    q = q.view(B, T, self.n_head, head_dim).transpose(1, 2)
    k = k.view(B, T, self.n_head, head_dim).transpose(1, 2)
    v = v.view(B, T, self.n_head, head_dim).transpose(1, 2)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
    # Query i (a row) may read key j (a column) only when j <= i: the lower triangle.
    allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    y = torch.softmax(scores, dim=-1) @ v
    # Back to (B, T, C): the heads side by side along the features.
    y = y.transpose(1, 2).contiguous().view(B, T, C)
    return self.c_proj(y)


@build_mutant("model", "CausalSelfAttention.forward")
def heads_joined_without_transpose(self, x: torch.Tensor) -> torch.Tensor:
    B, T, C = x.shape
    head_dim = C // self.n_head
    q, k, v = self.c_attn(x).split(C, dim=2)
    # (B, T, C) -> (B, n_head, T, head_dim): each head its own (T, head_dim) matrix.
    q = q.view(B, T, self.n_head, head_dim).transpose(1, 2)
    k = k.view(B, T, self.n_head, head_dim).transpose(1, 2)
    v = v.view(B, T, self.n_head, head_dim).transpose(1, 2)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
    # Query i (a row) may read key j (a column) only when j <= i: the lower triangle.
    allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    y = torch.softmax(scores, dim=-1) @ v
    # Back to (B, T, C): the heads side by side along the features.
    # the mistake: was `y = y.transpose(1, 2).contiguous().view(B, T, C)`
    y = y.reshape(B, T, C)
    return self.c_proj(y)


@build_mutant("model", "Block.forward")
def attention_without_residual(self, x: torch.Tensor) -> torch.Tensor:
    # the mistake: was `x = x + self.attn(self.ln_1(x))`
    x = self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_2(x))


@build_mutant("model", "Block.forward")
def ln_2_for_attention(self, x: torch.Tensor) -> torch.Tensor:
    # the mistake: was `x = x + self.attn(self.ln_1(x))`
    x = x + self.attn(self.ln_2(x))
    return x + self.mlp(self.ln_2(x))


@build_mutant("model", "GPT.forward")
def no_final_layer_norm(self, idx: torch.Tensor) -> torch.Tensor:
    T = idx.size(1)
    positions = torch.arange(T, device=idx.device)
    x = self.transformer.wte(idx) + self.transformer.wpe(positions)
    for block in self.transformer.h:
        x = block(x)
    # the mistake: was `return self.lm_head(self.transformer.ln_f(x))`
    return self.lm_head(x)


@build_mutant("model", "CausalSelfAttention.forward")
def query_blind_to_itself(self, x: torch.Tensor) -> torch.Tensor:
    B, T, C = x.shape
    head_dim = C // self.n_head
    q, k, v = self.c_attn(x).split(C, dim=2)
    # (B, T, C) -> (B, n_head, T, head_dim): each head its own (T, head_dim) matrix.
    q = q.view(B, T, self.n_head, head_dim).transpose(1, 2)
    k = k.view(B, T, self.n_head, head_dim).transpose(1, 2)
    v = v.view(B, T, self.n_head, head_dim).transpose(1, 2)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
    # Query i (a row) may read key j (a column) only when j <= i: the lower triangle.
    # the mistake: was `allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()`
    allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril(-1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    y = torch.softmax(scores, dim=-1) @ v
    # Back to (B, T, C): the heads side by side along the features.
    y = y.transpose(1, 2).contiguous().view(B, T, C)
    return self.c_proj(y)


@build_mutant("model", "MLP.forward")
def relu(self, x: torch.Tensor) -> torch.Tensor:
    # the mistake: was `return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))`
    return self.c_proj(F.relu(self.c_fc(x)))


@build_mutant("model", "Block.__init__", name="layer_norm_eps_1e_6")
def layer_norm_eps_1e_6_block__init(self, config: GPTConfig) -> None:
    nn.Module.__init__(self)
    # the mistake: was `self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)`
    self.ln_1 = nn.LayerNorm(config.n_embd, eps=1e-6, bias=config.bias)
    self.attn = CausalSelfAttention(config)
    # the mistake: was `self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)`
    self.ln_2 = nn.LayerNorm(config.n_embd, eps=1e-6, bias=config.bias)
    self.mlp = MLP(config)


@build_mutant("model", "GPT.__init__", name="layer_norm_eps_1e_6")
def layer_norm_eps_1e_6_gpt__init(self, config: GPTConfig) -> None:
    nn.Module.__init__(self)
    self.transformer = nn.ModuleDict(
        dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            # the mistake: was `ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),`
            ln_f=nn.LayerNorm(config.n_embd, eps=1e-6, bias=config.bias),
        )
    )
    self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
    self.lm_head.weight = self.transformer.wte.weight


@build_mutant("model", "GPT.__init__")
def final_layer_norm_eps_1e_6(self, config: GPTConfig) -> None:
    nn.Module.__init__(self)
    self.transformer = nn.ModuleDict(
        dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            # the mistake: was `ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),`
            ln_f=nn.LayerNorm(config.n_embd, eps=1e-6, bias=config.bias),
        )
    )
    self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
    self.lm_head.weight = self.transformer.wte.weight


# -- build training_step: AdamW, parameter_groups, learning_rate, clip_gradients, train_step


@build_mutant("training_step", "AdamW.step")
@torch.no_grad()
def adam_with_l2(self) -> None:
    for group in self.param_groups:
        lr, (beta1, beta2) = group["lr"], group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
            state["t"] += 1
            # the mistake: was `t, m, v, grad = state["t"], state["m"], state["v"], p.grad`
            t, m, v, grad = state["t"], state["m"], state["v"], p.grad + group["weight_decay"] * p
            # the mistake: `p.mul_(1 - lr * group["weight_decay"])` left out
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            m_hat = m / (1 - beta1**t)
            v_hat = v / (1 - beta2**t)
            p.sub_(lr * m_hat / (v_hat.sqrt() + group["eps"]))


@build_mutant("training_step", "AdamW.step")
@torch.no_grad()
def no_bias_correction(self) -> None:
    for group in self.param_groups:
        lr, (beta1, beta2) = group["lr"], group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
            state["t"] += 1
            m, v, grad = state["m"], state["v"], p.grad
            p.mul_(1 - lr * group["weight_decay"])
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            # the mistake: was `m_hat = m / (1 - beta1**t)`, t = state["t"]
            m_hat = m
            # the mistake: was `v_hat = v / (1 - beta2**t)`
            v_hat = v
            p.sub_(lr * m_hat / (v_hat.sqrt() + group["eps"]))


@build_mutant("training_step", "AdamW.step")
@torch.no_grad()
def eps_inside_the_root(self) -> None:
    for group in self.param_groups:
        lr, (beta1, beta2) = group["lr"], group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
            state["t"] += 1
            t, m, v, grad = state["t"], state["m"], state["v"], p.grad
            p.mul_(1 - lr * group["weight_decay"])
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            m_hat = m / (1 - beta1**t)
            v_hat = v / (1 - beta2**t)
            # the mistake: was `p.sub_(lr * m_hat / (v_hat.sqrt() + group["eps"]))`
            p.sub_(lr * m_hat / (v_hat + group["eps"]).sqrt())


@build_mutant("training_step", "AdamW.step")
@torch.no_grad()
def decay_before_the_rate_is_known(self) -> None:
    for group in self.param_groups:
        lr, (beta1, beta2) = group["lr"], group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
            state["t"] += 1
            t, m, v, grad = state["t"], state["m"], state["v"], p.grad
            # the mistake: was `p.mul_(1 - lr * group["weight_decay"])`
            p.mul_(1 - group["weight_decay"])
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            m_hat = m / (1 - beta1**t)
            v_hat = v / (1 - beta2**t)
            p.sub_(lr * m_hat / (v_hat.sqrt() + group["eps"]))


@build_mutant("training_step", "parameter_groups")
def everything_decays(model: nn.Module, weight_decay: float) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    # the mistake: was `decay = [p for p in params if p.dim() >= 2]`
    decay = params
    # the mistake: was `no_decay = [p for p in params if p.dim() < 2]`
    no_decay = []
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


@build_mutant("training_step", "train_step")
def gradients_never_cleared(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    step: int,
    cfg: TrainConfig,
) -> tuple[float, float]:
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, cfg)
    total = 0.0
    for _ in range(cfg.grad_accum_steps):
        x, y = next(batches)
        loss = model(x, y).loss / cfg.grad_accum_steps
        loss.backward()
        total += loss.item()
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    norm = clip_gradients(model.parameters(), max_norm)
    optimizer.step()
    # the mistake: `optimizer.zero_grad(set_to_none=True)` left out
    return total, norm


@build_mutant("training_step", "train_step")
def rate_never_set(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    step: int,
    cfg: TrainConfig,
) -> tuple[float, float]:
    # the mistake: `for group in optimizer.param_groups: group["lr"] = learning_rate(step,
    # cfg)` left out
    total = 0.0
    for _ in range(cfg.grad_accum_steps):
        x, y = next(batches)
        loss = model(x, y).loss / cfg.grad_accum_steps
        loss.backward()
        total += loss.item()
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    norm = clip_gradients(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, norm


@build_mutant("training_step", "learning_rate")
def cosine_to_zero(step: int, cfg: TrainConfig) -> float:
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    if step >= decay_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / (decay_steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    # the mistake: was `return cfg.min_lr + cosine * (cfg.learning_rate - cfg.min_lr)`
    return cosine * cfg.learning_rate


@build_mutant("training_step", "learning_rate")
def no_floor(step: int, cfg: TrainConfig) -> float:
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    # the mistake: `if step >= decay_steps: return cfg.min_lr` left out
    progress = (step - cfg.warmup_steps) / (decay_steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + cosine * (cfg.learning_rate - cfg.min_lr)


@build_mutant("training_step", "learning_rate")
def progress_from_step_0(step: int, cfg: TrainConfig) -> float:
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    if step >= decay_steps:
        return cfg.min_lr
    # the mistake: was `progress = (step - cfg.warmup_steps) / (decay_steps - cfg.warmup_steps)`
    progress = step / decay_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + cosine * (cfg.learning_rate - cfg.min_lr)


@build_mutant("training_step", "train_step")
def a_micro_batch_short(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    step: int,
    cfg: TrainConfig,
) -> tuple[float, float]:
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, cfg)
    total = 0.0
    # the mistake: was `for _ in range(cfg.grad_accum_steps):`
    for _ in range(cfg.grad_accum_steps - 1):
        x, y = next(batches)
        loss = model(x, y).loss / cfg.grad_accum_steps
        loss.backward()
        total += loss.item()
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    norm = clip_gradients(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, norm


@build_mutant("training_step", "clip_gradients")
def always_scaled(parameters: Iterable[nn.Parameter], max_norm: float) -> float:
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.stack([g.norm() for g in grads]).norm().item()  # the norm of the norms
    scale = max_norm / (norm + 1e-6)
    # the mistake: was `if scale < 1.0: for g in grads: g.mul_(scale)`
    for g in grads:
        g.mul_(scale)
    return norm


@build_mutant("training_step", "make_optimizer")
def betas_swapped(model: nn.Module, cfg: TrainConfig) -> AdamW:
    groups = parameter_groups(model, cfg.weight_decay)
    # the mistake: was `return AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2))`
    return AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta2, cfg.beta1))


@build_mutant("training_step", "train_step")
def last_micro_batch_loss(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    step: int,
    cfg: TrainConfig,
) -> tuple[float, float]:
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, cfg)
    total = 0.0
    for _ in range(cfg.grad_accum_steps):
        x, y = next(batches)
        loss = model(x, y).loss / cfg.grad_accum_steps
        loss.backward()
        # the mistake: was `total += loss.item()`
        total = loss.item()
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    norm = clip_gradients(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, norm


# -- build cached_loop: StaticLayer, StaticCache, generate_cached ------------------------


@build_mutant("cached_loop", "StaticLayer.update")
def written_out_of_place(
    self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # the mistake: was `self.k[:, :, input_pos] = k`
    self.k = self.k.index_copy(2, input_pos, k)
    # the mistake: was `self.v[:, :, input_pos] = v`
    self.v = self.v.index_copy(2, input_pos, v)
    return self.k, self.v


@build_mutant("cached_loop", "StaticCache.prepare", name="query_blind_to_itself")
def query_blind_to_itself_in_the_cache(
    self, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
    self.filled += q_len
    slots = torch.arange(self.max_len, device=device)
    # The rows input_pos of the full causal mask: the bottom q_len of filled rows.
    # the mistake: was `causal = slots[None, :] <= self.input_pos[:, None]`
    causal = slots[None, :] < self.input_pos[:, None]
    mask = causal[None, None, :, :] & self.real[:, None, None, :]
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)
    return pos, mask


@build_mutant("cached_loop", "StaticCache.prepare")
def filled_never_advances(
    self, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
    # the mistake: `self.filled += q_len` left out
    slots = torch.arange(self.max_len, device=device)
    # The rows input_pos of the full causal mask: the bottom q_len of filled rows.
    causal = slots[None, :] <= self.input_pos[:, None]
    mask = causal[None, None, :, :] & self.real[:, None, None, :]
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)
    return pos, mask


@build_mutant("cached_loop", "StaticCache.__init__")
def padding_taken_from_the_right(
    self, model: GPT, batch_size: int, max_len: int, pad_lengths: list[int] | None = None
) -> None:
    cfg = model.config
    weight = model.lm_head.weight
    shape = (batch_size, cfg.n_head, max_len, cfg.n_embd // cfg.n_head)
    self.layers = [
        StaticLayer(
            torch.zeros(shape, dtype=weight.dtype, device=weight.device),
            torch.zeros(shape, dtype=weight.dtype, device=weight.device),
        )
        for _ in range(cfg.n_layer)
    ]
    self.max_len = max_len
    self.filled = 0
    self.input_pos = torch.zeros(0, dtype=torch.long, device=weight.device)
    self.pads = torch.tensor(pad_lengths or [0] * batch_size, device=weight.device)
    slots = torch.arange(max_len, device=weight.device)
    # (B, max_len): the slot holds a real token of the row, not padding.
    # the mistake: was `self.real = slots[None, :] >= self.pads[:, None]`
    self.real = slots[None, :] < max_len - self.pads[:, None]


@build_mutant("cached_loop", "StaticCache.__init__")
def one_real_slot_masked(
    self, model: GPT, batch_size: int, max_len: int, pad_lengths: list[int] | None = None
) -> None:
    cfg = model.config
    weight = model.lm_head.weight
    shape = (batch_size, cfg.n_head, max_len, cfg.n_embd // cfg.n_head)
    self.layers = [
        StaticLayer(
            torch.zeros(shape, dtype=weight.dtype, device=weight.device),
            torch.zeros(shape, dtype=weight.dtype, device=weight.device),
        )
        for _ in range(cfg.n_layer)
    ]
    self.max_len = max_len
    self.filled = 0
    self.input_pos = torch.zeros(0, dtype=torch.long, device=weight.device)
    self.pads = torch.tensor(pad_lengths or [0] * batch_size, device=weight.device)
    slots = torch.arange(max_len, device=weight.device)
    # (B, max_len): the slot holds a real token of the row, not padding.
    # the mistake: was `self.real = slots[None, :] >= self.pads[:, None]`
    self.real = slots[None, :] > self.pads[:, None]


@build_mutant("cached_loop", "StaticCache.prepare")
def keeps_every_mask(
    self, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
    self.filled += q_len
    slots = torch.arange(self.max_len, device=device)
    # The rows input_pos of the full causal mask: the bottom q_len of filled rows.
    causal = slots[None, :] <= self.input_pos[:, None]
    mask = causal[None, None, :, :] & self.real[:, None, None, :]
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)
    # the mistake: was `return pos, mask`
    self.masks = [*getattr(self, "masks", []), mask]
    return pos, mask


@build_mutant("cached_loop", "generate_cached")
@torch.no_grad()
def argmax_over_rows(
    model: GPT, prompts: list[list[int]], max_new_tokens: int, prefill_chunk: int | None = None
) -> list[list[int]]:
    longest = max(len(prompt) for prompt in prompts)
    pads = [longest - len(prompt) for prompt in prompts]
    rows = [[0] * pad + prompt for pad, prompt in zip(pads, prompts, strict=True)]
    ids = torch.tensor(rows, device=model.lm_head.weight.device)
    cache = StaticCache(model, len(prompts), longest + max_new_tokens, pads)
    chunk = prefill_chunk or longest
    for start in range(0, longest, chunk):
        logits = model(ids[:, start : start + chunk], cache=cache).logits[:, -1]
    new_tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        # the mistake: was `next_ids = logits.argmax(dim=-1)`
        next_ids = logits.argmax(dim=0)
        for row, token in zip(new_tokens, next_ids.tolist(), strict=True):
            row.append(token)
        if step + 1 < max_new_tokens:  # the last token is never fed back
            logits = model(next_ids[:, None], cache=cache).logits[:, -1]
    return new_tokens


@build_mutant("cached_loop", "generate_cached")
@torch.no_grad()
def last_chunk_skipped(
    model: GPT, prompts: list[list[int]], max_new_tokens: int, prefill_chunk: int | None = None
) -> list[list[int]]:
    longest = max(len(prompt) for prompt in prompts)
    pads = [longest - len(prompt) for prompt in prompts]
    rows = [[0] * pad + prompt for pad, prompt in zip(pads, prompts, strict=True)]
    ids = torch.tensor(rows, device=model.lm_head.weight.device)
    cache = StaticCache(model, len(prompts), longest + max_new_tokens, pads)
    chunk = prefill_chunk or longest
    # the mistake: was `for start in range(0, longest, chunk):`
    for start in range(0, longest - chunk, chunk):
        logits = model(ids[:, start : start + chunk], cache=cache).logits[:, -1]
    new_tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        next_ids = logits.argmax(dim=-1)
        for row, token in zip(new_tokens, next_ids.tolist(), strict=True):
            row.append(token)
        if step + 1 < max_new_tokens:  # the last token is never fed back
            logits = model(next_ids[:, None], cache=cache).logits[:, -1]
    return new_tokens


@build_mutant("cached_loop", "generate_cached")
@torch.no_grad()
def prefill_logits_of_the_first_token(
    model: GPT, prompts: list[list[int]], max_new_tokens: int, prefill_chunk: int | None = None
) -> list[list[int]]:
    longest = max(len(prompt) for prompt in prompts)
    pads = [longest - len(prompt) for prompt in prompts]
    rows = [[0] * pad + prompt for pad, prompt in zip(pads, prompts, strict=True)]
    ids = torch.tensor(rows, device=model.lm_head.weight.device)
    cache = StaticCache(model, len(prompts), longest + max_new_tokens, pads)
    chunk = prefill_chunk or longest
    for start in range(0, longest, chunk):
        # the mistake: was `logits = model(ids[:, start : start + chunk], cache=cache).logits[:, -1]
        # new_tokens: list[list[int]] = [[] for _ in prompts]`
        logits = model(ids[:, start : start + chunk], cache=cache).logits[:, 0]
    new_tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        next_ids = logits.argmax(dim=-1)
        for row, token in zip(new_tokens, next_ids.tolist(), strict=True):
            row.append(token)
        if step + 1 < max_new_tokens:  # the last token is never fed back
            logits = model(next_ids[:, None], cache=cache).logits[:, -1]
    return new_tokens


# -- build block_manager: chain_hash, BlockManager ---------------------------------------


@build_mutant("block_manager", "chain_hash")
def key_without_separator(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    # the mistake: was `data = parent + b"|" + ",".join(map(str, token_ids)).encode()`
    data = parent + b"|" + "".join(map(str, token_ids)).encode()
    return hashlib.sha256(data).digest()


@build_mutant("block_manager", "BlockManager.release")
def released_first_block_first(self, seq: EngineSequence) -> None:
    # the mistake: was `for block_id in reversed(seq.block_table):`
    for block_id in seq.block_table:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self.evictable[block_id] = None
            else:
                self.free_ids.append(block_id)
    seq.block_table = []
    seq.block_hashes = []
    seq.num_computed_tokens = 0


@build_mutant("block_manager", "BlockManager.can_start")
def blocks_rounded_down(self, cached_ids: list[int], num_tokens: int) -> bool:
    unheld = sum(1 for block_id in cached_ids if self.blocks[block_id].ref_count == 0)
    # the mistake: was `needed = -(-num_tokens // self.kv_block_size) - len(cached_ids)`
    needed = num_tokens // self.kv_block_size - len(cached_ids)
    return needed <= self.num_free + len(self.evictable) - unheld


@build_mutant("block_manager", "BlockManager.grow")
def grows_a_block_too_many(self, seq: EngineSequence, num_tokens: int) -> None:
    # the mistake: was `while len(seq.block_table) * self.kv_block_size < num_tokens:`
    while len(seq.block_table) * self.kv_block_size <= num_tokens:
        if self.free_ids:
            block_id = self.free_ids.pop()
        else:
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self.cached[block.hash]
            self.cache_version += 1
            block.hash, block.token_ids = None, ()
        self.blocks[block_id].ref_count = 1
        seq.block_table.append(block_id)


@build_mutant("block_manager", "BlockManager.start")
def hits_not_counted(self, seq: EngineSequence, cached_ids: list[int], num_tokens: int) -> None:
    self.prefix_cache_queries += self.lookup_blocks(len(seq.all_ids))
    # the mistake: `self.prefix_cache_hits += len(cached_ids)` left out
    for block_id in cached_ids:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.evictable[block_id]
        block.ref_count += 1
    seq.block_table = list(cached_ids)
    seq.block_hashes = [self.blocks[block_id].hash for block_id in cached_ids]
    seq.num_computed_tokens = len(cached_ids) * self.kv_block_size
    if not seq.output_ids:
        seq.num_cached_tokens = seq.num_computed_tokens
    self.grow(seq, num_tokens)


@build_mutant("block_manager", "BlockManager.start")
def served_count_reset_on_restart(
    self, seq: EngineSequence, cached_ids: list[int], num_tokens: int
) -> None:
    self.prefix_cache_queries += self.lookup_blocks(len(seq.all_ids))
    self.prefix_cache_hits += len(cached_ids)
    for block_id in cached_ids:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.evictable[block_id]
        block.ref_count += 1
    seq.block_table = list(cached_ids)
    seq.block_hashes = [self.blocks[block_id].hash for block_id in cached_ids]
    seq.num_computed_tokens = len(cached_ids) * self.kv_block_size
    # the mistake: was `if not seq.output_ids: seq.num_cached_tokens = seq.num_computed_tokens`
    if True:
        seq.num_cached_tokens = seq.num_computed_tokens
    self.grow(seq, num_tokens)


@build_mutant("block_manager", "BlockManager.advance")
def cached_key_moved_to_the_copy(self, seq: EngineSequence, num_new: int) -> None:
    seq.num_computed_tokens += num_new
    if not self.enable_prefix_caching:
        return
    size = self.kv_block_size
    while len(seq.block_hashes) < seq.num_computed_tokens // size:
        i = len(seq.block_hashes)
        tokens = tuple(seq.all_ids[i * size : (i + 1) * size])
        key = chain_hash(seq.block_hashes[-1] if seq.block_hashes else b"", tokens)
        seq.block_hashes.append(key)
        block = self.blocks[seq.block_table[i]]
        # the mistake: was `if block.hash is None and key not in self.cached:`
        if block.hash is None:
            block.hash, block.token_ids = key, tokens
            self.cached[key] = block.block_id
            self.cache_version += 1


# -- build verify: RollbackCache, verify_greedy, accept_or_resample, verify_sampled ------


@build_mutant("verify", "RollbackCache.prepare")
def top_left_mask(
    self, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    past, kv_len = self.seq_len, self.seq_len + q_len
    query_pos = torch.arange(past, kv_len, device=device)
    key_pos = torch.arange(kv_len, device=device)
    # the mistake: was `return query_pos[None, :], key_pos[None, :] <= query_pos[:, None]`
    return query_pos[None, :], key_pos[None, :] <= query_pos[:, None] - past


@build_mutant("verify", "RollbackCache.prepare", name="positions_one_late")
def rollback_positions_one_late(
    self, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    past, kv_len = self.seq_len, self.seq_len + q_len
    # the mistake: was `query_pos = torch.arange(past, kv_len, device=device)`
    query_pos = torch.arange(past + 1, kv_len + 1, device=device)
    key_pos = torch.arange(kv_len, device=device)
    return query_pos[None, :], key_pos[None, :] <= query_pos[:, None]


@build_mutant("verify", "RollbackCache.truncate")
def truncate_keeps_one_more(self, n: int) -> None:
    # the mistake: was `self.past = [(k[:, :, :n], v[:, :, :n]) for k, v in self.past]`
    self.past = [(k[:, :, : n + 1], v[:, :, : n + 1]) for k, v in self.past]


@build_mutant("verify", "verify_greedy")
@torch.no_grad()
def rollback_one_too_far(
    target: GPT, cache: DenseKVCache | RollbackCache, last_token: int, drafts: list[int]
) -> list[int]:
    held = cache.seq_len
    choices = score(target, cache, last_token, drafts).argmax(dim=-1).tolist()
    accepted = 0
    for drafted, chosen in zip(drafts, choices, strict=False):
        if drafted != chosen:
            break
        accepted += 1
    tokens = drafts[:accepted] + [choices[accepted]]
    # the mistake: was `cache.truncate(held + len(tokens)) return tokens`
    cache.truncate(held + len(tokens) - 1)
    return tokens


@build_mutant("verify", "verify_greedy")
@torch.no_grad()
def drafts_read_against_the_next_row(
    target: GPT, cache: DenseKVCache | RollbackCache, last_token: int, drafts: list[int]
) -> list[int]:
    held = cache.seq_len
    choices = score(target, cache, last_token, drafts).argmax(dim=-1).tolist()
    accepted = 0
    # the mistake: was `for drafted, chosen in zip(drafts, choices, strict=False):`
    for drafted, chosen in zip(drafts, choices[1:], strict=False):
        if drafted != chosen:
            break
        accepted += 1
    tokens = drafts[:accepted] + [choices[accepted]]
    cache.truncate(held + len(tokens))
    return tokens


@build_mutant("verify", "verify_greedy")
@torch.no_grad()
def scored_one_token_a_call(
    target: GPT, cache: DenseKVCache | RollbackCache, last_token: int, drafts: list[int]
) -> list[int]:
    held = cache.seq_len
    # the mistake: was `choices = score(target, cache, last_token, drafts).argmax(dim=-1).tolist()`
    choices = [int(score(target, cache, t, []).argmax()) for t in [last_token, *drafts]]
    accepted = 0
    for drafted, chosen in zip(drafts, choices, strict=False):
        if drafted != chosen:
            break
        accepted += 1
    tokens = drafts[:accepted] + [choices[accepted]]
    cache.truncate(held + len(tokens))
    return tokens


@build_mutant("verify", "accept_or_resample")
def ratio_inverted(
    p: torch.Tensor, q: torch.Tensor, drafted: int, generator: torch.Generator
) -> tuple[int, bool]:
    u = torch.rand((), generator=generator)
    # the mistake: was `if u * q[drafted] < p[drafted]: # u < p / q, without dividing by a zero q`
    if u * p[drafted] < q[drafted]:  # u < p / q, without dividing by a zero q
        return drafted, True
    residual = (p - q).clamp(min=0)
    token = torch.multinomial(residual / residual.sum(), 1, generator=generator)
    return int(token), False


@build_mutant("verify", "accept_or_resample")
def residual_reversed(
    p: torch.Tensor, q: torch.Tensor, drafted: int, generator: torch.Generator
) -> tuple[int, bool]:
    u = torch.rand((), generator=generator)
    if u * q[drafted] < p[drafted]:  # u < p / q, without dividing by a zero q
        return drafted, True
    # the mistake: was `residual = (p - q).clamp(min=0)`
    residual = (q - p).clamp(min=0)
    token = torch.multinomial(residual / residual.sum(), 1, generator=generator)
    return int(token), False


@build_mutant("verify", "verify_sampled")
@torch.no_grad()
def bonus_from_the_last_draft_row(
    target: GPT,
    cache: DenseKVCache | RollbackCache,
    last_token: int,
    drafts: list[int],
    draft_probs: torch.Tensor,
    generator: torch.Generator,
) -> list[int]:
    held = cache.seq_len
    p = torch.softmax(score(target, cache, last_token, drafts), dim=-1)
    tokens = []
    for i, drafted in enumerate(drafts):
        token, kept = accept_or_resample(p[i], draft_probs[i].float(), drafted, generator)
        tokens.append(token)
        if not kept:
            break
    else:  # every draft kept: the bonus token
        # the mistake: was `tokens.append(int(torch.multinomial(p[len(drafts)], 1,
        # generator=generator)))`
        tokens.append(int(torch.multinomial(p[len(drafts) - 1], 1, generator=generator)))
    cache.truncate(held + len(tokens))
    return tokens


@build_mutant("verify", "verify_sampled")
@torch.no_grad()
def sampled_step_never_rolls_back(
    target: GPT,
    cache: DenseKVCache | RollbackCache,
    last_token: int,
    drafts: list[int],
    draft_probs: torch.Tensor,
    generator: torch.Generator,
) -> list[int]:
    p = torch.softmax(score(target, cache, last_token, drafts), dim=-1)
    tokens = []
    for i, drafted in enumerate(drafts):
        token, kept = accept_or_resample(p[i], draft_probs[i].float(), drafted, generator)
        tokens.append(token)
        if not kept:
            break
    else:  # every draft kept: the bonus token
        tokens.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator)))
    # the mistake: `cache.truncate(held + len(tokens))` left out (held: the cache's seq_len
    # before the pass), so the rejected drafts' keys stay
    return tokens


@build_mutant("verify", "verify_sampled")
@torch.no_grad()
def sampled_rows_shifted(
    target: GPT,
    cache: DenseKVCache | RollbackCache,
    last_token: int,
    drafts: list[int],
    draft_probs: torch.Tensor,
    generator: torch.Generator,
) -> list[int]:
    held = cache.seq_len
    p = torch.softmax(score(target, cache, last_token, drafts), dim=-1)
    tokens = []
    for i, drafted in enumerate(drafts):
        # the mistake: was `token, kept = accept_or_resample(p[i], draft_probs[i].float(), drafted,
        # generator)`
        token, kept = accept_or_resample(p[i + 1], draft_probs[i].float(), drafted, generator)
        tokens.append(token)
        if not kept:
            break
    else:  # every draft kept: the bonus token
        tokens.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator)))
    cache.truncate(held + len(tokens))
    return tokens


# == Written blind ===========================================================================
#
# tests/blind_mutants.py holds wrong answers written blind, by someone who had not read these
# lists nor the exercises' and builds' known wrong answers (issue 45): each registered with
# `blind` or `blind_build` below, as a mutant like the ones above, or, where the check names
# it as one of the known mistakes (the blind writer found that one too), with `known=` that
# mistake, whose diagnosis it must then get (tests/test_mutants.py, tests/test_builds.py).

BLIND: dict[str, list[str]] = {}  # chapter or build -> the names of its blind mutants
# chapter or build -> (name, the function or the replacements, the known mistake it is)
BLIND_KNOWN: dict[str, list[tuple[str, object, str]]] = {}


def blind(chapter: str, known: str | None = None) -> Callable[[Callable], Callable]:
    """Register a chapter's wrong answer written blind: a mutant, or the known mistake
    `known` written another way."""

    def register(fn: Callable) -> Callable:
        if known is None:
            taken = {other.__name__ for other in MUTANTS.get(chapter, [])}
            assert fn.__name__ not in taken, f"{chapter}: {fn.__name__} is a mutant already"
            mutant(chapter)(fn)
            BLIND.setdefault(chapter, []).append(fn.__name__)
        else:
            BLIND_KNOWN.setdefault(chapter, []).append((fn.__name__, fn, known))
        return fn

    return register


def blind_build(
    build: str, replaces: str, name: str | None = None, known: str | None = None
) -> Callable:
    """Register a build's wrong answer written blind, as `build_mutant` does (registered
    again under one name, it replaces that piece too), or as the known mistake `known`."""

    def register(obj: Callable) -> Callable:
        key = name or obj.__name__
        if known is None:
            names = BLIND.setdefault(build, [])
            taken = {named for named, _ in BUILD_MUTANTS.get(build, [])} - set(names)
            assert key not in taken, f"{build}: {key} is a mutant written with the lists read"
            build_mutant(build, replaces, key)(obj)
            names += [] if key in names else [key]
            return obj
        told = BLIND_KNOWN.setdefault(build, [])
        same = [replacements for named, replacements, _ in told if named == key]
        if same:
            same[0][replaces] = obj
        else:
            told.append((key, {replaces: obj}, known))
        return obj

    return register


import blind_mutants  # noqa: E402, F401  (registers them: kept apart, see its docstring)
import contract_mutants  # noqa: E402, F401  (the same: wrong answers by class, issue 54)
