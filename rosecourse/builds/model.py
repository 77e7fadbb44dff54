"""Build (chapter 00): the model. The learner writes GPT-2 whole; rose's GPT grades it.

Contract: rosecourse/solutions/build_model.py (its docstrings are the stub). Each part
loads rose's weights into the learner's module (strict: the names and shapes must be
rose's) and compares what it computes with rose's own module on the same input:
attention, MLP and block on hidden states of lengths 1, 7 and block_size, the whole
model's logits on batches of those lengths (with and without biases, and with rose's
own small initialisation, where LayerNorm's eps shows, and on a model moved to the meta
device, where a tensor made on the CPU shows), the logits in
train mode (the model runs without dropout: train mode computes what eval mode does),
and every parameter's gradient after a cross-entropy loss, in train mode as a trainer
takes it. Logits and hidden states are held to
rose's one tolerance rule (rosetrainer/numerics.py); gradients to GRAD_RTOL.

The weights are the chapters' wide ones (`wide_random_init`: embeddings of std 1,
matrices of std 1/sqrt(fan_in)), so every mistake below moves the outputs far past the
tolerance; the head stays tied, as in rose.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from rosecourse.builds.grading import (
    Build,
    KnownWrong,
    Mismatch,
    Part,
    expect_close,
    first_gap,
    seen,
)
from rosecourse.demo import wide_random_init
from rosecourse.solutions.build_model import Block
from rosetrainer import model as rose
from rosetrainer.config import GPTConfig
from rosetrainer.errors import one_line
from rosetrainer.numerics import logit_tolerance

# Not a power of two anywhere: a hard-coded size cannot pass by luck.
CONFIG = GPTConfig(vocab_size=97, block_size=12, n_layer=2, n_head=3, n_embd=24)
NO_BIAS = GPTConfig(vocab_size=97, block_size=12, n_layer=2, n_head=3, n_embd=24, bias=False)
SHAPES = ((1, 1), (3, 7), (2, CONFIG.block_size))  # (batch, time) of every input
# A gradient is a longer chain of sums than a logit (the backward pass runs through every
# layer twice): each entry within this share of its parameter's largest gradient.
GRAD_RTOL = 1e-4


def rose_model(config: GPTConfig = CONFIG, seed: int = 0) -> rose.GPT:
    """rose's GPT with the chapters' wide weights (rosecourse.demo), its head tied again."""
    model = wide_random_init(rose.GPT(config), seed)
    model.lm_head.weight = model.transformer.wte.weight
    return model


def loaded(cls: type, reference: nn.Module, config: GPTConfig = CONFIG) -> nn.Module:
    """The learner's `cls(config)` holding `reference`'s weights, loaded strictly."""
    module = cls(config)
    if not isinstance(module, nn.Module):
        raise Mismatch(f"{cls.__name__}(config) is a {type(module).__name__}, not an nn.Module")
    try:
        module.load_state_dict(reference.state_dict(), strict=True)
    except RuntimeError as error:
        lines = [line.strip() for line in str(error).splitlines()[1:] if line.strip()]
        raise Mismatch(
            f"rose's {type(reference).__name__} weights do not load into yours: {lines[0]}"
        ) from None
    return module.eval()


def hidden(batch: int, time: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, time, CONFIG.n_embd, generator=generator)


def token_ids(batch: int, time: int, seed: int, config: GPTConfig = CONFIG) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(config.vocab_size, (batch, time), generator=generator)


def compare_layer(
    cls_name: str, pick: Callable[[rose.GPT], nn.Module], call: Callable
) -> Callable[[types.ModuleType], None]:
    """A part: the learner's module `cls_name` beside rose's (`pick` of rose's GPT, called
    as `call(module, x)`) on SHAPES' hidden states."""

    def run(module: types.ModuleType) -> None:
        reference = pick(rose_model())
        mine = loaded(getattr(module, cls_name), reference)
        with torch.no_grad():
            for seed, (batch, time) in enumerate(SHAPES):
                x = hidden(batch, time, seed)
                want = call(reference, x)
                what = f"{cls_name} on a ({batch}, {time}) input"
                expect_close(what, mine(x), want, logit_tolerance(want))

    return run


def _weights(module: types.ModuleType) -> None:
    for config in (CONFIG, NO_BIAS):
        reference = rose_model(config)
        mine = loaded(module.GPT, reference, config)
        shapes = seen(
            f"the weights{'' if config.bias else ' without biases'}",
            {name: list(tensor.shape) for name, tensor in mine.state_dict().items()},
        )
        want = {name: list(tensor.shape) for name, tensor in reference.state_dict().items()}
        if shapes != want:
            wrong = next(name for name in {**shapes, **want} if shapes.get(name) != want.get(name))
            raise Mismatch(
                f"rose's GPT weights do not load into yours: {wrong} has shape "
                f"{shapes.get(wrong, 'none (missing)')} where rose's has {want.get(wrong, 'none')}"
            )


def default_model() -> rose.GPT:
    """rose's GPT as it initialises itself (std 0.02): small activations, where a
    LayerNorm's eps shows."""
    torch.manual_seed(0)
    return rose.GPT(CONFIG)


def _logits(module: types.ModuleType) -> None:
    models = [(rose_model(config), config, "") for config in (CONFIG, NO_BIAS)]
    small = " of rose's default-initialised GPT (small activations: LayerNorm's eps, 1e-5, shows)"
    models.append((default_model(), CONFIG, small))
    for reference, config, which in models:
        mine = loaded(module.GPT, reference, config)
        with torch.no_grad():
            for seed, (batch, time) in enumerate(SHAPES):
                idx = token_ids(batch, time, seed, config)
                want = reference(idx).logits
                bias = "" if config.bias else " without biases"
                what = f"logits of a ({batch}, {time}) batch{bias}{which}"
                expect_close(what, mine(idx), want, logit_tolerance(want))
    _on_the_device(module)


def _on_the_device(module: types.ModuleType) -> None:
    """The learner's GPT moved to the meta device, as a model on a GPU is: every tensor it
    makes for idx goes on idx's device. The other parts run on the CPU, where a tensor made
    without `device=` would pass; on the meta device the positions handed to
    transformer.wpe show where they were made (an embedding there reads them wherever they
    are), and a tensor of the CPU mixed with the model's raises."""
    mine = module.GPT(CONFIG).to("meta")
    devices: list[str] = []

    def positions_here(_wpe: nn.Module, args: tuple, kwargs: dict) -> None:
        positions = next(iter([*args, *kwargs.values()]), None)
        if isinstance(positions, torch.Tensor):
            devices.append(positions.device.type)

    mine.transformer.wpe.register_forward_pre_hook(positions_here, with_kwargs=True)
    raised = None
    try:
        with torch.no_grad():
            mine(torch.zeros(2, 5, dtype=torch.long, device="meta"))
    except Exception as error:  # the meta device cannot run all a GPU can: judged below
        raised = one_line(error)
    devices, raised = seen("on the meta device: positions' devices, raised", (devices, raised))
    elsewhere = [device for device in devices if device != "meta"]
    if elsewhere:
        raise Mismatch(
            "on a model moved to another device (meta, as to a GPU) the positions "
            f"handed to transformer.wpe are on the {elsewhere[0]}, not idx's "
            "device: make them there (torch.arange(T, device=idx.device)), or the "
            "lookup fails on a GPU"
        )
    if raised is not None and "not on the expected device" in raised:
        raise Mismatch(
            "on a model moved to another device (meta, as to a GPU) the forward pass "
            f"raises ({raised}): a tensor it makes is on the CPU (no "
            "device=idx.device), not the model's device"
        )


def _train_mode(module: types.ModuleType) -> None:
    """The learner's GPT in train mode beside rose's: with config.dropout 0, train mode
    computes what eval mode does (twice, so a random drop cannot pass by luck)."""
    reference = rose_model()
    mine = loaded(module.GPT, reference)
    idx = token_ids(2, CONFIG.block_size, 13)
    with torch.no_grad():
        want = reference(idx).logits
        tolerance = logit_tolerance(want)
        in_eval = first_gap(seen("the logits in eval mode", mine(idx)), want, tolerance)
        mine.train()
        for i in range(2):
            gap = first_gap(seen(f"the logits in train mode, call {i}", mine(idx)), want, tolerance)
            if gap is None:
                continue
            what = f"in train mode (model.train()) the logits of a (2, {CONFIG.block_size}) batch"
            if in_eval is not None:
                raise Mismatch(f"{what}: {gap}")
            raise Mismatch(
                f"{what} leave rose's: {gap}; in eval mode they do not: the model runs "
                "without dropout (config.dropout is 0 here), so train mode computes what "
                "eval mode does: is a dropout of your own switched on by train mode?"
            )


def _gradients(module: types.ModuleType) -> None:
    reference = rose_model().train()
    mine = loaded(module.GPT, reference).train()  # as a trainer runs it
    idx, targets = token_ids(2, CONFIG.block_size, 7), token_ids(2, CONFIG.block_size, 8)
    reference(idx, targets).loss.backward()
    logits = mine(idx)
    F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)).backward()
    grads = dict(mine.named_parameters())
    for name, param in reference.named_parameters():
        got = seen(f"the gradient of {name}", grads[name].grad)
        if got is None:
            raise Mismatch(f"{name} got no gradient: is it used in forward?")
        tolerance = GRAD_RTOL * float(param.grad.abs().max())
        gap = first_gap(got, param.grad, tolerance)
        if gap is not None:
            raise Mismatch(f"the gradient of {name}: {gap}")


def _probe(module: types.ModuleType) -> list[object]:
    """Attention, MLP, block and logits on one small input each, and wte's gradient."""
    reference = rose_model()
    block = reference.transformer.h[0]
    x = hidden(2, 5, 11)
    with torch.no_grad():
        outcomes = [
            loaded(module.CausalSelfAttention, block.attn)(x),
            loaded(module.MLP, block.mlp)(x),
            loaded(module.Block, block)(x),
        ]
    mine = loaded(module.GPT, reference)
    logits = mine(token_ids(2, 5, 12))
    logits.square().mean().backward()
    return [*outcomes, logits.detach(), mine.transformer.wte.weight.grad]


def _first_attention(gpt: rose.GPT) -> nn.Module:
    return gpt.transformer.h[0].attn


def _attention(reference: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return reference(x, None)  # no mask and no cache: rose's plain causal attention


def _call(reference: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return reference(x)


# ---------------------------------------------------------------------------
# Known wrong answers: the reference with one method or function written wrong
# ---------------------------------------------------------------------------
# Each runs as if written in the learner's file (grading.replaced rebinds it to the
# module's globals); the names it reads are imported above from the reference solution.


def _scaled_by_d(self, x: torch.Tensor) -> torch.Tensor:
    B, T, C = x.shape
    head_dim = C // self.n_head
    q, k, v = self.c_attn(x).split(C, dim=2)
    # (B, T, C) -> (B, n_head, T, head_dim): each head its own (T, head_dim) matrix.
    q = q.view(B, T, self.n_head, head_dim).transpose(1, 2)
    k = k.view(B, T, self.n_head, head_dim).transpose(1, 2)
    v = v.view(B, T, self.n_head, head_dim).transpose(1, 2)
    # the mistake: was `scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)`
    scores = (q @ k.transpose(-2, -1)) / head_dim
    # Query i (a row) may read key j (a column) only when j <= i: the lower triangle.
    allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    y = torch.softmax(scores, dim=-1) @ v
    # Back to (B, T, C): the heads side by side along the features.
    y = y.transpose(1, 2).contiguous().view(B, T, C)
    return self.c_proj(y)


def _future_visible(self, x: torch.Tensor) -> torch.Tensor:
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
    allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).triu()
    scores = scores.masked_fill(~allowed, float("-inf"))
    y = torch.softmax(scores, dim=-1) @ v
    # Back to (B, T, C): the heads side by side along the features.
    y = y.transpose(1, 2).contiguous().view(B, T, C)
    return self.c_proj(y)


def _heads_without_transpose(self, x: torch.Tensor) -> torch.Tensor:
    B, T, C = x.shape
    head_dim = C // self.n_head
    q, k, v = self.c_attn(x).split(C, dim=2)
    # (B, T, C) -> (B, n_head, T, head_dim): each head its own (T, head_dim) matrix.
    # the mistake: was `q = q.view(B, T, self.n_head, head_dim).transpose(1, 2)`
    q = q.reshape(B, self.n_head, T, head_dim)
    # the mistake: was `k = k.view(B, T, self.n_head, head_dim).transpose(1, 2)`
    k = k.reshape(B, self.n_head, T, head_dim)
    # the mistake: was `v = v.view(B, T, self.n_head, head_dim).transpose(1, 2)`
    v = v.reshape(B, self.n_head, T, head_dim)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
    # Query i (a row) may read key j (a column) only when j <= i: the lower triangle.
    allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    y = torch.softmax(scores, dim=-1) @ v
    # Back to (B, T, C): the heads side by side along the features.
    y = y.transpose(1, 2).contiguous().view(B, T, C)
    return self.c_proj(y)


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


MODEL = Build(
    name="model",
    chapters="00",
    task="GPT-2 whole: attention, MLP, pre-LN block, embeddings, the tied head",
    parts=(
        Part("weights", _weights),
        Part("attention", compare_layer("CausalSelfAttention", _first_attention, _attention)),
        Part("mlp", compare_layer("MLP", lambda gpt: gpt.transformer.h[0].mlp, _call)),
        Part("block", compare_layer("Block", lambda gpt: gpt.transformer.h[1], _attention)),
        Part("logits", _logits),
        Part("train mode", _train_mode),
        Part("gradients, in train mode", _gradients),
    ),
    probe=_probe,
    known_wrong=(
        KnownWrong(
            "scaled_by_d",
            {"CausalSelfAttention.forward": _scaled_by_d},
            "the scores are divided by head_dim; the paper divides by its square root",
        ),
        KnownWrong(
            "future_visible",
            {"CausalSelfAttention.forward": _future_visible},
            "the mask keeps the upper triangle: each query sees itself and the future, "
            "not the past",
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
            "the position embeddings are never added: every token looks the same wherever "
            "it stands",
        ),
        KnownWrong(
            "exact_gelu",
            {"MLP.forward": _exact_gelu},
            "the GELU is the exact (erf) one; GPT-2 uses the tanh approximation "
            '(approximate="tanh")',
        ),
    ),
    passed="equal to rose's GPT (rosetrainer/model.py) within the tolerance",
)
