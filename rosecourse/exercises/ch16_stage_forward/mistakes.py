"""Chapter 16's known answers (data: rosecourse/exercises/answers.py says what each kind
is; tests/course/test_mutants.py runs them against this chapter's check)."""

from __future__ import annotations

import torch

from rosecourse.exercises.answers import alternative, blind, known, mutant
from roseinfer.pipeline.stage import PipelineStage, cache_slot
from rosetrainer.model import KVCache

# -- the known mistakes: the check names each one it meets (answers.known) ----------


@known(
    "16",
    "you hand the cache the block's global layer number: a stage's cache holds "
    "only its own layers, numbered from 0, so a later stage writes past its end "
    "(a concatenating cache starts a new layer there and loses the past)",
)
def _global_layer(stage, x, cache):
    batch, q_len = x.shape[:2]
    pos, attn_mask = cache.prepare(batch, q_len, x.device)
    parts = stage.transformer
    if stage.is_first:
        x = parts.drop(parts.wte(x) + parts.wpe(pos))
    for local, block in enumerate(parts.h):
        x = block(x, attn_mask, cache, stage.layers[local])
    return stage.lm_head(parts.ln_f(x)[:, -1, :]) if stage.is_last else x


@known(
    "16",
    "the last stage returns logits for every position: return the last token's "
    "row alone, (batch, vocab)",
)
def _every_position(stage, x, cache):
    batch, q_len = x.shape[:2]
    pos, attn_mask = cache.prepare(batch, q_len, x.device)
    parts = stage.transformer
    if stage.is_first:
        x = parts.drop(parts.wte(x) + parts.wpe(pos))
    for local, block in enumerate(parts.h):
        x = block(x, attn_mask, cache, cache_slot(stage.layers, local))
    return stage.lm_head(parts.ln_f(x)) if stage.is_last else x


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


# -- Written blind (issue 45) --


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
