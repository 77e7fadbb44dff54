"""Chapter 01: greedy decoding without a cache: the reference every later chapter meets."""

from __future__ import annotations

import torch

from rosetrainer.model import GPT


def greedy_decode(model: GPT, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The `max_new_tokens` token ids greedy decoding chooses after `prompt_ids`.

    No cache: each step runs the model on the whole sequence so far, (1, length) ids,
    and picks the most likely next token. `model(ids).logits` is (1, length, vocab); the
    ids stand on the model's device (a model on a GPU reads no CPU ids).
    Return the new ids only, not the prompt. (The prompt plus the new tokens stay
    within model.config.block_size in the check.)
    """
    ids, device = list(prompt_ids), model.lm_head.weight.device
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids], device=device)).logits
            # The last position's logits predict the token after the whole sequence.
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


# `rose-course hint 01` gives these one at a time, the idea first and the near-code
# last (`rose-course check 01` counts how many were used); the stub leaves them out.
HINTS = (
    "No cache: every step runs the model over the whole sequence so far (the prompt and the "
    "tokens chosen), and reads only the prediction at its last position.",
    "model(torch.tensor([ids], device=device)).logits[0, -1] scores the next token, with the "
    "ids on the model's device (device = model.lm_head.weight.device); its argmax, as an "
    "int, is the greedy choice. Append it to ids and go on, max_new_tokens times, under "
    "torch.no_grad().",
    "Near-code:\n"
    "    ids, device = list(prompt_ids), model.lm_head.weight.device\n"
    "    for _ in range(max_new_tokens): ids.append(int(model(torch.tensor([ids], device=device)).logits[0, -1].argmax()))\n"
    "    return ids[len(prompt_ids):]",
)
