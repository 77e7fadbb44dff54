"""Chapter 16: one pipeline stage's share of a model call."""

from __future__ import annotations

import torch

from roseinfer.pipeline.stage import PipelineStage
from rosetrainer.model import KVCache


def stage_forward(stage: PipelineStage, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Run the stage's blocks on top of its own cache.

    x: token ids (batch, q_len) at the first stage, hidden states (batch, q_len, n_embd)
    after it. The stage holds `stage.transformer.h` (its blocks), `wte`, `wpe`, `drop`
    at the first stage (`stage.is_first`), `ln_f` and `stage.lm_head` at the last
    (`stage.is_last`); `stage.layers` is the range of its blocks' numbers in the whole
    model. The cache holds this stage's layers only, numbered from 0; ask it once per
    call for positions and mask (`cache.prepare(batch, q_len, device)`); a block runs as
    `block(x, mask, cache, layer)`. Return the hidden states, or at the last stage the
    logits of each row's last token, (batch, vocab).
    """
    batch, q_len = x.shape[:2]
    positions, mask = cache.prepare(batch, q_len, x.device)
    parts = stage.transformer
    if stage.is_first:
        x = parts.drop(parts.wte(x) + parts.wpe(positions))
    for local, block in enumerate(parts.h):
        x = block(x, mask, cache, local)  # the cache's layer: the block's number in the stage
    if stage.is_last:
        x = stage.lm_head(parts.ln_f(x)[:, -1, :])
    return x
