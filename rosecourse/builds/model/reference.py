"""Build (chapter 00): GPT-2 itself, the network rose trains and serves.

Four modules, each an `nn.Module`, whose parameters carry rose's names and shapes
(rosetrainer/model.py), so that a state dict of rose's GPT loads into yours with
`load_state_dict(strict=True)` and the two compute the same function. Create no other
parameters and no buffers (a mask you keep must be registered with `persistent=False`,
or built in `forward`). Every Linear and LayerNorm has a bias exactly when
`config.bias` is True; every LayerNorm is `nn.LayerNorm`'s, eps 1e-5 (GPT-2's); the
model runs without dropout (`config.dropout` is 0 here), in train mode as in eval mode.
Like rose's, it runs wherever `model.to(...)` puts it: in bfloat16 as in float32, on a
GPU as on the CPU (a tensor made in `forward` goes on its input's device, and what it
computes stays in the model's dtype; nothing is kept from one call to the next but what
moves with the model).
`config` is a `rosetrainer.config.GPTConfig`; read only vocab_size, block_size,
n_layer, n_head, n_embd and bias.

`rose-course check model` loads rose's weights into each of your modules and compares
them with rose's: attention, MLP and block on hidden states of several lengths, the
whole model's logits on batches of several lengths (in eval mode and in train mode, in
float32 and in bfloat16, then moved to another device), and its gradients after a loss
(in train mode).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from rosetrainer.config import GPTConfig


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention over a whole sequence (no cache)."""

    def __init__(self, config: GPTConfig) -> None:
        """Parameters: `c_attn`, one Linear n_embd -> 3 * n_embd whose output is the
        queries, then the keys, then the values (n_embd features each); `c_proj`, a
        Linear n_embd -> n_embd applied to the heads' joined outputs. n_head heads of
        head_dim = n_embd // n_head features each."""
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, n_embd) hidden states -> (B, T, n_embd): GPT-2's multi-head causal
        self-attention, the scaled dot-product attention of "Attention Is All You Need",
        where the query at position i sees the keys at positions 0 .. i only.

        The layout is rose's, so that its weights mean the same in yours: head h owns
        features h * head_dim .. (h + 1) * head_dim - 1 of the queries, of the keys, of
        the values, and of the heads' joined output that c_proj reads.
        """
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
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    """The feed-forward half of a block, applied to each position on its own."""

    def __init__(self, config: GPTConfig) -> None:
        """Parameters: `c_fc`, a Linear n_embd -> 4 * n_embd, and `c_proj`, a Linear
        4 * n_embd -> n_embd."""
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, n_embd) -> (B, T, n_embd): c_fc, then GPT-2's GELU, the tanh
        approximation that OpenAI's GPT-2 code computes (Hugging Face's "gelu_new"), then
        c_proj."""
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    """One transformer block, layer norms before each half (GPT-2's "pre-LN" order)."""

    def __init__(self, config: GPTConfig) -> None:
        """Parameters: `ln_1` (a LayerNorm over n_embd), `attn` (your CausalSelfAttention),
        `ln_2` (a LayerNorm over n_embd), `mlp` (your MLP)."""
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, n_embd) -> (B, T, n_embd): the attention, then the MLP, each a
        residual branch that reads the stream through its own layer norm (ln_1, ln_2)
        and adds what it computes back to the stream."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2: token ids in, next-token logits out."""

    def __init__(self, config: GPTConfig) -> None:
        """Parameters: `transformer`, an nn.ModuleDict holding `wte` (an Embedding of
        vocab_size tokens), `wpe` (an Embedding of block_size learned positions), `h` (an
        nn.ModuleList of n_layer Blocks) and `ln_f` (the final LayerNorm); and `lm_head`,
        a Linear n_embd -> vocab_size without bias whose weight IS wte's weight (one
        Parameter, tied: reading a token in and scoring it out use one matrix). Weights
        may start however you like: the check loads rose's."""
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: (B, T) token ids, 1 <= T <= block_size, the token at index t standing at
        position t -> logits (B, T, vocab_size): at each position, the scores of the token
        that comes next, as GPT-2 computes them with the modules above (wpe holds the
        positions' learned embeddings; a tensor made here goes on idx's device, where the
        model is)."""
        T = idx.size(1)
        positions = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


# `rose-course hint model` gives these one at a time, the idea first and the near-code
# last (`rose-course check model` counts how many were used); the stub leaves them out.
HINTS = (
    "The pieces, smallest first: MLP and Block are a few lines each, the attention is the "
    "real work, and GPT ties them together. `rose-course check model` grades each module on "
    "its own (a line per part), so write one, check, and go on.",
    "GPT.__init__: tying the head is one assignment once both exist: "
    "`self.lm_head.weight = self.transformer.wte.weight`. Then there is one Parameter, "
    "listed under both names in the state dict.",
    "Block.forward: pre-LN means each half reads a normalised copy of the stream and adds "
    "its result to the stream itself (never to the normalised copy).",
    "CausalSelfAttention.forward: one product makes the queries, keys and values side by "
    "side; `.split(n_embd, dim=2)` cuts c_attn's output into the three (B, T, n_embd) "
    "tensors.",
    "CausalSelfAttention.forward: give the heads an axis of their own. "
    "(B, T, n_embd) -> view (B, T, n_head, head_dim) -> transpose(1, 2) -> "
    "(B, n_head, T, head_dim): one batched matrix product then scores every head at once.",
    "CausalSelfAttention.forward: the scores (B, n_head, T, T) are q @ k.transpose(-2, -1) "
    "/ sqrt(head_dim). Row i is query i, column j key j: the keys above the diagonal are "
    "the future; set those scores to -inf before the softmax over the last axis "
    "(torch.ones(T, T, dtype=torch.bool).tril() is True where a query may look).",
    "CausalSelfAttention.forward, near-code:\n"
    "    q, k, v = self.c_attn(x).split(C, dim=2)\n"
    "    q = q.view(B, T, n_head, head_dim).transpose(1, 2)  # and k, v alike\n"
    "    weights = softmax(scores with the future at -inf, dim=-1)\n"
    "    y = (weights @ v).transpose(1, 2).contiguous().view(B, T, C)  # heads side by side\n"
    "    return self.c_proj(y)",
    "GPT.forward, near-code:\n"
    "    x = wte(idx) + wpe(torch.arange(T, device=idx.device))\n"
    "    for block in self.transformer.h: x = block(x)\n"
    "    return self.lm_head(self.transformer.ln_f(x))",
)
