"""Chapter 01: greedy decoding without a cache: the reference every later chapter meets."""

from __future__ import annotations

import torch

from rosetrainer.model import GPT


def greedy_decode(model: GPT, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The `max_new_tokens` token ids greedy decoding chooses after `prompt_ids`.

    No cache: each step runs the model on the whole sequence so far, (1, length) ids,
    and picks the most likely next token. `model(ids).logits` is (1, length, vocab).
    Return the new ids only, not the prompt. (The prompt plus the new tokens stay
    within model.config.block_size in the check.)
    """
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits
            # The last position's logits predict the token after the whole sequence.
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]
