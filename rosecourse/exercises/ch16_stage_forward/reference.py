"""Chapter 16: one pipeline stage's share of a model call."""

from __future__ import annotations

import torch

from roseinfer.pipeline.stage import PipelineStage
from rosetrainer.model import KVCache, embed, rope_for


def stage_forward(stage: PipelineStage, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Run the stage's blocks on top of its own cache.

    x: token ids (batch, q_len) at the first stage, hidden states (batch, q_len, n_embd)
    after it. The stage holds `stage.transformer.h` (its blocks), the embeddings at the
    first stage (`stage.is_first`), `ln_f` and `stage.lm_head` at the last
    (`stage.is_last`); `stage.layers` is the range of its blocks' numbers in the whole
    model. The cache holds this stage's layers only, numbered from 0; ask it once per
    call for positions and mask (`cache.prepare(batch, q_len, device)`). rose's model
    has the pieces a stage shares with it (rosetrainer/model.py): the first hidden states
    are `embed(stage.transformer, ids, positions)`, and a block runs as
    `block(x, mask, cache, layer, rope)`, where rope is what `rope_for(stage.config,
    positions)` gives (a rotary model's angles; None for learned positions). Return the
    hidden states, or at the last stage the logits of each row's last token, (batch,
    vocab).
    """
    batch, q_len = x.shape[:2]
    positions, mask = cache.prepare(batch, q_len, x.device)
    parts = stage.transformer
    rope = rope_for(stage.config, positions)
    if stage.is_first:
        x = embed(parts, x, positions)
    for local, block in enumerate(parts.h):
        x = block(x, mask, cache, local, rope)  # the cache's layer: the block's number in the stage
    if stage.is_last:
        x = stage.lm_head(parts.ln_f(x)[:, -1, :])
    return x


# `rose-course hint 16` gives these one at a time, the idea first and the near-code
# last (`rose-course check 16` counts how many were used); the stub leaves them out.
HINTS = (
    "A stage is a slice of the model: the first turns ids into hidden states, every stage "
    "runs its blocks, the last turns hidden states into logits. Its cache holds only its "
    "own layers.",
    "Ask the cache once per call: positions, mask = cache.prepare(batch, q_len, x.device); "
    "every block of the stage uses that mask, and the stage's local-th block (0, 1, ...) is "
    "layer local of its cache, whatever its number in the whole model.",
    "At the last stage: stage.lm_head(stage.transformer.ln_f(x)[:, -1, :]), the logits of "
    "each row's last token only.",
)
