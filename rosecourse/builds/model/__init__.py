"""Build (chapter 00): the model. The learner writes GPT-2 whole; rose's GPT grades it.

Contract: rosecourse/builds/model/reference.py (its docstrings are the stub). Each part
loads rose's weights into the learner's module (strict: the names and shapes must be
rose's) and compares what it computes with rose's own module on the same input:
attention, MLP and block on hidden states of lengths 1, 7 and block_size; the whole
model's logits on batches of those lengths (with and without biases, at rose's own small
initialisation, where LayerNorm's eps shows, and in bfloat16), then the same model moved
to another device (meta), as to a GPU (a tensor made on the CPU, or kept from the first call,
shows there); the logits in train mode (the model runs without dropout: train mode
computes what eval mode does), and every parameter's gradient after a cross-entropy
loss, in train mode as a trainer takes it. Logits and hidden states are held to rose's
one tolerance rule (rosetrainer/numerics.py), gradients to GRAD_RTOL, bfloat16 logits
to BF16_RTOL.

The weights are the chapters' wide ones (`wide_random_init`: embeddings of std 1,
matrices of std 1/sqrt(fan_in)), so every mistake moves the outputs far past the
tolerance; the head stays tied, as in rose.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from rosecourse.builds.grading import Build, Mismatch, Part, first_gap, made, seen
from rosecourse.builds.model.mistakes import KNOWN_WRONG
from rosecourse.demo import wide_random_init
from rosecourse.exercises.contract import ELSEWHERE, ToElsewhere, elsewhere, moved
from rosetrainer import model as rose
from rosetrainer.config import GPTConfig
from rosetrainer.errors import one_line
from rosetrainer.numerics import logit_tolerance

# Not a power of two anywhere: a hard-coded size cannot pass by luck.
CONFIG = GPTConfig(vocab_size=97, block_size=12, n_layer=2, n_head=3, n_embd=24)
NO_BIAS = dataclasses.replace(CONFIG, bias=False)
SHAPES = ((1, 1), (3, 7), (2, CONFIG.block_size))  # (batch, time) of every input
# A gradient is a longer chain of sums than a logit (the backward pass runs through every
# layer twice): each entry within this share of its parameter's largest gradient.
GRAD_RTOL = 1e-4
# bfloat16 keeps 8 bits of a number: two right answers part by a few 2**-8 of the largest
# logit (float32 is the strict comparison; this one catches what bfloat16 alone shows).
BF16_RTOL = 2**-5
NO_DROPOUT = (
    "the model runs without dropout (config.dropout is 0 here), so train mode computes what "
    "eval mode does: is a dropout of your own switched on by train mode?"
)


def rose_model(config: GPTConfig = CONFIG, wide: bool = True) -> rose.GPT:
    """rose's GPT with the chapters' wide weights, its head tied again; or as rose
    initialises it (std 0.02: small activations, where a LayerNorm's eps shows)."""
    torch.manual_seed(0)
    model = rose.GPT(config).eval()
    if not wide:
        return model
    model = wide_random_init(model, 0)
    model.lm_head.weight = model.transformer.wte.weight
    return model


def loaded(cls: type, reference: nn.Module, config: GPTConfig = CONFIG) -> nn.Module:
    """The learner's `cls(config)` holding `reference`'s weights, loaded strictly."""
    module = cls(config)
    if not isinstance(module, nn.Module):
        raise Mismatch(f"{cls.__name__}(config) is a {type(module).__name__}, not an nn.Module")
    try:
        module.load_state_dict(reference.state_dict())
    except RuntimeError as error:
        first = next(line.strip() for line in str(error).splitlines()[1:] if line.strip())
        raise Mismatch(
            f"rose's {type(reference).__name__} weights do not load into yours: {first}"
        ) from None
    return module.eval()


def close(what: str, want: torch.Tensor, fn: Callable, *args: object, rtol: float = 0.0) -> None:
    """`fn(*args)`, the learner's, within rose's one tolerance rule of `want` (or `rtol`
    of its largest entry); in the grader the check's process's value stands in for it."""
    tolerance = rtol * float(want.abs().max()) if rtol else logit_tolerance(want)
    gap = first_gap(made(what, lambda: fn(*args)), want, tolerance)
    if gap is not None:
        raise Mismatch(f"{what}: {gap}")


def hidden(batch: int, time: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, time, CONFIG.n_embd, generator=torch.Generator().manual_seed(seed))


def token_ids(batch: int, time: int, seed: int, config: GPTConfig = CONFIG) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(config.vocab_size, (batch, time), generator=generator)


def layer(name: str, pick: Callable[[rose.GPT], nn.Module]) -> Callable:
    """A part: the learner's module `name` beside rose's (`pick` of rose's GPT) on SHAPES'
    hidden states."""

    def run(module: types.ModuleType) -> None:
        reference = pick(rose_model())
        mine = loaded(getattr(module, name), reference)
        with torch.no_grad():
            for seed, (batch, time) in enumerate(SHAPES):
                x = hidden(batch, time, seed)
                want = reference(x) if name == "MLP" else reference(x, None)
                close(f"{name} on a ({batch}, {time}) input", want, mine, x)

    return run


def _weights(module: types.ModuleType) -> None:
    for config in (CONFIG, NO_BIAS):
        reference = rose_model(config)
        mine = loaded(module.GPT, reference, config)
        want = {name: list(tensor.shape) for name, tensor in reference.state_dict().items()}
        shapes = seen(
            f"the weights{'' if config.bias else ' without biases'}",
            {name: list(tensor.shape) for name, tensor in mine.state_dict().items()},
        )
        wrong = [name for name in {**shapes, **want} if shapes.get(name) != want.get(name)]
        if wrong:
            raise Mismatch(
                f"rose's GPT weights do not load into yours: {wrong[0]} has shape "
                f"{shapes.get(wrong[0], 'none (missing)')} where rose's has {want.get(wrong[0], 'none')}"
            )


def _logits(module: types.ModuleType) -> None:
    small = " of rose's default-initialised GPT (small activations: LayerNorm's eps, 1e-5, shows)"
    # (the last one, the wide model with biases, then runs in bfloat16 and on another device)
    cases = [(CONFIG, False, small), (NO_BIAS, True, " without biases"), (CONFIG, True, "")]
    for config, wide, which in cases:
        reference = rose_model(config, wide)
        mine = loaded(module.GPT, reference, config)
        with torch.no_grad():
            for seed, (batch, time) in enumerate(SHAPES):
                idx = token_ids(batch, time, seed, config)
                close(
                    f"logits of a ({batch}, {time}) batch{which}", reference(idx).logits, mine, idx
                )
    with torch.no_grad():
        _in_bfloat16(mine.to(torch.bfloat16), reference.to(torch.bfloat16))
        _on_another_device(mine)


def _in_bfloat16(mine: nn.Module, reference: rose.GPT) -> None:
    """The learner's GPT moved to bfloat16 (as rose serves it): the logits in bfloat16,
    near rose's; every tensor it makes in the dtype of the model's."""
    idx = token_ids(2, CONFIG.block_size, 9)
    what = "in bfloat16 (the model moved with .to(torch.bfloat16)) the logits"
    try:
        close(what, reference(idx).logits, mine, idx, rtol=BF16_RTOL)
    except RuntimeError as error:  # a float32 tensor meeting the model's bfloat16 ones
        raise Mismatch(
            f"{what} raise {one_line(error)}: a tensor it makes in float32 meets the "
            "model's bfloat16 ones; compute in the dtype of x"
        ) from None


def _on_another_device(mine: nn.Module) -> None:
    """The learner's GPT, run on the CPU (by _logits), then moved to another device, as a
    model is moved to a GPU (contract.Elsewhere: CPU tensors that say meta, and raise when
    they meet a CPU tensor, as a GPU's do): every tensor it makes for idx goes on idx's
    device, and it keeps no tensor of an earlier call. The positions handed to
    transformer.wpe show where they were made, and a tensor of the CPU mixed with the
    model's raises."""
    devices: list[str] = []

    def positions_here(_wpe: nn.Module, args: tuple, kwargs: dict) -> None:
        devices.extend(t.device.type for t in [*args, *kwargs.values()][:1])

    mine = moved(mine, elsewhere)
    mine.transformer.wpe.register_forward_pre_hook(positions_here, with_kwargs=True)
    try:
        with ToElsewhere():
            mine(torch.zeros(2, 5, dtype=torch.long, device=ELSEWHERE))
        raised = None
    except Exception as error:  # judged below (a device error) or by the other parts
        raised = one_line(error)
    devices, raised = seen("on another device: positions' devices, raised", (devices, raised))
    where = "on a model run on the CPU, then moved to another device (meta, as to a GPU),"
    if any(device != "meta" for device in devices):
        raise Mismatch(
            f"{where} the positions handed to transformer.wpe are on the cpu, not idx's "
            "device: make them there (torch.arange(T, device=idx.device)), or the lookup "
            "fails on a GPU"
        )
    if raised is not None and "device" in raised:
        raise Mismatch(
            f"{where} the forward pass raises ({raised}): a tensor it makes or keeps from "
            "an earlier call is on the CPU, not idx's device (make it with device=idx.device "
            "in forward, or register it as a buffer, which moves with the model)"
        )


def _train_mode(module: types.ModuleType) -> None:
    """The learner's GPT in train mode beside rose's: with config.dropout 0, train mode
    computes what eval mode does (twice, so a random drop cannot pass by luck)."""
    reference = rose_model()
    mine = loaded(module.GPT, reference)
    idx = token_ids(2, CONFIG.block_size, 13)
    with torch.no_grad():
        want = reference(idx).logits
        in_eval = first_gap(
            made("the logits in eval mode", lambda: mine(idx)), want, logit_tolerance(want)
        )
        mine.train()
        for call in range(2):
            got = made(f"the logits in train mode, call {call}", lambda: mine(idx))
            gap = first_gap(got, want, logit_tolerance(want))
            if gap is not None:
                dropout = "" if in_eval else f"; in eval mode they do not: {NO_DROPOUT}"
                raise Mismatch(
                    f"in train mode (model.train()) the logits of a (2, {CONFIG.block_size}) "
                    f"batch leave rose's: {gap}{dropout}"
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
        gap = first_gap(got, param.grad, GRAD_RTOL * float(param.grad.abs().max()))
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


MODEL = Build(
    name="model",
    chapters="00",
    task="GPT-2 whole: attention, MLP, pre-LN block, embeddings, the tied head",
    parts=(
        Part("weights", _weights),
        Part("attention", layer("CausalSelfAttention", lambda gpt: gpt.transformer.h[0].attn)),
        Part("mlp", layer("MLP", lambda gpt: gpt.transformer.h[0].mlp)),
        Part("block", layer("Block", lambda gpt: gpt.transformer.h[1])),
        Part("logits", _logits),
        Part("train mode", _train_mode),
        Part("gradients, in train mode", _gradients),
    ),
    probe=_probe,
    known_wrong=KNOWN_WRONG,
    passed="equal to rose's GPT (rosetrainer/model.py) within the tolerance",
)
