"""Wrong answers written blind, by someone who had not read these lists (issue 45).

Their writer had read each exercise's and each build's contract (the stubs, the chapters),
but neither tests/mutants.py nor the known wrong answers of rosecourse/exercises and
rosecourse/builds. For each, they wrote the mistakes a learner seemed likely to make, and
said which in one line; that line is the `# WRONG:` comment above each answer here. They
are the suites' own mechanism (tests/mutants.py), registered with `blind` and
`blind_build`: a mutant, which must fail its check without being taken for a known mistake,
or, where the check names it as one of the known mistakes (its writer found that one too),
`known=` that mistake, whose diagnosis it must get.

A chapter's answer is its writer's own function, the mistake where they put it; answers of
one chapter that share a body share it here (`_blind_NN`), the mistake an argument. A
build's writer wrote the whole module; here the mistake is put into the build's reference
solution, in the method it was in (`# the mistake` marks the line), as tests/mutants.py
writes its own, so that a build has one reference its wrong answers are read against.

Left out, of the 126 written: three that compute what the reference computes on every input
the engine can give them, so that no check can fail them:
  12 no_final_sort     (`running` not sorted by arrival at the end of a step): running holds
                       the oldest requests in arrival order (preemption takes the newest,
                       and a preempted one waits ahead of every newer one), so the sort
                       never moves a sequence;
  17 zero_scale_nan    (no guard for a scale of 0): a constant group's codes come from
                       0 / 0, a NaN that the cast to uint8 makes 0, the right code;
  cached_loop chunk_remainder_first (the short prefill chunk first): the same calls, none
                       longer than prefill_chunk, in another order, an answer the suite
                       takes as right (mutants.loop_that_feeds_the_last_token_too).
Five others passed the checks when written and were caught by checks made since: 04's
positions made on the CPU whatever `device` says (a GPU's model fails), 05's unstable sort
(ties not by token order), 13's block found by its key alone (a collision), the model's
positions made on the CPU, and the block manager's can_start counting the evictable blocks
it is served as room to grow into.
"""

from __future__ import annotations

import hashlib
import math

import torch

# The names the builds' answers read (each runs with the learner module's globals: these
# are the reference's, for the reader and the linter).
from mutants import blind, blind_build
from torch import nn
from torch.nn import functional as F

from rosecourse.solutions import build_block_manager as reference_block_manager
from rosecourse.solutions.build_block_manager import chain_hash
from rosecourse.solutions.build_cached_loop import StaticCache, StaticLayer
from rosecourse.solutions.build_model import MLP, Block, CausalSelfAttention
from rosecourse.solutions.build_training_step import clip_gradients, learning_rate
from rosecourse.solutions.build_verify import accept_or_resample, score
from roseinfer.cache.quantized import Quantized, _to_float16
from roseinfer.engine.block_manager import BlockManager
from roseinfer.engine.scheduler import ScheduledBatch, Scheduler
from roseinfer.loops.export_onnx import ExportCache
from roseinfer.pipeline.stage import PipelineStage
from rosetrainer.config import GPTConfig
from rosetrainer.model import GPT, KVCache, causal_mask, padding_mask

# -- 00: causal_attention(q, k, v) --------------------------------------------------------


def _blind_00(q, k, v, scale: float, softmax_dim: int = -1):
    T = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) / scale
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=softmax_dim) @ v


# WRONG: scores not scaled at all
@blind("00", known="unscaled")
def no_scaling(q, k, v):
    return _blind_00(q, k, v, 1.0)


# WRONG: scores divided by head_dim, not its square root
@blind("00")
def scale_by_head_dim(q, k, v):
    return _blind_00(q, k, v, q.size(-1))


# WRONG: softmax taken over the query axis (dim=-2)
@blind("00", known="softmax_over_queries")
def softmax_over_queries(q, k, v):
    return _blind_00(q, k, v, math.sqrt(q.size(-1)), softmax_dim=-2)


# -- 01: greedy_decode(model, prompt_ids, max_new_tokens) ---------------------------------


def _blind_01(model: GPT, prompt_ids, steps: int, position: int = -1, with_prompt=False):
    device = model.lm_head.weight.device
    ids = list(prompt_ids)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids], device=device)).logits
            t = int(logits[0, position].argmax())
            ids.append(t)
            new.append(t)
    return ids if with_prompt else new


# WRONG: picks the argmax of the first position's logits, not the last
@blind("01", known="first_position")
def argmax_first_position(model, prompt_ids, max_new_tokens):
    return _blind_01(model, prompt_ids, max_new_tokens, position=0)


# WRONG: loop runs max_new_tokens - 1 times
@blind("01")
def loop_runs_one_short(model, prompt_ids, max_new_tokens):
    return _blind_01(model, prompt_ids, max_new_tokens - 1)


# WRONG: returns the prompt plus the new tokens
@blind("01", known="with_prompt")
def returns_prompt_too(model, prompt_ids, max_new_tokens):
    return _blind_01(model, prompt_ids, max_new_tokens, with_prompt=True)


# -- 02: concat_kv(layer_past, k, v) -------------------------------------------------------


# WRONG: keys concatenated, but only the new values returned (past values dropped)
@blind("02")
def keeps_only_new_values(layer_past, k, v):
    if layer_past is None:
        return k, v
    pk, pv = layer_past
    return torch.cat([pk, k], dim=2), v


# WRONG: new keys/values put before the past along time
@blind("02", known="new_first")
def new_before_past(layer_past, k, v):
    if layer_past is None:
        return k, v
    pk, pv = layer_past
    return torch.cat([k, pk], dim=2), torch.cat([v, pv], dim=2)


# WRONG: values concatenated with the new keys (typo k for v)
@blind("02")
def v_typo_uses_k(layer_past, k, v):
    if layer_past is None:
        return k, v
    pk, pv = layer_past
    return torch.cat([pk, k], dim=2), torch.cat([pv, k], dim=2)


# -- 03: causal_mask(q_len, kv_len, device) -------------------------------------------------


# WRONG: handles only decode (q_len 1: all True) and a full prefill; a chunk after a past
# gets the top-left triangle
@blind("03")
def only_decode_and_full(q_len, kv_len, device=None):
    if q_len == 1:
        return torch.ones(1, kv_len, dtype=torch.bool, device=device)
    qpos = torch.arange(q_len, device=device)
    kpos = torch.arange(kv_len, device=device)
    return kpos[None, :] <= qpos[:, None]


# WRONG: off by one: each query also sees the key after it
@blind("03")
def sees_next_key(q_len, kv_len, device=None):
    qpos = torch.arange(kv_len - q_len, kv_len, device=device)
    kpos = torch.arange(kv_len, device=device)
    return kpos[None, :] <= qpos[:, None] + 1


# WRONG: mask aligned top-left: tril of (q_len, kv_len)
@blind("03", known="top_left")
def top_left(q_len, kv_len, device=None):
    qpos = torch.arange(0, q_len, device=device)
    kpos = torch.arange(kv_len, device=device)
    return kpos[None, :] <= qpos[:, None]


# -- 04: position_ids(past_len, q_len, device) ----------------------------------------------


# WRONG: device argument ignored: positions always on the CPU
@blind("04", known="on_the_cpu")
def device_ignored(past_len, q_len, device=None):
    return torch.arange(past_len, past_len + q_len)


# WRONG: positions start at past_len - 1
@blind("04")
def off_by_one(past_len, q_len, device=None):
    return torch.arange(past_len - 1, past_len + q_len - 1, device=device).clamp(min=0)


# WRONG: positions restart at 0 every call (past ignored)
@blind("04", known="from_zero")
def restart_at_zero(past_len, q_len, device=None):
    return torch.arange(q_len, device=device)


# -- 05: top_p_filter(logits, p) ----------------------------------------------------------


def _blind_05(logits, p, order_of=None, kept_mass=lambda cumsum, probs: cumsum - probs):
    """The writer's answer; `order_of(logits)`, when given, is (sorted logits, order)."""
    if p >= 1.0:
        return logits
    if order_of is None:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    else:
        sorted_logits, order = order_of(logits)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = kept_mass(torch.cumsum(probs, dim=-1), probs)
    drop_sorted = before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


# WRONG: treats logits as one flat vector (only the chapter's (vocab,) example works): batch
# rows share one nucleus
@blind("05")
def flat_1d_only(logits, p):
    return _blind_05(logits.reshape(-1), p).reshape(logits.shape)


# WRONG: maps the sorted mask back with a gather (drop_sorted[order]) instead of a scatter
@blind("05")
def gather_not_scatter(logits, p):
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    drop_sorted = torch.cumsum(probs, dim=-1) - probs >= p
    return logits.masked_fill(drop_sorted.gather(-1, order), float("-inf"))


# WRONG: keeps a token while the mass up to and including it is below p: drops the token
# that crosses p
@blind("05")
def inclusive_cumsum(logits, p):
    return _blind_05(logits, p, kept_mass=lambda cumsum, probs: cumsum)


# WRONG: sorted ascending then flipped: equal logits ordered by descending token id (ties
# broken the wrong way)
@blind("05")
def ties_reversed(logits, p):
    def flipped(x):
        sorted_logits, order = torch.sort(x, dim=-1, stable=True)
        return sorted_logits.flip(-1), order.flip(-1)

    return _blind_05(logits, p, order_of=flipped)


# WRONG: sort not stable: ties not broken by token order (argsort of negated logits)
@blind("05")
def unstable_sort(logits, p):
    def argsorted(x):
        order = torch.argsort(-x, dim=-1)
        return x.gather(-1, order), order

    return _blind_05(logits, p, order_of=argsorted)


# -- 06: static_update(k_buffer, v_buffer, input_pos, k_new, v_new) ----------------------


# WRONG: writes only the last new token into slot input_pos[0] (right for the decode
# example, q_len 1; wrong for a prefill)
@blind("06")
def decode_shape_only(k_buffer, v_buffer, input_pos, k_new, v_new):
    s = int(input_pos[0])
    k_buffer[:, :, s] = k_new[:, :, -1]
    v_buffer[:, :, s] = v_new[:, :, -1]
    return k_buffer, v_buffer


# WRONG: index_copy (out of place): returns new tensors, the buffers are never written
@blind("06", known="into_a_copy")
def out_of_place(k_buffer, v_buffer, input_pos, k_new, v_new):
    return k_buffer.index_copy(2, input_pos, k_new), v_buffer.index_copy(2, input_pos, v_new)


# WRONG: writes only row 0 of the batch
@blind("06", known="first_row_only")
def row0_only(k_buffer, v_buffer, input_pos, k_new, v_new):
    k_buffer[0].index_copy_(1, input_pos, k_new[0])
    v_buffer[0].index_copy_(1, input_pos, v_new[0])
    return k_buffer, v_buffer


# -- 07: padded_position_ids(attention_mask) ------------------------------------------------


# WRONG: positions start at 1 (cumsum without the - 1)
@blind("07", known="from_one")
def count_from_one(attention_mask):
    return attention_mask.long().cumsum(-1)


# WRONG: cumsum over the batch axis (dim 0)
@blind("07")
def cumsum_wrong_axis(attention_mask):
    return (attention_mask.long().cumsum(0) - 1).clamp(min=0)


# WRONG: positions are the slot numbers, the padding counted
@blind("07", known="counting_padding")
def ignores_mask(attention_mask):
    slots = torch.arange(attention_mask.size(-1), device=attention_mask.device)
    return slots.expand_as(attention_mask).clone()


# -- 08: mask_slice(bias, past_len, q_len) --------------------------------------------------


# WRONG: rows start one early (past_len - 1) when there is a past
@blind("08")
def rows_off_by_one(bias, past_len, q_len):
    return bias[max(past_len - 1, 0) : max(past_len - 1, 0) + q_len, : past_len + q_len]


# WRONG: takes the first q_len rows of bias (top-left)
@blind("08", known="top_rows")
def first_rows_top_left(bias, past_len, q_len):
    return bias[:q_len, : past_len + q_len]


# -- 09: window_start(start, seq_len, block_size, keep) -------------------------------------


# WRONG: >= instead of >: cuts when the view is exactly full
@blind("09", known="a_step_early")
def cut_one_early(start, seq_len, block_size, keep):
    return seq_len - keep if seq_len - start >= block_size else start


# WRONG: returns start + keep (the count taken for a position)
@blind("09")
def keep_as_start(start, seq_len, block_size, keep):
    return start + keep if seq_len - start > block_size else start


# WRONG: slides the window by one token (seq_len - block_size) instead of cutting back to keep
@blind("09", known="slides")
def slides_by_one(start, seq_len, block_size, keep):
    return seq_len - block_size if seq_len - start > block_size else start


# -- 10: decode_read_bytes(config, batch, context_len, bytes_per_number) --------------------


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


# -- 11: slot_mapping(block_tables, seq_of_token, positions, kv_block_size) -----------------


# WRONG: assumes a sequence's blocks are contiguous: its first block plus the position
@blind("11")
def contiguous_blocks(block_tables, seq_of_token, positions, kv_block_size):
    first = block_tables[seq_of_token, 0]
    return first.long() * kv_block_size + positions


# WRONG: offset by the block index and block by the offset (// and % swapped)
@blind("11", known="swapped_division")
def div_mod_swapped(block_tables, seq_of_token, positions, kv_block_size):
    blocks = block_tables[seq_of_token, positions % kv_block_size]
    return blocks.long() * kv_block_size + positions // kv_block_size


# -- 12: schedule(scheduler) ----------------------------------------------------------------


def _blind_12(
    scheduler: Scheduler, victim_at=-1, after_preempting=False, capped=True, skip_blocked=False
) -> ScheduledBatch:
    batch = ScheduledBatch()
    budget = scheduler.config.max_num_batched_tokens
    manager = scheduler.block_manager
    index = 0
    while index < len(scheduler.running) and budget > 0:
        seq = scheduler.running[index]
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        preempted_self = False
        while not manager.can_grow(seq, seq.num_computed_tokens + num_new):
            victim = scheduler.running.pop(victim_at)
            scheduler._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                preempted_self = True
                break
        if preempted_self:
            continue
        manager.grow(seq, seq.num_computed_tokens + num_new)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)
        budget -= num_new
        index += 1
    for seq in list(scheduler.waiting):
        if (batch.preempted and not after_preempting) or budget <= 0:
            break
        if capped and len(scheduler.running) >= scheduler.config.max_num_seqs:
            break
        cached = manager.cached_prefix(seq.all_ids)
        num_cached = len(cached) * manager.kv_block_size
        num_new = min(seq.num_tokens - num_cached, budget)
        if not manager.can_start(cached, num_cached + num_new):
            if skip_blocked:
                continue
            break
        scheduler.waiting.remove(seq)
        manager.start(seq, cached, num_cached + num_new)
        scheduler.running.append(seq)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)
        budget -= num_new
    scheduler.running.sort(key=scheduler.arrival_order.__getitem__)
    return batch


# WRONG: admits waiting sequences even when someone was preempted this step
@blind("12")
def admit_after_preempt(scheduler):
    return _blind_12(scheduler, after_preempting=True)


# WRONG: ignores max_num_seqs when admitting
@blind("12", known="ignores_max_seqs")
def no_max_num_seqs(scheduler):
    return _blind_12(scheduler, capped=False)


# WRONG: preempts the oldest running sequence (running.pop(0)) instead of the newest
@blind("12")
def preempt_oldest(scheduler):
    return _blind_12(scheduler, victim_at=0)


# WRONG: a waiting sequence the pool cannot take is skipped and the next one tried (no FCFS)
@blind("12")
def skip_blocked_head(scheduler):
    return _blind_12(scheduler, skip_blocked=True)


# -- 13: cached_prefix(manager, token_ids) --------------------------------------------------


def _blind_13(
    manager: BlockManager, token_ids, blocks: int, check_tokens=True, on_miss="stop"
) -> list[int]:
    size = manager.kv_block_size
    found: list[int] = []
    parent = b""
    for i in range(blocks):
        tokens = tuple(token_ids[i * size : (i + 1) * size])
        parent = chain_hash(parent, tokens)
        bid = manager.cached.get(parent)
        if bid is None or (check_tokens and manager.blocks[bid].token_ids != tokens):
            if on_miss == "skip":
                continue
            break
        found.append(bid)
    return found


# WRONG: looks up every full block (len // size), the last token's block included
@blind("13", known="serves_the_last_token")
def all_full_blocks(manager, token_ids):
    return _blind_13(manager, token_ids, len(token_ids) // manager.kv_block_size)


# WRONG: trusts the key alone: the block's token_ids never compared
@blind("13", known="key_alone")
def no_token_check(manager, token_ids):
    blocks = manager.lookup_blocks(len(token_ids))
    return _blind_13(manager, token_ids, blocks, check_tokens=False)


# WRONG: a block not found is skipped and the run goes on (no stop at the first miss)
@blind("13")
def skips_missing(manager, token_ids):
    return _blind_13(manager, token_ids, manager.lookup_blocks(len(token_ids)), on_miss="skip")


# -- 14: held_back(text, stops) ---------------------------------------------------------------


def _blind_14(text, stops, longest_first=True, whole_stop=False) -> int:
    best = 0
    for stop in stops:
        longest = min(len(stop) - (0 if whole_stop else 1), len(text))
        for n in range(longest, 0, -1) if longest_first else range(1, longest + 1):
            if text.endswith(stop[:n]):
                best = max(best, n)
                break
    return best


# WRONG: looks at the first stop string only
@blind("14", known="first_stop_only")
def first_stop_only(text, stops):
    return _blind_14(text, stops[:1])


# WRONG: stops at the shortest matching tail (n counted up)
@blind("14")
def shortest_match(text, stops):
    return _blind_14(text, stops, longest_first=False)


# WRONG: also holds back a tail equal to a whole stop string
@blind("14", known="includes_the_whole_stop")
def whole_stop_held(text, stops):
    return _blind_14(text, stops, whole_stop=True)


# -- 15: export_prepare(cache, batch, q_len, device) ----------------------------------------


# WRONG: kv_len read as a Python int (int(size)): baked into the exported graph
@blind("15", known="baked_length")
def int_kv_len(cache: ExportCache, batch, q_len, device):
    kv_len = int(cache.attention_mask.size(1))
    return cache.position_ids, padding_mask(
        causal_mask(q_len, kv_len, device), cache.attention_mask
    )


# WRONG: kv_len computed as q_len + row 0's first position (a Python number read out of a
# tensor; wrong with padding)
@blind("15")
def kv_len_from_position(cache: ExportCache, batch, q_len, device):
    kv_len = q_len + int(cache.position_ids[0, 0])
    return cache.position_ids, padding_mask(
        causal_mask(q_len, kv_len, device), cache.attention_mask
    )


# WRONG: mask is causal only: padding slots not masked
@blind("15", known="no_padding")
def no_padding(cache: ExportCache, batch, q_len, device):
    return cache.position_ids, causal_mask(q_len, cache.attention_mask.size(1), device)


# -- 16: stage_forward(stage, x, cache) ----------------------------------------------------


def _blind_16(
    stage: PipelineStage,
    x,
    cache: KVCache,
    layer=lambda stage, local: local,
    positions=True,
    ln_f=True,
    prepare_each_block=False,
):
    batch, q_len = x.shape[:2]
    pos, mask = cache.prepare(batch, q_len, x.device)
    parts = stage.transformer
    if stage.is_first:
        x = parts.drop(parts.wte(x) + parts.wpe(pos) if positions else parts.wte(x))
    for local, block in enumerate(parts.h):
        if prepare_each_block and local > 0:
            pos, mask = cache.prepare(batch, q_len, x.device)
        x = block(x, mask, cache, layer(stage, local))
    if stage.is_last:
        x = stage.lm_head((parts.ln_f(x) if ln_f else x)[:, -1, :])
    return x


# WRONG: block's cache layer given as its number in the whole model (stage.layers[local])
@blind("16", known="global_layer")
def global_layer_numbers(stage, x, cache):
    return _blind_16(stage, x, cache, layer=lambda stage, local: stage.layers[local])


# WRONG: last stage skips ln_f
@blind("16")
def last_no_ln_f(stage, x, cache):
    return _blind_16(stage, x, cache, ln_f=False)


# WRONG: first stage adds no position embedding
@blind("16")
def no_position_embedding(stage, x, cache):
    return _blind_16(stage, x, cache, positions=False)


# WRONG: asks the cache for positions and mask once per block
@blind("16")
def prepare_per_block(stage, x, cache):
    return _blind_16(stage, x, cache, prepare_each_block=True)


# -- 17: quantize(x, bits, group_size, dim) ---------------------------------------------------


def _blind_17(
    x, bits, group_size, dim, levels=None, rounding=torch.round, scale_up=True, along=None
) -> Quantized:
    levels = 2**bits - 1 if levels is None else levels
    dim = dim if along is None else along
    xm = x.float().movedim(dim, -1)
    shape = xm.shape
    g = xm.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    zero = _to_float16(g.amin(-1, keepdim=True), -float("inf"))
    spread = (g.amax(-1, keepdim=True) - zero.float()) / levels
    scale = _to_float16(spread, float("inf")) if scale_up else spread.half()
    div = torch.where(scale == 0, torch.ones_like(scale, dtype=torch.float32), scale.float())
    codes = rounding((g - zero.float()) / div).clamp(0, min(levels, 2**bits - 1))
    codes = codes.to(torch.uint8).reshape(shape).movedim(-1, dim)
    return Quantized(codes, scale.squeeze(-1).movedim(-1, dim), zero.squeeze(-1).movedim(-1, dim))


# WRONG: codes truncated (floor) instead of rounded
@blind("17")
def floor_codes(x, bits, group_size, dim):
    return _blind_17(x, bits, group_size, dim, rounding=torch.floor)


# WRONG: groups always along the last dim (dim ignored)
@blind("17", known="last_dim_always")
def last_dim_always(x, bits, group_size, dim):
    return _blind_17(x, bits, group_size, dim, along=x.dim() - 1)


# WRONG: levels = 2**bits (not 2**bits - 1), codes clamped to 2**bits - 1
@blind("17")
def levels_2_pow_bits(x, bits, group_size, dim):
    return _blind_17(x, bits, group_size, dim, levels=2**bits)


# WRONG: scale rounded to nearest float16 (plain .half()), not up
@blind("17", known="scale_to_nearest")
def scale_nearest(x, bits, group_size, dim):
    return _blind_17(x, bits, group_size, dim, scale_up=False)


# -- 18: rolling_slot(pos, window, sinks) ---------------------------------------------------


# WRONG: (pos - sinks) % (window + sinks): the window slots counted with the sinks
@blind("18")
def modulo_whole_cache(pos, window, sinks):
    return torch.where(pos < sinks, pos, sinks + (pos - sinks) % (window + sinks))


# WRONG: pos % (sinks + window) for every position: sinks get overwritten
@blind("18", known="modulo_all_slots")
def sinks_overwritten(pos, window, sinks):
    return pos % (sinks + window)


# WRONG: modulo window - 1 (off by one)
@blind("18")
def window_minus_one(pos, window, sinks):
    return torch.where(pos < sinks, pos, sinks + (pos - sinks) % (window - 1))


# -- 20: choice_mask(vocab, choices, prefix, eot_id) ----------------------------------------


def _blind_20(vocab, choices, prefix, eot_id, fits, ends) -> torch.Tensor:
    """`fits(out, encoded)`: the output so far may go on; `ends(prefix, encoded)`: it may
    end here."""
    encoded = [c.encode("utf-8") for c in choices]
    mask = torch.zeros(len(vocab), dtype=torch.bool)
    for t, tok in enumerate(vocab):
        if t == eot_id:
            continue
        if fits(prefix + tok, encoded):
            mask[t] = True
    mask[eot_id] = ends(prefix, encoded)
    return mask


def _begins_one(out: bytes, encoded: list[bytes]) -> bool:
    return any(c.startswith(out) for c in encoded)


def _is_one(prefix: bytes, encoded: list[bytes]) -> bool:
    return prefix in encoded


# WRONG: compares decoded text (errors='ignore'): a token ending mid-character is judged on
# its complete characters only
@blind("20")
def decoded_text(vocab, choices, prefix, eot_id):
    def fits(out, encoded):
        return any(c.startswith(out.decode("utf-8", errors="ignore")) for c in choices)

    return _blind_20(vocab, choices, prefix, eot_id, fits, _is_one)


# WRONG: end-of-text allowed whenever the prefix begins a choice (not only when it is a
# whole one)
@blind("20")
def eot_on_any_prefix(vocab, choices, prefix, eot_id):
    return _blind_20(vocab, choices, prefix, eot_id, _begins_one, _begins_one)


# WRONG: end-of-text allowed only when the prefix is a choice that no longer choice extends
@blind("20", known="end_of_text_only_when_stuck")
def eot_only_unique(vocab, choices, prefix, eot_id):
    def ends(prefix, encoded):
        longer = any(c != prefix and c.startswith(prefix) for c in encoded)
        return prefix in encoded and not longer

    return _blind_20(vocab, choices, prefix, eot_id, _begins_one, ends)


# WRONG: token allowed when the output so far begins with a choice (overshoot allowed), or a
# choice begins with it
@blind("20", known="overshoots")
def startswith_reversed(vocab, choices, prefix, eot_id):
    def fits(out, encoded):
        return any(c.startswith(out) or out.startswith(c) for c in encoded)

    return _blind_20(vocab, choices, prefix, eot_id, fits, _is_one)


# == The builds: the mistake put into the reference solution ===============================

# -- build block_manager: chain_hash, BlockManager ---------------------------------------------


# WRONG: chain_hash joins the tokens with no separator: (1, 23) and (12, 3) collide
@blind_build("block_manager", "chain_hash")
def hash_no_separator(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    # the mistake: was `data = parent + b"|" + ",".join(map(str, token_ids)).encode()`
    data = parent + b"|" + "".join(map(str, token_ids)).encode()
    return hashlib.sha256(data).digest()


# WRONG: chain_hash ignores the parent key: a block keyed by its own tokens only
@blind_build("block_manager", "chain_hash", known="unchained")
def hash_without_parent(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    # the mistake: was `data = parent + b"|" + ",".join(map(str, token_ids)).encode()`
    data = b"|" + ",".join(map(str, token_ids)).encode()
    return hashlib.sha256(data).digest()


# Each a subclass of the reference's BlockManager, with the method the mistake is in.
_Blind = reference_block_manager.BlockManager


# WRONG: can_start counts unheld cached blocks it would take as still available to grow into
@blind_build("block_manager", "BlockManager", name="can_start_ignores_unheld")
class CanStartIgnoresUnheld(_Blind):
    def can_start(self, cached_ids, num_tokens):
        needed = -(-num_tokens // self.kv_block_size) - len(cached_ids)
        # the mistake: was `return needed <= self.num_free + len(self.evictable) - unheld`
        return needed <= self.num_free + len(self.evictable)


# WRONG: can_start uses < instead of <=: refuses a sequence that exactly fits the pool
@blind_build("block_manager", "BlockManager", name="can_start_strict")
class CanStartStrict(_Blind):
    def can_start(self, cached_ids, num_tokens):
        unheld = sum(1 for block_id in cached_ids if self.blocks[block_id].ref_count == 0)
        needed = -(-num_tokens // self.kv_block_size) - len(cached_ids)
        # the mistake: was `return needed <= self.num_free + len(self.evictable) - unheld`
        return needed < self.num_free + len(self.evictable) - unheld


# WRONG: can_grow counts only free blocks, not the evictable cached ones
@blind_build(
    "block_manager", "BlockManager", name="can_grow_free_only", known="cached_blocks_unavailable"
)
class CanGrowFreeOnly(_Blind):
    def can_grow(self, seq, num_tokens):
        needed = -(-num_tokens // self.kv_block_size) - len(seq.block_table)
        # the mistake: was `return needed <= self.num_free + len(self.evictable)`
        return needed <= self.num_free


class _BlindStart(_Blind):
    """start, its counters and num_cached_tokens as `queries(seq, num_tokens)` and
    `first_start(seq)` say."""

    def queries(self, seq, num_tokens):
        return self.lookup_blocks(len(seq.all_ids))

    def first_start(self, seq):
        return not seq.output_ids

    def start(self, seq, cached_ids, num_tokens):
        self.prefix_cache_queries += self.queries(seq, num_tokens)
        self.prefix_cache_hits += len(cached_ids)
        for block_id in cached_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.evictable[block_id]
            block.ref_count += 1
        seq.block_table = list(cached_ids)
        seq.block_hashes = [self.blocks[block_id].hash for block_id in cached_ids]
        seq.num_computed_tokens = len(cached_ids) * self.kv_block_size
        if self.first_start(seq):
            seq.num_cached_tokens = seq.num_computed_tokens
        self.grow(seq, num_tokens)


# WRONG: num_cached_tokens overwritten on a restart after preemption too
@blind_build("block_manager", "BlockManager", name="cached_tokens_on_restart")
class CachedTokensOnRestart(_BlindStart):
    def first_start(self, seq):
        return True  # the mistake: was `return not seq.output_ids`


# WRONG: prefix_cache_hits counted per block found but queries counted only on a first start
@blind_build("block_manager", "BlockManager", name="hits_count_on_restart_only_new")
class HitsCountOnRestartOnlyNew(_BlindStart):
    def queries(self, seq, num_tokens):
        # the mistake: was `return self.lookup_blocks(len(seq.all_ids))`
        return 0 if seq.output_ids else self.lookup_blocks(len(seq.all_ids))


# WRONG: prefix_cache_queries counts lookup_blocks(num_tokens) (the tokens to grow to), not
# of the whole sequence
@blind_build("block_manager", "BlockManager", name="queries_count_num_tokens")
class QueriesCountNumTokens(_BlindStart):
    def queries(self, seq, num_tokens):
        return self.lookup_blocks(num_tokens)  # the mistake: was `len(seq.all_ids)`


# WRONG: lookup_blocks ignores enable_prefix_caching (cached_prefix returns [] itself):
# queries counted without prefix caching
@blind_build("block_manager", "BlockManager", name="lookup_ignores_flag")
class LookupIgnoresFlag(_Blind):
    def lookup_blocks(self, num_tokens):
        # the mistake: `if not self.enable_prefix_caching: return 0` moved to cached_prefix
        return (num_tokens - 1) // self.kv_block_size

    def cached_prefix(self, token_ids):
        if not self.enable_prefix_caching:
            return []
        return super().cached_prefix(token_ids)


# WRONG: lookup_blocks = num_tokens // size: a prompt of whole blocks gets its last token's
# block served
@blind_build(
    "block_manager", "BlockManager", name="lookup_serves_last_block", known="serves_the_last_token"
)
class LookupServesLastBlock(_Blind):
    def lookup_blocks(self, num_tokens):
        if not self.enable_prefix_caching:
            return 0
        return num_tokens // self.kv_block_size  # the mistake: was `(num_tokens - 1)`


class _BlindGrow(_Blind):
    """grow, taking a free block when `take_free()` and evicting `evictable.popitem(last=
    self.newest_first)` otherwise."""

    newest_first = False

    def take_free(self):
        return bool(self.free_ids)

    def grow(self, seq, num_tokens):
        while len(seq.block_table) * self.kv_block_size < num_tokens:
            if self.take_free():
                block_id = self.free_ids.pop()
            else:
                block_id, _ = self.evictable.popitem(last=self.newest_first)
                block = self.blocks[block_id]
                del self.cached[block.hash]
                self.cache_version += 1
                block.hash, block.token_ids = None, ()
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)


# WRONG: evicts the most recently given back cached block (LIFO), not the least recent
@blind_build("block_manager", "BlockManager", name="evict_newest", known="evicts_the_newest")
class EvictNewest(_BlindGrow):
    newest_first = True  # the mistake: was `evictable.popitem(last=False)`


# WRONG: grow evicts a cached block first when any exists, before taking a free one
@blind_build("block_manager", "BlockManager", name="grow_prefers_evictable")
class GrowPrefersEvictable(_BlindGrow):
    def take_free(self):
        # the mistake: was `return bool(self.free_ids)`
        return bool(self.free_ids) and not self.evictable


# WRONG: num_used sums ref counts: a block shared by two tables counts twice
@blind_build("block_manager", "BlockManager", name="num_used_sums_refcounts")
class NumUsedSumsRefcounts(_Blind):
    @property
    def num_used(self):
        # the mistake: was `return self.num_blocks - self.num_free - len(self.evictable)`
        return sum(block.ref_count for block in self.blocks)


# WRONG: release gives blocks back first block first (the prefix's start is evicted before
# its end)
@blind_build("block_manager", "BlockManager", name="release_first_block_first")
class ReleaseFirstBlockFirst(_Blind):
    def release(self, seq):
        for block_id in seq.block_table:  # the mistake: was `reversed(seq.block_table)`
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


class _BlindAdvance(_Blind):
    """advance, keying blocks of `ids(seq)` up to `keyed_end(seq)` tokens, a block keyed
    when `free_to_key(block, key)`."""

    def ids(self, seq):
        return seq.all_ids

    def keyed_end(self, seq):
        return seq.num_computed_tokens

    def free_to_key(self, block, key):
        return block.hash is None and key not in self.cached

    def advance(self, seq, num_new):
        seq.num_computed_tokens += num_new
        if not self.enable_prefix_caching:
            return
        size = self.kv_block_size
        ids = self.ids(seq)
        while len(seq.block_hashes) < self.keyed_end(seq) // size:
            i = len(seq.block_hashes)
            tokens = tuple(ids[i * size : (i + 1) * size])
            key = chain_hash(seq.block_hashes[-1] if seq.block_hashes else b"", tokens)
            seq.block_hashes.append(key)
            block = self.blocks[seq.block_table[i]]
            if self.free_to_key(block, key):
                block.hash, block.token_ids = key, tokens
                self.cached[key] = block.block_id
                self.cache_version += 1


# WRONG: advance keys only blocks of the prompt; blocks filled by generated tokens never get
# keyed
@blind_build("block_manager", "BlockManager", name="register_prompt_only")
class RegisterPromptOnly(_BlindAdvance):
    def ids(self, seq):
        return seq.prompt_ids  # the mistake: was `seq.all_ids`

    def keyed_end(self, seq):
        # the mistake: was `return seq.num_computed_tokens`
        return min(seq.num_computed_tokens, len(seq.prompt_ids))


# WRONG: advance keys a block even when its key is cached already (the newer copy replaces
# the older in `cached`)
@blind_build("block_manager", "BlockManager", name="rekey_duplicate")
class RekeyDuplicate(_BlindAdvance):
    def free_to_key(self, block, key):
        return block.hash is None  # the mistake: `and key not in self.cached` left out


# -- build cached_loop: StaticLayer, StaticCache, generate_cached ------------------------------
# These run with the learner module's globals: StaticCache is whatever the module holds
# under that name (rose's own static cache while the loop is checked).

END_OF_TEXT = 50256


def _blind_loop(model, prompts, max_new_tokens, prefill_chunk=None, chunked=True, stops=()):
    """The reference's generate_cached; `chunked` False: the prefill in one call whatever
    prefill_chunk says; a row whose last token is in `stops` repeats it."""
    longest = max(len(prompt) for prompt in prompts)
    pads = [longest - len(prompt) for prompt in prompts]
    rows = [[0] * pad + prompt for pad, prompt in zip(pads, prompts, strict=True)]
    ids = torch.tensor(rows, device=model.lm_head.weight.device)
    cache = StaticCache(model, len(prompts), longest + max_new_tokens, pads)
    chunk = (prefill_chunk if chunked else None) or longest
    for start in range(0, longest, chunk):
        logits = model(ids[:, start : start + chunk], cache=cache).logits[:, -1]
    new_tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        next_ids = logits.argmax(dim=-1)
        for r, row in enumerate(new_tokens):
            if row and row[-1] in stops:
                next_ids[r] = row[-1]
            row.append(int(next_ids[r]))
        if step + 1 < max_new_tokens:  # the last token is never fed back
            logits = model(next_ids[:, None], cache=cache).logits[:, -1]
    return new_tokens


# WRONG: each prompt decoded alone on a cache of its own (no batching)
@blind_build("cached_loop", "generate_cached")
@torch.no_grad()
def cache_per_prompt(model, prompts, max_new_tokens, prefill_chunk=None):
    # the mistake: was `return _blind_loop(model, prompts, max_new_tokens, prefill_chunk)`
    return [_blind_loop(model, [p], max_new_tokens, prefill_chunk)[0] for p in prompts]


# WRONG: generate_cached prefills the whole prompt in one call whatever prefill_chunk says
@blind_build("cached_loop", "generate_cached")
@torch.no_grad()
def ignores_prefill_chunk(model, prompts, max_new_tokens, prefill_chunk=None):
    # the mistake: the loop's `chunk = prefill_chunk or longest` was `chunk = longest`
    return _blind_loop(model, prompts, max_new_tokens, prefill_chunk, chunked=False)


# WRONG: a row stops at end-of-text (50256) and repeats it, though the contract says no
# stopping early
@blind_build("cached_loop", "generate_cached")
@torch.no_grad()
def stops_at_eot(model, prompts, max_new_tokens, prefill_chunk=None):
    stops = (END_OF_TEXT, model.config.vocab_size - 1)  # the mistake: no stop is right
    return _blind_loop(model, prompts, max_new_tokens, prefill_chunk, stops=stops)


# WRONG: buffers always float32 (model dtype ignored); writes cast by indexing
@blind_build("cached_loop", "StaticCache.__init__", name="float32_buffers")
def _float32_buffers_made(self, model, batch_size, max_len, pad_lengths=None):
    cfg = model.config
    weight = model.lm_head.weight
    shape = (batch_size, cfg.n_head, max_len, cfg.n_embd // cfg.n_head)
    self.layers = [
        # the mistake: was `torch.zeros(shape, dtype=weight.dtype, device=weight.device)`
        StaticLayer(
            torch.zeros(shape, device=weight.device), torch.zeros(shape, device=weight.device)
        )
        for _ in range(cfg.n_layer)
    ]
    self.max_len = max_len
    self.filled = 0
    self.input_pos = torch.zeros(0, dtype=torch.long, device=weight.device)
    self.pads = torch.tensor(pad_lengths or [0] * batch_size, device=weight.device)
    slots = torch.arange(max_len, device=weight.device)
    self.real = slots[None, :] >= self.pads[:, None]


@blind_build("cached_loop", "StaticLayer.update", name="float32_buffers")
def _float32_buffers_written(self, input_pos, k, v):
    # the mistake: was `self.k[:, :, input_pos] = k` (and v), returning self.k, self.v
    self.k[:, :, input_pos] = k.float()
    self.v[:, :, input_pos] = v.float()
    return self.k.to(k.dtype), self.v.to(v.dtype)


# WRONG: StaticLayer.update rebinds self.k/self.v to new tensors (index_copy, not
# index_copy_): the buffers given are never written
@blind_build("cached_loop", "StaticLayer.update")
def out_of_place_update(self, input_pos, k, v):
    # the mistake: was `self.k[:, :, input_pos] = k` (and v): the buffers written in place
    self.k = self.k.index_copy(2, input_pos, k)
    self.v = self.v.index_copy(2, input_pos, v)
    return self.k, self.v


# WRONG: only row 0 of the batch is written into the buffers
@blind_build("cached_loop", "StaticLayer.update", known="row_zero_only")
def row0_only_write(self, input_pos, k, v):
    # the mistake: was `self.k[:, :, input_pos] = k` (and v): every row
    self.k[0].index_copy_(1, input_pos, k[0])
    self.v[0].index_copy_(1, input_pos, v[0])
    return self.k, self.v


def _blind_prepare(self, batch, q_len, device, top_left=False, opened=True, padded=True):
    """The reference's prepare; `top_left`: query i sees slots 0..i; `opened` False: a
    padding query's row left all False; `padded` False: the positions are the slots'."""
    self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
    self.filled += q_len
    slots = torch.arange(self.max_len, device=device)
    rows = torch.arange(q_len, device=device) if top_left else self.input_pos
    causal = slots[None, :] <= rows[:, None]
    mask = causal[None, None, :, :] & self.real[:, None, None, :]
    if opened:
        mask = mask | ~mask.any(dim=-1, keepdim=True)
    if not padded:
        return self.input_pos[None, :].expand(batch, q_len), mask
    return (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0), mask


# WRONG: causal part of the mask aligned top-left (query i sees slots 0..i, ignoring the past)
@blind_build("cached_loop", "StaticCache.prepare", known="top_left_mask")
def mask_top_left(self, batch, q_len, device):
    return _blind_prepare(self, batch, q_len, device, top_left=True)


# WRONG: a padding query's mask row is left all False (softmax over nothing: NaN)
@blind_build("cached_loop", "StaticCache.prepare")
def padding_rows_not_opened(self, batch, q_len, device):
    return _blind_prepare(self, batch, q_len, device, opened=False)


# WRONG: positions are the slot numbers: left padding counted in the positions
@blind_build("cached_loop", "StaticCache.prepare", known="padding_counted")
def pos_counts_padding(self, batch, q_len, device):
    return _blind_prepare(self, batch, q_len, device, padded=False)


# -- build model: CausalSelfAttention, MLP, Block, GPT --------------------------------------


def _blind_attention(self, x, split_heads, merge_heads, scale):
    """The reference's attention forward, the heads cut by `split_heads(t, B, T, head_dim)`
    and put back by `merge_heads(y, B, T, C)`, the scores divided by `scale(C, head_dim)`."""
    B, T, C = x.shape
    head_dim = C // self.n_head
    q, k, v = (split_heads(t, B, T, head_dim) for t in self.c_attn(x).split(C, dim=2))
    scores = (q @ k.transpose(-2, -1)) / scale(C, head_dim)
    allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    return self.c_proj(merge_heads(torch.softmax(scores, dim=-1) @ v, B, T, C))


def _heads_split(self, t, B, T, head_dim):
    return t.view(B, T, self.n_head, head_dim).transpose(1, 2)


def _heads_merged(y, B, T, C):
    return y.transpose(1, 2).contiguous().view(B, T, C)


# WRONG: heads split as view(B, T, head_dim, n_head): head h gets every n_head-th feature
@blind_build("model", "CausalSelfAttention.forward")
def heads_interleaved(self, x):
    def split(t, B, T, head_dim):
        # the mistake: was `t.view(B, T, self.n_head, head_dim).transpose(1, 2)`
        return t.view(B, T, head_dim, self.n_head).permute(0, 3, 1, 2)

    def merge(y, B, T, C):
        return y.permute(0, 2, 3, 1).contiguous().view(B, T, C)

    return _blind_attention(self, x, split, merge, lambda C, head_dim: math.sqrt(head_dim))


# WRONG: scores scaled by sqrt(n_embd) instead of sqrt(head_dim)
@blind_build("model", "CausalSelfAttention.forward")
def scale_sqrt_n_embd(self, x):
    def split(t, B, T, head_dim):
        return _heads_split(self, t, B, T, head_dim)

    # the mistake: was `math.sqrt(head_dim)`
    return _blind_attention(self, x, split, _heads_merged, lambda C, head_dim: math.sqrt(C))


# WRONG: MLP uses the exact erf GELU (F.gelu default), not GPT-2's tanh approximation
@blind_build("model", "MLP.forward", known="exact_gelu")
def erf_gelu(self, x):
    # the mistake: was `F.gelu(self.c_fc(x), approximate="tanh")`
    return self.c_proj(F.gelu(self.c_fc(x)))


# WRONG: Block normalises the MLP's input with ln_1 again (ln_2 created but never used)
@blind_build("model", "Block.forward")
def ln1_reused_for_mlp(self, x):
    x = x + self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_1(x))  # the mistake: was `self.ln_2(x)`


def _blind_block_init(self, config, **norm):
    """The reference's Block.__init__, its LayerNorms made with `norm` in place of bias=."""
    nn.Module.__init__(self)
    self.ln_1 = nn.LayerNorm(config.n_embd, **norm)
    self.attn = CausalSelfAttention(config)
    self.ln_2 = nn.LayerNorm(config.n_embd, **norm)
    self.mlp = MLP(config)


def _blind_gpt_init(self, config, norm=None, tied=True):
    """The reference's GPT.__init__, ln_f made with `norm` (bias=config.bias when None);
    `tied` False: lm_head gets a copy of wte's weight, a Parameter of its own."""
    nn.Module.__init__(self)
    self.transformer = nn.ModuleDict(
        dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, **(norm or {"bias": config.bias})),
        )
    )
    self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
    if tied:
        self.lm_head.weight = self.transformer.wte.weight
    else:
        self.lm_head.weight = nn.Parameter(self.transformer.wte.weight.detach().clone())


# WRONG: LayerNorms always get a bias (config.bias ignored for them)
@blind_build("model", "Block.__init__", name="ln_always_bias")
def _ln_always_bias_in_blocks(self, config):
    _blind_block_init(self, config)  # the mistake: was `bias=config.bias`


@blind_build("model", "GPT.__init__", name="ln_always_bias")
def _ln_always_bias_at_the_end(self, config):
    _blind_gpt_init(self, config, norm={})  # the mistake: ln_f was given `bias=config.bias`


# WRONG: LayerNorm eps 1e-6 (TF-style) instead of PyTorch's/GPT-2's 1e-5
@blind_build("model", "Block.__init__", name="ln_eps_1e6")
def _ln_eps_1e6_in_blocks(self, config):
    _blind_block_init(self, config, eps=1e-6, bias=config.bias)  # the mistake: eps=1e-6


@blind_build("model", "GPT.__init__", name="ln_eps_1e6")
def _ln_eps_1e6_at_the_end(self, config):
    _blind_gpt_init(self, config, norm={"eps": 1e-6, "bias": config.bias})  # (the mistake)


# WRONG: lm_head gets its own Parameter (a copy of wte's weight), not tied: same forward,
# wrong gradients
@blind_build("model", "GPT.__init__", known="untied_head")
def untied_head_copy(self, config):
    _blind_gpt_init(self, config, tied=False)  # the mistake: was lm_head.weight = wte.weight


# WRONG: positions built with torch.arange(T) on the CPU whatever idx's device (breaks on a
# GPU)
@blind_build("model", "GPT.forward")
def pos_no_device(self, idx):
    positions = torch.arange(idx.size(1))  # the mistake: was `device=idx.device`
    x = self.transformer.wte(idx) + self.transformer.wpe(positions)
    for block in self.transformer.h:
        x = block(x)
    return self.lm_head(self.transformer.ln_f(x))


# -- build training_step: AdamW, parameter_groups, learning_rate, clip_gradients, train_step


def _blind_adam_step(self, decay_first=True, settings=None, eps_inside=False, step_of=None):
    """The reference's AdamW.step; `settings(group)`: (betas, eps) (the group's own by
    default); `step_of(state)`: the step count the bias correction uses (the parameter's
    own, bumped here, by default)."""
    for group in self.param_groups:
        lr, wd = group["lr"], group["weight_decay"]
        (beta1, beta2), eps = (settings or (lambda g: (g["betas"], g["eps"])))(group)
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
            state["t"] += 1
            t = state["t"] if step_of is None else step_of(state)
            m, v, grad = state["m"], state["v"], p.grad
            if decay_first:
                p.mul_(1 - lr * wd)
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            m_hat = m / (1 - beta1**t)
            v_hat = v / (1 - beta2**t)
            p.sub_(lr * m_hat / ((v_hat + eps).sqrt() if eps_inside else v_hat.sqrt() + eps))
            if not decay_first:
                p.mul_(1 - lr * wd)


# WRONG: decoupled decay applied after the Adam update (shrinks the updated parameter)
@blind_build("training_step", "AdamW.step")
@torch.no_grad()
def decay_after_adam(self):
    _blind_adam_step(self, decay_first=False)  # the mistake: `p.mul_(1 - lr * wd)` moved


# WRONG: betas and eps read from the optimizer's defaults, ignoring a group's own
@blind_build("training_step", "AdamW.step")
@torch.no_grad()
def defaults_betas_eps(self):
    # the mistake: was `group["betas"], group["eps"]`
    _blind_adam_step(self, settings=lambda group: (self.defaults["betas"], self.defaults["eps"]))


# WRONG: eps added inside the square root: sqrt(v_hat + eps)
@blind_build("training_step", "AdamW.step")
@torch.no_grad()
def eps_inside_sqrt(self):
    _blind_adam_step(self, eps_inside=True)  # the mistake: was `v_hat.sqrt() + eps`


# WRONG: one step counter for the whole optimizer (bumped every step()), not per parameter:
# a parameter that skipped a step gets the wrong bias correction
@blind_build("training_step", "AdamW.step")
@torch.no_grad()
def shared_step_counter(self):
    self.steps_taken = getattr(self, "steps_taken", 0) + 1  # the mistake: one count for all
    _blind_adam_step(self, step_of=lambda state: self.steps_taken)


def _blind_groups(model, weight_decay, decays, frozen_too=False):
    """The reference's groups, a parameter decayed when `decays(name, p)`."""
    named = [(n, p) for n, p in model.named_parameters() if frozen_too or p.requires_grad]
    return [
        {"params": [p for n, p in named if decays(n, p)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
    ]


# WRONG: groups by name: everything not named '*bias' decays, so LayerNorm weights decay too
@blind_build("training_step", "parameter_groups", known="decay_on_layernorm")
def decay_by_name(model, weight_decay):
    # the mistake: was `decays=lambda name, p: p.dim() >= 2`
    return _blind_groups(model, weight_decay, lambda name, p: not name.endswith("bias"))


# WRONG: parameter_groups keeps parameters that do not require a gradient (frozen ones get
# optimised/decayed)
@blind_build("training_step", "parameter_groups")
def frozen_params_grouped(model, weight_decay):
    # the mistake: the frozen parameters (requires_grad False) grouped too
    return _blind_groups(model, weight_decay, lambda name, p: p.dim() >= 2, frozen_too=True)


def _blind_rate(step, cfg, decay_steps, warmup_from=1):
    """The reference's learning_rate, decaying to `decay_steps`, the warmup's first step at
    `warmup_from` / warmup_steps of the rate."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + warmup_from) / cfg.warmup_steps
    if step >= decay_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / (decay_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (
        cfg.learning_rate - cfg.min_lr
    )


# WRONG: cosine always ends at max_steps, lr_decay_steps ignored
@blind_build("training_step", "learning_rate")
def ignores_lr_decay_steps(step, cfg):
    return _blind_rate(step, cfg, cfg.max_steps)  # the mistake: was `cfg.lr_decay_steps or ...`


# WRONG: warmup starts at rate 0 at step 0 (step / warmup_steps), off by one
@blind_build("training_step", "learning_rate", known="schedule_one_step_off")
def warmup_from_zero(step, cfg):
    # the mistake: was `(step + 1) / cfg.warmup_steps` in the warmup
    return _blind_rate(step, cfg, cfg.lr_decay_steps or cfg.max_steps, warmup_from=0)


def _blind_norm(grads) -> float:
    return torch.stack([g.norm() for g in grads]).norm().item()


def _blind_clip(parameters, max_norm, norm_of=_blind_norm):
    """The reference's clip_gradients, the gradients' norm as `norm_of(grads)` says."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = norm_of(grads)
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
    return norm


# WRONG: global norm computed as the sum of each gradient's L2 norm
@blind_build("training_step", "clip_gradients")
def clip_sum_of_norms(parameters, max_norm):
    # the mistake: was the norm of the norms
    return _blind_clip(parameters, max_norm, lambda grads: sum(g.norm().item() for g in grads))


# WRONG: clip_gradients iterates `parameters` twice (a generator is empty the 2nd time, so
# nothing is clipped); train_step happens to pass a list
@blind_build("training_step", "clip_gradients", name="clip_iterates_twice_list")
def _clip_iterating_twice(parameters, max_norm):
    norm = _blind_norm([p.grad for p in parameters if p.grad is not None])
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for p in parameters:  # the mistake: `parameters` read again (a generator is spent)
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


def _blind_train_step(
    model,
    optimizer,
    batches,
    step,
    cfg,
    first_group_only=False,
    last_loss=False,
    zero_clips=False,
    cleared_first=False,
    as_list=False,
):
    """The reference's train_step, with the mistakes its arguments name."""
    if cleared_first:
        optimizer.zero_grad(set_to_none=True)
    groups = optimizer.param_groups[:1] if first_group_only else optimizer.param_groups
    for group in groups:
        group["lr"] = learning_rate(step, cfg)
    total = 0.0
    for _ in range(cfg.grad_accum_steps):
        x, y = next(batches)
        loss = model(x, y).loss / cfg.grad_accum_steps
        loss.backward()
        total = loss.item() * cfg.grad_accum_steps if last_loss else total + loss.item()
    max_norm = cfg.grad_clip if zero_clips or cfg.grad_clip > 0 else math.inf
    parameters = list(model.parameters()) if as_list else model.parameters()
    norm = clip_gradients(parameters, max_norm)
    optimizer.step()
    if not cleared_first:
        optimizer.zero_grad(set_to_none=True)
    return total, norm


@blind_build("training_step", "train_step", name="clip_iterates_twice_list")
def _clip_given_a_list(model, optimizer, batches, step, cfg):
    return _blind_train_step(model, optimizer, batches, step, cfg, as_list=True)


# WRONG: grad_clip 0 passed straight to clipping (every gradient zeroed) instead of meaning
# 'no clipping'
@blind_build("training_step", "train_step")
def clip_zero_clips(model, optimizer, batches, step, cfg):
    return _blind_train_step(model, optimizer, batches, step, cfg, zero_clips=True)


# WRONG: gradients cleared at the start of train_step instead of after the optimizer step
# (left set on return)
@blind_build("training_step", "train_step")
def grads_cleared_first(model, optimizer, batches, step, cfg):
    return _blind_train_step(model, optimizer, batches, step, cfg, cleared_first=True)


# WRONG: returns the last micro-batch's loss (unscaled), not the mean over micro-batches
@blind_build("training_step", "train_step")
def loss_last_micro(model, optimizer, batches, step, cfg):
    return _blind_train_step(model, optimizer, batches, step, cfg, last_loss=True)


# WRONG: the schedule's rate is set on the first parameter group only
@blind_build("training_step", "train_step")
def lr_first_group_only(model, optimizer, batches, step, cfg):
    return _blind_train_step(model, optimizer, batches, step, cfg, first_group_only=True)


# -- build verify: RollbackCache, verify_greedy, accept_or_resample, verify_sampled ----------
# These run with the learner module's globals: score, accept_or_resample.


# WRONG: RollbackCache mask aligned top-left: new query i sees keys 0..i only
@blind_build("verify", "RollbackCache.prepare", name="mask_top_left")
def _rollback_mask_top_left(self, batch, q_len, device):
    past, kv_len = self.seq_len, self.seq_len + q_len
    query_pos = torch.arange(past, kv_len, device=device)
    key_pos = torch.arange(kv_len, device=device)
    # the mistake: was `key_pos[None, :] <= query_pos[:, None]`
    return query_pos[None, :], key_pos[None, :] <= torch.arange(q_len, device=device)[:, None]


# WRONG: truncate moves the length counter back but leaves the layers' tensors long
@blind_build("verify", "RollbackCache", name="truncate_counter_only")
class TruncateCounterOnly:
    """The writer's cache, which counts its length itself."""

    def __init__(self) -> None:
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._len = 0

    @property
    def seq_len(self) -> int:
        return self._len

    def prepare(self, batch, q_len, device):
        past, kv = self._len, self._len + q_len
        qpos = torch.arange(past, kv, device=device)
        self._len = kv
        return qpos[None, :], torch.arange(kv, device=device)[None, :] <= qpos[:, None]

    def update(self, layer, k, v):
        if layer < len(self.layers):
            pk, pv = self.layers[layer]
            self.layers[layer] = (torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2))
        else:
            self.layers.append((k, v))
        return self.layers[layer]

    def truncate(self, n: int) -> None:
        # the mistake: `self.layers = [(k[:, :, :n], v[:, :, :n]) for k, v in self.layers]`
        # left out
        self._len = n


def _blind_greedy(target, cache, last_token, drafts, kept_on_rejection=1, bonus=True):
    """The writer's greedy verify: on a rejection at draft i the cache keeps held +
    `kept_on_rejection` + i positions; `bonus` False: all drafts kept, no token after them."""
    held = cache.seq_len
    choices = score(target, cache, last_token, drafts).argmax(dim=-1).tolist()
    for i, drafted in enumerate(drafts):
        if drafted != choices[i]:
            cache.truncate(held + kept_on_rejection + i)
            return [*drafts[:i], choices[i]]
    cache.truncate(held + 1 + len(drafts))
    return [*drafts, choices[len(drafts)]] if bonus else list(drafts)


# WRONG: greedy verify returns only the drafts when all are kept (no bonus token)
@blind_build("verify", "verify_greedy")
@torch.no_grad()
def greedy_no_bonus(target, cache, last_token, drafts):
    return _blind_greedy(target, cache, last_token, drafts, bonus=False)


# WRONG: greedy rollback keeps held + i on a rejection: last_token's key is dropped too
@blind_build("verify", "verify_greedy")
@torch.no_grad()
def greedy_truncate_forgets_last(target, cache, last_token, drafts):
    # the mistake: was `held + 1 + i` on a rejection
    return _blind_greedy(target, cache, last_token, drafts, kept_on_rejection=0)


def _blind_rule(p, q, drafted, generator, uniform=None, kept=None, residual_of=None):
    """The reference's accept_or_resample: the draft kept when `kept(u, p, q)` (u < p / q by
    default, u drawn by `uniform()`, from `generator` by default), else a token drawn from
    `residual_of(p, q)` (max(0, p - q) by default)."""
    u = torch.rand((), generator=generator) if uniform is None else uniform()
    if (kept or (lambda u, p, q: u * q[drafted] < p[drafted]))(u, p, q):
        return drafted, True
    residual = (p - q).clamp(min=0) if residual_of is None else residual_of(p, q)
    if float(residual.sum()) <= 0:
        residual = p
    token = torch.multinomial(residual / residual.sum(), 1, generator=generator)
    return int(token), False


# WRONG: draft kept exactly when p(x) >= q(x) (no uniform draw), else resampled
@blind_build("verify", "accept_or_resample")
def deterministic_accept(p, q, drafted, generator):
    # the mistake: was `u * q[drafted] < p[drafted]`, u drawn from generator
    return _blind_rule(p, q, drafted, generator, kept=lambda u, p, q: p[drafted] >= q[drafted])


# WRONG: the acceptance uniform comes from the global RNG (torch.rand without the generator)
@blind_build("verify", "accept_or_resample")
def global_rng_u(p, q, drafted, generator):
    # the mistake: was `torch.rand((), generator=generator)`
    return _blind_rule(p, q, drafted, generator, uniform=lambda: torch.rand(()))


# WRONG: on rejection the token is drawn from p, not from the residual max(0, p - q)
@blind_build("verify", "accept_or_resample", known="no_residual")
def resample_from_p(p, q, drafted, generator):
    # the mistake: was `(p - q).clamp(min=0)`
    return _blind_rule(p, q, drafted, generator, residual_of=lambda p, q: p)


def _blind_sampled(
    target,
    cache,
    last_token,
    drafts,
    draft_probs,
    generator,
    row_shift=0,
    bonus_row=0,
    greedy_bonus=False,
    rollback=True,
):
    """The reference's sampled verify: draft i against the target's row i + `row_shift`,
    the bonus from row len(drafts) + `bonus_row` (its argmax if `greedy_bonus`), the cache
    rolled back after a rejection if `rollback`."""
    held = cache.seq_len
    p = torch.softmax(score(target, cache, last_token, drafts), dim=-1)
    tokens = []
    for i, drafted in enumerate(drafts):
        row = p[i + row_shift]
        token, kept = accept_or_resample(row, draft_probs[i].float(), drafted, generator)
        tokens.append(token)
        if not kept:
            if rollback:
                cache.truncate(held + len(tokens))
            return tokens
    last = p[len(drafts) + bonus_row]
    bonus = last.argmax() if greedy_bonus else torch.multinomial(last, 1, generator=generator)
    tokens.append(int(bonus))
    cache.truncate(held + len(tokens))
    return tokens


# WRONG: sampled verify takes the bonus token greedily (argmax), not drawn from p
@blind_build("verify", "verify_sampled")
@torch.no_grad()
def bonus_argmax(target, cache, last_token, drafts, draft_probs, generator):
    # the mistake: was `torch.multinomial(p[len(drafts)], 1, generator=generator)`
    return _blind_sampled(
        target, cache, last_token, drafts, draft_probs, generator, greedy_bonus=True
    )


# WRONG: sampled bonus drawn from the last draft's row (probs[k-1]), off by one
@blind_build("verify", "verify_sampled")
@torch.no_grad()
def bonus_wrong_row(target, cache, last_token, drafts, draft_probs, generator):
    # the mistake: was `p[len(drafts)]`
    return _blind_sampled(target, cache, last_token, drafts, draft_probs, generator, bonus_row=-1)


# WRONG: sampled verify never truncates the cache after a rejection
@blind_build("verify", "verify_sampled")
@torch.no_grad()
def sampled_no_rollback(target, cache, last_token, drafts, draft_probs, generator):
    # the mistake: `cache.truncate(held + len(tokens))` left out on a rejection
    return _blind_sampled(target, cache, last_token, drafts, draft_probs, generator, rollback=False)


# WRONG: sampled verify compares draft i with the target's row i + 1 (the row after it)
@blind_build("verify", "verify_sampled")
@torch.no_grad()
def sampled_q_from_p_row_shift(target, cache, last_token, drafts, draft_probs, generator):
    # the mistake: was `p[i]`
    return _blind_sampled(target, cache, last_token, drafts, draft_probs, generator, row_shift=1)
