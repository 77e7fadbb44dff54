"""The model build's known answers, as data (rosecourse/exercises/answers.py says what each
kind is; tests/course/test_builds.py runs them against this build's check).

Each is the reference solution (reference.py, beside this file) with one class, function or
method replaced by the code below, as a learner writes it into build_model.py: it runs as if
written there (grading.replaced rebinds a function to the module's globals, so the names it
reads are the module's; those imported below from the reference are for the reader and the
linter). First the known mistakes (`KNOWN_WRONG`: what `rose-course check model` names when
a learner's module probes like one); then the other wrong answers (`build_mutant`) and the
right ones written another way (`build_alternative`); last the wrong answers written blind
(`blind_build`). Where a piece was written as an edit of the reference's text, `# the
mistake` marks the line.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from rosecourse.builds.grading import KnownWrong
from rosecourse.builds.model import reference
from rosecourse.builds.model.reference import MLP, Block, CausalSelfAttention
from rosecourse.exercises.answers import blind_build, build_alternative, build_mutant
from rosetrainer.config import GPTConfig

# == The known mistakes: the check names each one it meets (KNOWN_WRONG) ======================


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


# == Other wrong answers (build_mutant), and right ones (build_alternative) ==================
# tests/course/test_builds.py asserts that each wrong one fails a part of the check without
# being taken for a known mistake, and that each right one passes every part.

# -- written as code -----------------------------------------------------------------------

# The contract: the model runs without dropout (config.dropout is 0 here), in train mode too.


@build_mutant("model", "Block", name="dropout_hard_coded_on")
class DropoutHardCodedOn(reference.Block):
    def __init__(self, config):
        super().__init__(config)
        self.dropout = nn.Dropout(0.1)  # nanoGPT's value, whatever the config says

    def forward(self, x):
        x = x + self.dropout(self.attn(self.ln_1(x)))
        return x + self.dropout(self.mlp(self.ln_2(x)))


@build_mutant("model", "CausalSelfAttention", name="attention_weights_dropped")
class AttentionWeightsDropped(reference.CausalSelfAttention):
    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (
            t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            for t in self.c_attn(x).split(C, dim=2)
        )
        y = nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=0.1 if self.training else 0.0
        )
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


@build_mutant("model", "GPT", name="embeddings_dropped")
class EmbeddingsDropped(reference.GPT):
    def __init__(self, config):
        super().__init__(config)
        self.drop = nn.Dropout(0.1)

    def forward(self, idx):
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


@build_mutant("model", "MLP", name="dropout_defaulted_when_zero")
class DropoutDefaultedWhenZero(reference.MLP):
    def __init__(self, config):
        super().__init__(config)
        self.dropout = nn.Dropout(config.dropout or 0.1)

    def forward(self, x):
        return self.dropout(super().forward(x))


@build_alternative("model", "Block", name="dropout_read_from_the_config")
class DropoutReadFromTheConfig(reference.Block):
    # Dropout as rose's model has it, at config.dropout (0 here): right.
    def __init__(self, config):
        super().__init__(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = x + self.dropout(self.attn(self.ln_1(x)))
        return x + self.dropout(self.mlp(self.ln_2(x)))


# -- first written as edits of the reference's text: `# the mistake` marks the line ----------
# A mutant that replaces two pieces is registered twice under one name.


@build_mutant("model", "CausalSelfAttention.forward")
def scaled_by_sqrt_n_embd(self, x: torch.Tensor) -> torch.Tensor:
    B, T, C = x.shape
    head_dim = C // self.n_head
    q, k, v = self.c_attn(x).split(C, dim=2)
    # (B, T, C) -> (B, n_head, T, head_dim): each head its own (T, head_dim) matrix.
    q = q.view(B, T, self.n_head, head_dim).transpose(1, 2)
    k = k.view(B, T, self.n_head, head_dim).transpose(1, 2)
    v = v.view(B, T, self.n_head, head_dim).transpose(1, 2)
    # the mistake: was `scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)`
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(C)
    # Query i (a row) may read key j (a column) only when j <= i: the lower triangle.
    allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    y = torch.softmax(scores, dim=-1) @ v
    # Back to (B, T, C): the heads side by side along the features.
    y = y.transpose(1, 2).contiguous().view(B, T, C)
    return self.c_proj(y)


@build_mutant("model", "CausalSelfAttention.forward")
def softmax_over_queries(self, x: torch.Tensor) -> torch.Tensor:
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
    # the mistake: was `y = torch.softmax(scores, dim=-1) @ v`
    y = torch.softmax(scores, dim=-2) @ v
    # Back to (B, T, C): the heads side by side along the features.
    y = y.transpose(1, 2).contiguous().view(B, T, C)
    return self.c_proj(y)


@build_mutant("model", "CausalSelfAttention.forward")
def keys_first(self, x: torch.Tensor) -> torch.Tensor:
    B, T, C = x.shape
    head_dim = C // self.n_head
    # the mistake: was `q, k, v = self.c_attn(x).split(C, dim=2)`
    k, q, v = self.c_attn(x).split(C, dim=2)
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


@build_mutant("model", "CausalSelfAttention.forward")
def heads_joined_without_transpose(self, x: torch.Tensor) -> torch.Tensor:
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
    # the mistake: was `y = y.transpose(1, 2).contiguous().view(B, T, C)`
    y = y.reshape(B, T, C)
    return self.c_proj(y)


@build_mutant("model", "Block.forward")
def attention_without_residual(self, x: torch.Tensor) -> torch.Tensor:
    # the mistake: was `x = x + self.attn(self.ln_1(x))`
    x = self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_2(x))


@build_mutant("model", "Block.forward")
def ln_2_for_attention(self, x: torch.Tensor) -> torch.Tensor:
    # the mistake: was `x = x + self.attn(self.ln_1(x))`
    x = x + self.attn(self.ln_2(x))
    return x + self.mlp(self.ln_2(x))


@build_mutant("model", "GPT.forward")
def no_final_layer_norm(self, idx: torch.Tensor) -> torch.Tensor:
    T = idx.size(1)
    positions = torch.arange(T, device=idx.device)
    x = self.transformer.wte(idx) + self.transformer.wpe(positions)
    for block in self.transformer.h:
        x = block(x)
    # the mistake: was `return self.lm_head(self.transformer.ln_f(x))`
    return self.lm_head(x)


@build_mutant("model", "CausalSelfAttention.forward")
def query_blind_to_itself(self, x: torch.Tensor) -> torch.Tensor:
    B, T, C = x.shape
    head_dim = C // self.n_head
    q, k, v = self.c_attn(x).split(C, dim=2)
    # (B, T, C) -> (B, n_head, T, head_dim): each head its own (T, head_dim) matrix.
    q = q.view(B, T, self.n_head, head_dim).transpose(1, 2)
    k = k.view(B, T, self.n_head, head_dim).transpose(1, 2)
    v = v.view(B, T, self.n_head, head_dim).transpose(1, 2)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
    # Query i (a row) may read key j (a column) only when j <= i: the lower triangle.
    # the mistake: was `allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()`
    allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril(-1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    y = torch.softmax(scores, dim=-1) @ v
    # Back to (B, T, C): the heads side by side along the features.
    y = y.transpose(1, 2).contiguous().view(B, T, C)
    return self.c_proj(y)


@build_mutant("model", "MLP.forward")
def relu(self, x: torch.Tensor) -> torch.Tensor:
    # the mistake: was `return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))`
    return self.c_proj(F.relu(self.c_fc(x)))


@build_mutant("model", "Block.__init__", name="layer_norm_eps_1e_6")
def layer_norm_eps_1e_6_block__init(self, config: GPTConfig) -> None:
    nn.Module.__init__(self)
    # the mistake: was `self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)`
    self.ln_1 = nn.LayerNorm(config.n_embd, eps=1e-6, bias=config.bias)
    self.attn = CausalSelfAttention(config)
    # the mistake: was `self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)`
    self.ln_2 = nn.LayerNorm(config.n_embd, eps=1e-6, bias=config.bias)
    self.mlp = MLP(config)


@build_mutant("model", "GPT.__init__", name="layer_norm_eps_1e_6")
def layer_norm_eps_1e_6_gpt__init(self, config: GPTConfig) -> None:
    nn.Module.__init__(self)
    self.transformer = nn.ModuleDict(
        dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            # the mistake: was `ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),`
            ln_f=nn.LayerNorm(config.n_embd, eps=1e-6, bias=config.bias),
        )
    )
    self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
    self.lm_head.weight = self.transformer.wte.weight


@build_mutant("model", "GPT.__init__")
def final_layer_norm_eps_1e_6(self, config: GPTConfig) -> None:
    nn.Module.__init__(self)
    self.transformer = nn.ModuleDict(
        dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            # the mistake: was `ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),`
            ln_f=nn.LayerNorm(config.n_embd, eps=1e-6, bias=config.bias),
        )
    )
    self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
    self.lm_head.weight = self.transformer.wte.weight


# == Written blind (blind_build; rosecourse/exercises/answers.py says how) ===================
# Each one's writer said in one line what is wrong: the `# WRONG:` comment above it.


def _blind_attention(self, x, split_heads, merge_heads, scale):
    """The reference's attention forward, the heads cut by `split_heads(t, B, T, head_dim)`
    and put back by `merge_heads(y, B, T, C)`, the scores divided by `scale(C, head_dim)`."""
    B, T, C = x.shape
    head_dim = C // self.n_head
    q, k, v = (split_heads(t, B, T, head_dim) for t in self.c_attn(x).split(C, dim=2))
    scores = (q @ k.transpose(-2, -1)) / scale(C, head_dim)
    allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    return self.c_proj(merge_heads(torch.softmax(scores, dim=-1) @ v, B, T, C))


def _heads_split(self, t, B, T, head_dim):
    return t.view(B, T, self.n_head, head_dim).transpose(1, 2)


def _heads_merged(y, B, T, C):
    return y.transpose(1, 2).contiguous().view(B, T, C)


# WRONG: heads split as view(B, T, head_dim, n_head): head h gets every n_head-th feature
@blind_build("model", "CausalSelfAttention.forward")
def heads_interleaved(self, x):
    def split(t, B, T, head_dim):
        # the mistake: was `t.view(B, T, self.n_head, head_dim).transpose(1, 2)`
        return t.view(B, T, head_dim, self.n_head).permute(0, 3, 1, 2)

    def merge(y, B, T, C):
        return y.permute(0, 2, 3, 1).contiguous().view(B, T, C)

    return _blind_attention(self, x, split, merge, lambda C, head_dim: math.sqrt(head_dim))


# WRONG: scores scaled by sqrt(n_embd) instead of sqrt(head_dim)
@blind_build("model", "CausalSelfAttention.forward")
def scale_sqrt_n_embd(self, x):
    def split(t, B, T, head_dim):
        return _heads_split(self, t, B, T, head_dim)

    # the mistake: was `math.sqrt(head_dim)`
    return _blind_attention(self, x, split, _heads_merged, lambda C, head_dim: math.sqrt(C))


# WRONG: MLP uses the exact erf GELU (F.gelu default), not GPT-2's tanh approximation
@blind_build("model", "MLP.forward", known="exact_gelu")
def erf_gelu(self, x):
    # the mistake: was `F.gelu(self.c_fc(x), approximate="tanh")`
    return self.c_proj(F.gelu(self.c_fc(x)))


# WRONG: Block normalises the MLP's input with ln_1 again (ln_2 created but never used)
@blind_build("model", "Block.forward")
def ln1_reused_for_mlp(self, x):
    x = x + self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_1(x))  # the mistake: was `self.ln_2(x)`


def _blind_block_init(self, config, **norm):
    """The reference's Block.__init__, its LayerNorms made with `norm` in place of bias=."""
    nn.Module.__init__(self)
    self.ln_1 = nn.LayerNorm(config.n_embd, **norm)
    self.attn = CausalSelfAttention(config)
    self.ln_2 = nn.LayerNorm(config.n_embd, **norm)
    self.mlp = MLP(config)


def _blind_gpt_init(self, config, norm=None, tied=True):
    """The reference's GPT.__init__, ln_f made with `norm` (bias=config.bias when None);
    `tied` False: lm_head gets a copy of wte's weight, a Parameter of its own."""
    nn.Module.__init__(self)
    self.transformer = nn.ModuleDict(
        dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, **(norm or {"bias": config.bias})),
        )
    )
    self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
    if tied:
        self.lm_head.weight = self.transformer.wte.weight
    else:
        self.lm_head.weight = nn.Parameter(self.transformer.wte.weight.detach().clone())


# WRONG: LayerNorms always get a bias (config.bias ignored for them)
@blind_build("model", "Block.__init__", name="ln_always_bias")
def _ln_always_bias_in_blocks(self, config):
    _blind_block_init(self, config)  # the mistake: was `bias=config.bias`


@blind_build("model", "GPT.__init__", name="ln_always_bias")
def _ln_always_bias_at_the_end(self, config):
    _blind_gpt_init(self, config, norm={})  # the mistake: ln_f was given `bias=config.bias`


# WRONG: LayerNorm eps 1e-6 (TF-style) instead of PyTorch's/GPT-2's 1e-5
@blind_build("model", "Block.__init__", name="ln_eps_1e6")
def _ln_eps_1e6_in_blocks(self, config):
    _blind_block_init(self, config, eps=1e-6, bias=config.bias)  # the mistake: eps=1e-6


@blind_build("model", "GPT.__init__", name="ln_eps_1e6")
def _ln_eps_1e6_at_the_end(self, config):
    _blind_gpt_init(self, config, norm={"eps": 1e-6, "bias": config.bias})  # (the mistake)


# WRONG: lm_head gets its own Parameter (a copy of wte's weight), not tied: same forward,
# wrong gradients
@blind_build("model", "GPT.__init__", known="untied_head")
def untied_head_copy(self, config):
    _blind_gpt_init(self, config, tied=False)  # the mistake: was lm_head.weight = wte.weight


# WRONG: positions built with torch.arange(T) on the CPU whatever idx's device (breaks on a
# GPU)
@blind_build("model", "GPT.forward")
def pos_no_device(self, idx):
    positions = torch.arange(idx.size(1))  # the mistake: was `device=idx.device`
    x = self.transformer.wte(idx) + self.transformer.wpe(positions)
    for block in self.transformer.h:
        x = block(x)
    return self.lm_head(self.transformer.ln_f(x))


# == A whole module written another way (build_alternative's, not one piece: all) ==========
# Every class and function written afresh, as another learner would write the file;
# tests/course/test_builds.py asserts that it passes every part.

ALTERNATIVE_MODULE = """
import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        mask = torch.ones(config.block_size, config.block_size).tril().bool()
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (
            t.reshape(B, T, self.n_head, -1).permute(0, 2, 1, 3)
            for t in self.c_attn(x).chunk(3, dim=-1)
        )
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[:T, :T])
        return self.c_proj(y.permute(0, 2, 1, 3).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        h = x + self.attn(self.ln_1(x))
        return h + self.mlp(self.ln_2(h))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(config.vocab_size, config.n_embd),
            "wpe": nn.Embedding(config.block_size, config.n_embd),
            "h": nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            "ln_f": nn.LayerNorm(config.n_embd, bias=config.bias),
        })
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)[None]
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.transformer.ln_f(x) @ self.transformer.wte.weight.T
"""
