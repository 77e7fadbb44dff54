"""The model build's known wrong answers (data: what `rose-course check model` names).

Each is the reference solution (model/reference.py) with one method
written wrong, as a learner writes it into build_model.py: it runs as if written there
(grading.replaced rebinds it to the module's globals; the names it reads are imported
below from the reference solution). `# the mistake` marks the line.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from rosecourse.builds.grading import KnownWrong
from rosecourse.builds.model.reference import Block
from rosetrainer.config import GPTConfig


def _attention(self, x: torch.Tensor, scale=math.sqrt, upper=False, heads_by_reshape=False):
    """The reference's CausalSelfAttention.forward, with the mistake its arguments say."""
    B, T, C = x.shape
    head_dim = C // self.n_head
    q, k, v = self.c_attn(x).split(C, dim=2)
    if heads_by_reshape:  # the mistake: was `.view(B, T, self.n_head, head_dim).transpose(1, 2)`
        q, k, v = (t.reshape(B, self.n_head, T, head_dim) for t in (q, k, v))
    else:
        q, k, v = (t.view(B, T, self.n_head, head_dim).transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) / scale(head_dim)
    allowed = torch.ones(T, T, dtype=torch.bool, device=x.device)
    allowed = allowed.triu() if upper else allowed.tril()
    y = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v
    return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def _scaled_by_d(self, x: torch.Tensor) -> torch.Tensor:
    # the mistake: was `/ math.sqrt(head_dim)`
    return _attention(self, x, scale=lambda head_dim: head_dim)


def _future_visible(self, x: torch.Tensor) -> torch.Tensor:
    # the mistake: was `.tril()`
    return _attention(self, x, upper=True)


def _heads_without_transpose(self, x: torch.Tensor) -> torch.Tensor:
    return _attention(self, x, heads_by_reshape=True)


def _post_ln(self, x: torch.Tensor) -> torch.Tensor:
    # the mistake: was `x = x + self.attn(self.ln_1(x))`
    x = self.ln_1(x + self.attn(x))
    # the mistake: was `return x + self.mlp(self.ln_2(x))`
    return self.ln_2(x + self.mlp(x))


def _untied_head(self, config: GPTConfig) -> None:
    nn.Module.__init__(self)
    self.transformer = nn.ModuleDict(
        dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        )
    )
    self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
    # the mistake: `self.lm_head.weight = self.transformer.wte.weight` left out


def _positions_missing(self, idx: torch.Tensor) -> torch.Tensor:
    # the mistake: was `x = self.transformer.wte(idx) + self.transformer.wpe(positions)`
    x = self.transformer.wte(idx)
    for block in self.transformer.h:
        x = block(x)
    return self.lm_head(self.transformer.ln_f(x))


def _exact_gelu(self, x: torch.Tensor) -> torch.Tensor:
    # the mistake: was `return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))`
    return self.c_proj(F.gelu(self.c_fc(x)))


KNOWN_WRONG = (
    KnownWrong(
        "scaled_by_d",
        {"CausalSelfAttention.forward": _scaled_by_d},
        "the scores are divided by head_dim; the paper divides by its square root",
    ),
    KnownWrong(
        "future_visible",
        {"CausalSelfAttention.forward": _future_visible},
        "the mask keeps the upper triangle: each query sees itself and the future, not the past",
    ),
    KnownWrong(
        "heads_without_transpose",
        {"CausalSelfAttention.forward": _heads_without_transpose},
        "the heads are cut by reshaping to (B, n_head, T, head_dim) straight away: each "
        "'head' then mixes positions and features; split the features into heads "
        "(B, T, n_head, head_dim), then swap the time and head axes",
    ),
    KnownWrong(
        "post_ln",
        {"Block.forward": _post_ln},
        "the layer norms come after each residual sum (the original transformer's "
        "post-LN); GPT-2 normalises what each half reads, and adds to x unnormalised",
    ),
    KnownWrong(
        "untied_head",
        {"GPT.__init__": _untied_head},
        "lm_head has a weight of its own: rose's loads into it, but training moves the "
        "two apart (see wte's gradient); tie it to the token embedding",
    ),
    KnownWrong(
        "positions_missing",
        {"GPT.forward": _positions_missing},
        "the position embeddings are never added: every token looks the same wherever it stands",
    ),
    KnownWrong(
        "exact_gelu",
        {"MLP.forward": _exact_gelu},
        'the GELU is the exact (erf) one; GPT-2 uses the tanh approximation (approximate="tanh")',
    ),
)
