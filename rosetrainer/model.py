"""The one GPT-2 of rose, and the Llama-shaped choices it can make.

GPT-2 is the model a reader meets first; a GPTConfig can swap four of its parts for the
ones Llama, SmolLM2 and Qwen2 use, each shown where it differs: rotary positions instead
of a table (`rotary_cos_sin`), RMSNorm instead of LayerNorm (`norm_layer`), a SwiGLU MLP
instead of GELU (`MLP`), and grouped-query attention (`CausalSelfAttention`: fewer
key/value heads than query heads, each serving a group of queries, so a cache holds
n_head / n_kv_head times fewer keys and values).

Read top to bottom: the small functions that hold the KV-cache invariants
(`concat_kv`, `causal_mask`, `position_ids`), the sliding-window mask (`window_mask`),
the rotary pieces (`rotary_cos_sin`, `apply_rotary`, `rotate_then_cache`), the cache
protocol (`KVCache`: what the model asks of any cache, and `AttendingKVCache`: a cache
that computes attention over what it holds itself), then attention, the MLP, a
transformer block, and the model. Parameter names follow OpenAI's / Hugging Face's
GPT-2 so their weights load with a transpose and nothing else.

The model is stateless: a cache is passed in, written by each layer, and owned by the
caller (the inference package keeps every kind in roseinfer/cache/: the concatenating
and the preallocated caches in dense.py, the engine's paged pool in paged.py, and the
rolling, quantized and offloaded ones). Without a cache the model sees the whole
sequence at once.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError

# ---------------------------------------------------------------------------
# The three KV-cache invariants, each a named function so a chapter can point at
# it, and a test can swap in the buggy version and watch the output diverge.
# ---------------------------------------------------------------------------


def concat_kv(
    layer_past: tuple[torch.Tensor, torch.Tensor] | None, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values a new token attends to: the cached past, then its own, along time (dim 2)."""
    if layer_past is None:
        return k, v
    past_k, past_v = layer_past
    return torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)


def causal_mask(q_len: int, kv_len: int, device: torch.device | None = None) -> torch.Tensor:
    """(q_len, kv_len) bool mask, True where a query may look: bottom-right aligned.

    The q_len queries are the *last* q_len of the kv_len positions (the ones before
    them are the cached past), so query i sits at position kv_len - q_len + i and sees
    keys 0 .. kv_len - q_len + i. With q_len == kv_len this is the usual lower
    triangle; a single decode query (q_len == 1) sees every key. PyTorch's
    `is_causal=True` aligns the triangle top-left instead, which is only right when
    q_len == kv_len.
    """
    query_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    key_pos = torch.arange(kv_len, device=device)
    return key_pos[None, :] <= query_pos[:, None]


def position_ids(past_len: int, q_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Positions of the q_len new tokens: they continue after the past_len cached ones."""
    return torch.arange(past_len, past_len + q_len, device=device)


def padded_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-row positions for left-padded rows: count only real tokens (padding clamped to 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def padding_mask(mask: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Combine a (q_len, kv_len) causal mask with a (B, kv_len) padding mask -> (B, 1, q, kv).

    A padding query sees no real key at all; an all-False row would make softmax
    return NaN, so such rows are opened up. Their outputs are never read.
    """
    combined = mask[None, None, :, :] & attention_mask[:, None, None, :].bool()
    return combined | ~combined.any(dim=-1, keepdim=True)


def window_mask(
    query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None, sinks: int = 0
) -> torch.Tensor:
    """True where a query at `query_pos` may look at a key at `key_pos` (broadcast).

    Causal: never a later key. With a sliding window the query sees only the last
    `window` positions (its own included), plus the first `sinks` positions, which every
    query keeps seeing (attention sinks). Without a window it is the causal mask.
    """
    seen = key_pos <= query_pos
    if window is None:
        return seen
    return seen & ((key_pos > query_pos - window) | (key_pos < sinks))


def banded_mask(
    q_len: int, kv_len: int, window: int | None, sinks: int = 0, device: torch.device | None = None
) -> torch.Tensor:
    """`causal_mask` (bottom-right aligned, (q_len, kv_len)) cut to the window and its sinks."""
    query_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    key_pos = torch.arange(kv_len, device=device)
    return window_mask(query_pos[:, None], key_pos[None, :], window, sinks)


# ---------------------------------------------------------------------------
# Rotary positions (RoPE). Channel i of a head is paired with channel i + head_dim/2,
# and the pair is turned by the angle pos * base^(-2i/head_dim) (config.rotary_base). A
# query at p and a key at s then score q . k turned by (p - s): only the distance counts.
# ---------------------------------------------------------------------------


def rotary_cos_sin(
    pos: torch.Tensor, head_dim: int, base: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles of positions `pos` (B, T): each (B, 1, T, head_dim).

    Float32 whatever the model's dtype: at position 10,000 a bf16 angle would be off by
    tens of radians. (apply_rotary rounds the cos and sin to the keys' dtype.)
    """
    exponents = torch.arange(0, head_dim, 2, device=pos.device).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    angles = pos[..., None].float() * inv_freq  # (B, T, head_dim / 2)
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # both halves of a pair, per head
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turn each channel pair (x[i], x[i + d/2]) of x (B, heads, T, d) by its angle."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)


Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) of the new tokens' positions


def rotate(
    q: torch.Tensor, k: torch.Tensor, rope: Rope | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys turned at their own positions (unchanged for learned positions)."""
    if rope is None:
        return q, k
    return apply_rotary(q, *rope), apply_rotary(k, *rope)


def rotate_then_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: Rope | None,
    cache: KVCache | None,
    layer: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rotary invariant: new keys are turned at their own positions *before* they
    enter the cache, so a cached key never moves again; then the cache hands back
    every key/value the new queries attend over."""
    q, k = rotate(q, k, rope)
    if cache is not None:  # keep this layer's new keys/values; attend over all of them
        k, v = cache.update(layer, k, v)
    return q, k, v


LayerPast = tuple[torch.Tensor, torch.Tensor]


@runtime_checkable
class KVCache(Protocol):
    """What the model asks of a KV cache: two questions per call, one per layer.

    Per call, before any layer runs: `prepare(batch, q_len, device)` says where the q_len new
    tokens of each row stand (their positions, (B or 1, q_len)) and which keys their
    queries may see (a boolean mask broadcastable to (B, 1, q_len, kv_len), or None
    for plain causal attention over the new tokens alone). Per layer: `update` keeps
    that layer's new keys/values and returns every key/value the new queries attend
    over, along the time axis. A cache counts the new tokens as held from `prepare` on.
    Keys and values have the model's key/value heads, (B, n_kv_head, T, head_dim): a
    grouped model's cache holds n_head / n_kv_head times fewer of them than its queries.
    """

    def prepare(
        self, batch: int, q_len: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class AttendingKVCache(Protocol):
    """A cache that computes attention over what it holds itself (the serving engine's
    paged pool: many sequences in one flat row, each query attending only to its own
    sequence's keys, read where the pool keeps them, no mask over other sequences' tokens).

    `prepare` as in KVCache (its mask is None: the cache knows who sees what). Per layer,
    `attend(layer, q, k, v)` keeps the new keys/values and returns the new queries'
    attention outputs, (B, n_head, q_len, head_dim) like q; q and k come turned (rotary),
    k and v with the model's n_kv_head heads (the cache keeps those, never a copy per query).
    """

    def prepare(
        self, batch: int, q_len: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


# ---------------------------------------------------------------------------
# The network
# ---------------------------------------------------------------------------


class GPTOutput(NamedTuple):
    # (B, T, vocab), or (B, 1, vocab) with last_only=True; None with targets (the loss is
    # computed without them: linear_cross_entropy)
    logits: torch.Tensor | None
    loss: torch.Tensor | None  # mean cross-entropy over targets != -100, when targets given


def one_query_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None
) -> torch.Tensor:
    """Attention of one new query per row (a decode step) over all kv_len keys.

    The same math as scaled_dot_product_attention, written out: SDPA's fused CPU kernel
    is built for blocks of many queries, and for a single query it is the slower choice
    (several times slower in bf16 on a CPU without bf16 instructions), while these few
    lines compile into one fused kernel. The softmax runs in float32, as SDPA's does.

    Grouped queries: query heads g * group .. (g + 1) * group - 1 share key/value head g,
    so q (B, n_head, 1, d) is read as (B, n_kv_head, group, d), a group's queries side by
    side like the queries of a prefill; one product per key/value head, no copy of k, v.
    """
    B, n_head, _, head_dim = q.shape
    q = q.view(B, k.size(1), n_head // k.size(1), head_dim)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head_dim))
    if attn_mask is not None:  # (B or 1, 1, 1, kv_len): the same for every query of a group
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return (weights @ v).view(B, n_head, 1, head_dim)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Each query's weighted sum of the values of the keys it may see (attn_mask: True
    where it may; None: plain causal, only ever without a past, q_len == kv_len)."""
    if q.size(-2) == 1 and dropout_p == 0.0:
        return one_query_attention(q, k, v, attn_mask)
    # Grouped queries: query head h reads key/value head h // group (GPT-2's call has no
    # groups, and stays the plain one).
    grouped = {"enable_gqa": True} if k.size(1) != q.size(1) else {}
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=attn_mask is None, **grouped
    )


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    cache: KVCache | AttendingKVCache | None,
    layer: int,
    rope: Rope | None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """One layer's attention step, through the cache: the new queries over every key they
    may see. A cache that attends itself (`AttendingKVCache`) is handed the turned queries
    and keys; any other cache keeps the new keys/values and hands back every one the
    queries attend over (`rotate_then_cache`), and the model attends over them."""
    if isinstance(cache, AttendingKVCache):
        q, k = rotate(q, k, rope)
        return cache.attend(layer, q, k, v)
    q, k, v = rotate_then_cache(q, k, v, rope, cache, layer)
    return attention(q, k, v, attn_mask, dropout_p)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.kv_heads
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        # q, k, v in one matrix: n_head query heads, then n_kv_head key and value heads
        # (as many as the queries in GPT-2; fewer with grouped-query attention).
        self.qkv_widths = (config.n_embd, config.kv_width, config.kv_width)
        qkv_bias = config.bias or config.qkv_bias  # (Qwen2: biases here and nowhere else)
        self.c_attn = nn.Linear(config.n_embd, sum(self.qkv_widths), bias=qkv_bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None,
        cache: KVCache | AttendingKVCache | None = None,
        layer: int = 0,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.qkv_widths, dim=2)
        # (B, T, heads * head_dim) -> (B, heads, T, head_dim): every head attends on its own.
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        dropout = self.dropout if self.training else 0.0
        y = cached_attention(q, k, v, attn_mask, cache, layer, rope, dropout)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """GPT-2's: up to mlp_width, GELU, back down. SwiGLU (Llama's): c_fc makes two
    projections at once, a gate and an "up", and the gate's SiLU scales the up one."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.swiglu = config.mlp == "swiglu"
        hidden = config.mlp_width
        self.c_fc = nn.Linear(
            config.n_embd, 2 * hidden if self.swiglu else hidden, bias=config.bias
        )
        if not self.swiglu:
            self.gelu = nn.GELU(approximate="tanh")  # GPT-2's "gelu_new"
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = self.c_fc(x).chunk(2, dim=-1)
            return self.dropout(self.c_proj(F.silu(gate) * up))
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


def norm_layer(config: GPTConfig) -> nn.Module:
    """GPT-2's LayerNorm (centre, scale, shift), or Llama's RMSNorm (scale by the root mean
    square only: no mean, no bias)."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = norm_layer(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = norm_layer(config)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None,
        cache: KVCache | AttendingKVCache | None = None,
        layer: int = 0,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attn_mask, cache, layer, rope)
        return x + self.mlp(self.ln_2(x))


def embed(parts: nn.ModuleDict, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Token ids (B, T) at positions `pos` -> the first hidden states. `parts` holds wte
    and drop, and wpe when positions are learned (rotary ones are added in attention)."""
    x = parts.wte(idx)
    if "wpe" in parts:
        x = x + parts.wpe(pos)
    return parts.drop(x)


def rope_for(config: GPTConfig, pos: torch.Tensor) -> Rope | None:
    """The rotary angles every layer turns its queries and keys by; None for learned positions."""
    if config.position_embedding == "learned":
        return None
    return rotary_cos_sin(pos, config.head_dim, config.rotary_base)


def vocabulary_logits(lm_head: nn.Linear, x: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The output matrix's logits of the vocabulary's ids only. A matrix padded past the
    vocabulary (GPTConfig.vocab_multiple) has rows that are no token: cut here, in the one
    place every logit comes from, no sampler, mask or engine can ever pick one."""
    return lm_head(x)[..., :vocab_size]


# ---------------------------------------------------------------------------
# The training loss, without the whole logits
# ---------------------------------------------------------------------------

# Rows of logits the loss holds at once: at GPT-2's vocabulary a 1,024-row slice is
# 206 MB in float32, where the whole (12 x 1024, 50,304) logits of a GPU batch, with their
# float32 log-softmax and its gradient, would take about 8 GB.
LOSS_CHUNK_ROWS = 1024
IGNORE_INDEX = -100  # a target that counts in no loss (F.cross_entropy's default)


def summed_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    with_grads: bool,
    chunk_rows: int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Summed cross-entropy of the logits x @ weight.T (N rows) against `targets` (N),
    chunk_rows rows at a time; with_grads: also its gradients for x and weight.

    Each slice's logits are made (in autocast's dtype, as nn.Linear makes them), read in
    float32, scored, and turned at once into their gradient, softmax - one-hot, which two
    products take back to x and the weight; then the slice is dropped. The same products
    as the plain head's forward and backward, and none twice (a recomputing checkpoint
    would run the head's forward again).

    weight may have more rows than vocab_size (a vocabulary padded to a multiple of 64,
    for faster products): their logits are set to -inf, so they take no probability and
    get no gradient.
    """
    loss = torch.zeros((), dtype=torch.float32, device=x.device)
    grad_x = torch.empty_like(x) if with_grads else None
    grad_weight = torch.zeros_like(weight, dtype=torch.float32) if with_grads else None
    for start in range(0, x.size(0), chunk_rows):
        rows = slice(start, start + chunk_rows)
        x_part, t_part = x[rows], targets[rows]
        logits = F.linear(x_part, weight).float()
        logits[:, vocab_size:] = float("-inf")
        log_total = torch.logsumexp(logits, dim=-1)
        counted = t_part != IGNORE_INDEX
        picked = torch.where(counted, t_part, 0)[:, None]  # (an ignored row reads id 0)
        loss += ((log_total - logits.gather(1, picked)[:, 0]) * counted).sum()
        if with_grads:
            grad = logits.sub_(log_total[:, None]).exp_()  # the softmax, in place
            grad.scatter_add_(1, picked, -counted[:, None].float()).mul_(counted[:, None])
            grad_x[rows] = grad @ weight  # (autocast: grad in its dtype, as nn.Linear's is)
            grad_weight += grad.t() @ x_part
    return loss, grad_x, grad_weight


class LinearCrossEntropy(torch.autograd.Function):
    """The mean loss of summed_cross_entropy; its gradients are made in the forward pass
    (while each slice's logits exist), kept, and scaled by the incoming gradient in the
    backward. (PyTorch's F.linear_cross_entropy does the same with its chunking options,
    but knows no padded rows, and torch.compile stops at it.)"""

    @staticmethod
    def forward(ctx, x, weight, targets, vocab_size, chunk_rows):
        loss, grad_x, grad_weight = summed_cross_entropy(
            x, weight, targets, vocab_size, with_grads=True, chunk_rows=chunk_rows
        )
        counted = (targets != IGNORE_INDEX).sum()
        ctx.save_for_backward(grad_x / counted, (grad_weight / counted).to(weight.dtype))
        return loss / counted

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_weight = ctx.saved_tensors
        return grad_x * grad_loss, grad_weight * grad_loss, None, None, None


def linear_cross_entropy(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Mean cross-entropy of the logits x @ weight.T (x (N, C), weight (rows, C)) against
    targets (N; IGNORE_INDEX counts in no loss): F.cross_entropy(F.linear(x, weight).float()
    [:, :vocab_size], targets), LOSS_CHUNK_ROWS rows of logits at a time."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return LinearCrossEntropy.apply(x, weight, targets, vocab_size, LOSS_CHUNK_ROWS)
    loss, _, _ = summed_cross_entropy(
        x, weight, targets, vocab_size, with_grads=False, chunk_rows=LOSS_CHUNK_ROWS
    )
    return loss / (targets != IGNORE_INDEX).sum()


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        # Recompute each block's activations in the backward pass instead of storing
        # them: less memory for one more forward. Only ever while training.
        self.activation_checkpointing = False
        rows = config.padded_vocab_size  # (vocab_size, or up to a multiple: GPTConfig)
        parts = dict(wte=nn.Embedding(rows, config.n_embd))
        if config.position_embedding == "learned":  # (rotary positions have no parameters)
            parts["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        self.transformer = nn.ModuleDict(
            dict(
                **parts,
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=norm_layer(config),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, rows, bias=False)
        if config.tie_embeddings:  # reading a token in and scoring it out use one matrix
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init: each block adds two residual branches, so their output
        # projections start smaller to keep the residual stream's variance flat.
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; the position table is left out by default (as in the GPT-2 paper)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | AttendingKVCache | None = None,
        *,
        last_only: bool = False,
        logits_at: torch.Tensor | None = None,
        validate: bool = True,
    ) -> GPTOutput:
        """Run the model on token ids `idx` (B, T).

        targets: (B, T) next-token ids (-100 is ignored) -> mean cross-entropy `loss`.
        cache: keys/values of earlier tokens; the new ones are added to it (see KVCache).
        last_only: compute logits for the last position only (generation needs no more).
        logits_at: logits only at these time indices (the engine's flat batch: each sequence's last).
        validate: check ids and positions; a decode loop feeding back its own argmax may skip it.
        """
        B, T = idx.shape
        if validate:
            self._check_ids(idx)
        if cache is None:
            pos, attn_mask = position_ids(0, T, idx.device)[None, :], self.full_mask(T, idx.device)
        else:
            pos, attn_mask = cache.prepare(B, T, idx.device)
        if validate:
            self._check_positions(pos)
        x, rope = embed(self.transformer, idx, pos), rope_for(self.config, pos)
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for layer, block in enumerate(self.transformer.h):
            if recompute and cache is None:
                x = checkpoint(block, x, attn_mask, None, 0, rope, use_reentrant=False)
            else:
                x = block(x, attn_mask, cache, layer, rope)
        x = self.transformer.ln_f(x)
        if targets is not None:
            return GPTOutput(None, self._loss(x, targets, last_only or logits_at is not None))
        return GPTOutput(self._logits(x, last_only, logits_at), None)

    def _loss(self, x: torch.Tensor, targets: torch.Tensor, some_positions: bool) -> torch.Tensor:
        """Final hidden states and next-token ids -> the mean cross-entropy. At GPT-2's
        vocabulary the logits outweigh every block's activations: the loss is computed a
        slice of rows at a time, and the logits never exist whole."""
        if some_positions:
            raise RoseError("targets need logits at every position; drop last_only and logits_at")
        rows = x.reshape(-1, x.size(-1))
        return linear_cross_entropy(
            rows, self.lm_head.weight, targets.reshape(-1), self.config.vocab_size
        )

    def full_mask(self, T: int, device: torch.device) -> torch.Tensor | None:
        """The mask of a forward without a cache: None (plain causal) or the banded one."""
        cfg = self.config
        if cfg.sliding_window is None or cfg.sliding_window >= T:
            return None
        return banded_mask(T, T, cfg.sliding_window, cfg.attention_sinks, device)

    def _logits(
        self, x: torch.Tensor, last_only: bool, logits_at: torch.Tensor | None
    ) -> torch.Tensor:
        """Final hidden states -> logits at the positions asked for."""
        if logits_at is not None:
            x = x[:, logits_at, :]
        elif last_only:
            x = x[:, -1:, :]
        return vocabulary_logits(self.lm_head, x, self.config.vocab_size)

    # -- validation: clear errors instead of an index error deep inside an Embedding --

    def _check_ids(self, idx: torch.Tensor) -> None:
        if idx.dim() != 2 or idx.dtype not in (torch.long, torch.int32, torch.int64):
            raise RoseError(
                f"idx must be a (batch, time) tensor of integer token ids, got "
                f"shape {tuple(idx.shape)} dtype {idx.dtype}"
            )
        if idx.numel() == 0:
            raise RoseError("idx is empty: give at least one token")
        low, high = int(idx.min()), int(idx.max())
        if low < 0 or high >= self.config.vocab_size:
            bad = low if low < 0 else high
            raise RoseError(
                f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})"
            )

    def _check_positions(self, pos: torch.Tensor) -> None:
        last = int(pos.max())
        if last >= self.config.block_size and not self.config.unbounded:
            raise RoseError(
                f"a token would stand at position {last}, but the model's learned positions "
                f"stop at block_size - 1 = {self.config.block_size - 1}: crop the context first"
            )

    # -- training helpers --

    def configure_optimizer(
        self,
        weight_decay: float,
        learning_rate: float,
        betas: tuple[float, float],
        device_type: str,
    ) -> torch.optim.AdamW:
        """AdamW with decay on matrices (Linear/Embedding weights), none on biases and LayerNorms."""
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        # The fused kernel does the whole update in one launch; CUDA only here.
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")
