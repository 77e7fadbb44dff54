"""A sample of text from a GPT, the plain way: the whole sequence through the model each step.

This is the trainer's look at what it has learned, and it needs nothing beyond the
model: no cache, so every step reruns the (cropped) sequence and samples the last
position's next token. The fast, cached generation is the inference package's job,
built on the same model; this is its slow, obvious ancestor.
"""

from __future__ import annotations

import torch

from rosetrainer.model import GPT
from rosetrainer.tokenizer import Tokenizer


@torch.no_grad()
def generate(
    model: GPT,
    ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    vocab_limit: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """ids (B, T) followed by max_new_tokens sampled ids: (B, T + max_new_tokens).

    Only the last block_size ids fit the model's learned positions, so each step sees
    those. vocab_limit keeps the draws below a tokenizer's size when the model's
    vocabulary is padded past it (50,304 for GPT-2's 50,257, as nanoGPT pads).
    """
    for _ in range(max_new_tokens):
        context = ids[:, -model.config.block_size :]
        logits = model(context).logits[:, -1, :vocab_limit] / temperature
        if top_k is not None and top_k < logits.size(-1):
            kth_largest = torch.topk(logits, top_k).values[:, -1:]
            logits = logits.masked_fill(logits < kth_largest, float("-inf"))
        probs = torch.softmax(logits.float(), dim=-1)
        next_ids = torch.multinomial(probs, num_samples=1, generator=generator)
        ids = torch.cat([ids, next_ids], dim=1)
    return ids


def sample_text(model: GPT, tokenizer: Tokenizer, n_tokens: int, seed: int) -> str:
    """n_tokens from the model started from end-of-text; temperature 0.8, top-k 200, seeded.

    The text ends early where the model writes end-of-text."""
    device = model.transformer.wte.weight.device
    start = torch.tensor([[tokenizer.eot_id]], device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = generate(
        model.eval(),
        start,
        n_tokens,
        temperature=0.8,
        top_k=200,
        vocab_limit=tokenizer.n_vocab,
        generator=generator,
    )[0, 1:].tolist()
    if tokenizer.eot_id in ids:
        ids = ids[: ids.index(tokenizer.eot_id)]
    return tokenizer.decode(ids)
