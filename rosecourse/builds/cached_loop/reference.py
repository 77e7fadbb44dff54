"""Build (chapters 02-06): a static KV cache that plugs into rose's GPT, and the cached
greedy loop that runs on it.

rose's model is stateless: a generation loop owns a cache and hands it to every call,
`model(ids, cache=cache)` (rosetrainer/model.py). Per call, before any layer runs, the
model asks `pos, mask = cache.prepare(batch, q_len, device)`; then each layer asks
`k, v = cache.update(layer, k_new, v_new)` and attends over what comes back. Read the
`KVCache` protocol and `CausalSelfAttention.forward` there for the shapes.

Rows of a batch are left-padded to one length: row i's first `pad_lengths[i]` slots hold
padding, which no query ever attends to and which positions do not count (the first
real token of every row stands at position 0).

`rose-course check cached_loop` runs rose's GPT on your cache and compares its logits
at every step with the uncached oracle's (one row, a ragged batch of three, a prefill in
chunks of 3 and of 1 token, and a bfloat16 model, where the keys and values your cache
hands back must be in the model's dtype and never NaN), checks that your cache's memory
stays flat while it decodes, and runs your loop (on rose's own static cache, so the loop
is graded on its own) token for token against the uncached greedy run of each prompt,
with an end-of-text token generated mid-run (the loop goes on). It also counts your
loop's model calls: one StaticCache for all the prompts, every call on it with every
row, the prefill in `prefill_chunk` pieces (1, 3, more than the prompt), then one token
a row per decode step.
"""

from __future__ import annotations

import torch

from rosetrainer.model import GPT


class StaticLayer:
    """One layer's key and value buffers, each (B, n_head, max_len, head_dim)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep `k` and `v` as this layer's buffers: every write goes into these tensors."""
        self.k = k
        self.v = v

    def update(
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys and values (B, n_head, q_len, head_dim) of every row into
        slots `input_pos` (q_len slot numbers, the same for every row) along the time axis,
        in place; return the whole buffers (slots not written yet included)."""
        self.k[:, :, input_pos] = k
        self.v[:, :, input_pos] = v
        return self.k, self.v


class StaticCache:
    """rose's KVCache protocol over buffers allocated once: nothing grows while decoding."""

    def __init__(
        self, model: GPT, batch_size: int, max_len: int, pad_lengths: list[int] | None = None
    ) -> None:
        """One StaticLayer per block of `model`, with buffers of `batch_size` rows and
        `max_len` slots, zeros in the dtype and on the device of the model's weights
        (`model.config` holds n_layer, n_head and n_embd). `pad_lengths`: each row's left
        padding (None: no padding). The cache starts empty."""
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
        self.real = slots[None, :] >= self.pads[:, None]

    def prepare(
        self, batch: int, q_len: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The q_len new tokens take the next q_len slots. Returns their positions (batch,
        q_len) and the mask (batch, 1, q_len, max_len), True where the new query (a row)
        may attend to the slot (a column): the slots up to its own, never a padding
        slot. A query of a padding slot would then see nothing; its output is never
        read, but a softmax over nothing may be NaN, which its values would carry into
        later layers: rose lets such a query see every slot."""
        self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
        self.filled += q_len
        slots = torch.arange(self.max_len, device=device)
        # The rows input_pos of the full causal mask: the bottom q_len of filled rows.
        causal = slots[None, :] <= self.input_pos[:, None]
        mask = causal[None, None, :, :] & self.real[:, None, None, :]
        mask = mask | ~mask.any(dim=-1, keepdim=True)
        pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)
        return pos, mask

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s new keys and values go to the slots the last `prepare` gave the
        new tokens; returns every key and value of that layer the queries attend over."""
        return self.layers[layer].update(self.input_pos, k, v)


@torch.no_grad()
def generate_cached(
    model: GPT, prompts: list[list[int]], max_new_tokens: int, prefill_chunk: int | None = None
) -> list[list[int]]:
    """Greedy decoding of every prompt at once, on one StaticCache: the max_new_tokens
    tokens that follow each prompt (no stopping early), in the prompts' order.

    The prompts are left-padded with token 0 to the longest; the cache is built as
    `StaticCache(model, len(prompts), max_len, pad_lengths)` with room for every token the
    model is fed (the check swaps rose's own static cache in under that name). The
    padded prompts go through `model(ids, cache=cache)` at once, or `prefill_chunk`
    tokens at a time; each row's first new token is the argmax of the logits at its last
    prompt token; then every step feeds each row's newest token alone.
    """
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
        next_ids = logits.argmax(dim=-1)
        for row, token in zip(new_tokens, next_ids.tolist(), strict=True):
            row.append(token)
        if step + 1 < max_new_tokens:  # the last token is never fed back
            logits = model(next_ids[:, None], cache=cache).logits[:, -1]
    return new_tokens


# `rose-course hint cached_loop` gives these one at a time, the idea first and the
# near-code last (`rose-course check cached_loop` counts how many were used); the stub
# leaves them out.
HINTS = (
    "The cache is one set of buffers and one counter: every call's q_len new tokens take "
    "the next q_len slots, the same slots in every row (a row's padding sits in its first "
    "slots). Everything prepare returns follows from those slot numbers and each row's "
    "padding.",
    "StaticCache.__init__: the buffers' shape is (batch_size, n_head, max_len, n_embd // "
    "n_head), in the dtype and on the device of a model weight (model.lm_head.weight): a "
    "bfloat16 model needs bfloat16 keys and values.",
    "StaticCache.prepare, the positions: a token's position is its slot minus its row's "
    "padding (the first real token at 0); the padding's own slots would come out "
    "negative, so clamp them at 0 (nothing reads what a padding slot computes).",
    "StaticCache.prepare, the mask: two conditions, combined with &: causal (the slot is "
    "at or before the query's own slot) and real (the slot is not padding of that row). "
    "Then a row of the mask that allows nothing (a padding query) must allow everything: "
    "`mask | ~mask.any(dim=-1, keepdim=True)`.",
    "generate_cached: left-pad the prompts with 0 to the longest; the cache needs "
    "longest + max_new_tokens slots; feed the padded prompts in prefill_chunk slices "
    "(all at once when it is None), keeping only the last slice's logits[:, -1]; then "
    "feed next_ids[:, None], one token a row, each step. The last new token is never fed.",
    "StaticCache.prepare, near-code:\n"
    "    input_pos = torch.arange(filled, filled + q_len); filled += q_len\n"
    "    causal = slots[None, :] <= input_pos[:, None]          # (q_len, max_len)\n"
    "    mask = causal[None, None] & real[:, None, None, :]     # real: (B, max_len)\n"
    "    pos = (input_pos[None, :] - pads[:, None]).clamp(min=0)",
)
