"""The builds: rose's main pieces written whole, each graded part by part against rose.

For every build: the reference solution passes every part; each known wrong answer fails
with its own diagnosis (and its probe tells it apart from the reference and from every
other known mistake); every mutant in the build's mistakes.py (a plausible wrong answer
beyond the known ones, written against the contract as code: the reference with a method
or function replaced) fails at least one part, and is not told it is one of the known
mistakes; an answer written another way that meets the contract passes; the stub fails
every part in one "not written yet" line; and `rose-course` lists the builds apart and
grades one by name, a line per part. A known mistake written blind (`blind_build`) gets
that mistake's diagnosis too.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import math
import types
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from rosecourse import cli
from rosecourse.builds.cached_loop.reference import StaticCache, StaticLayer
from rosecourse.builds.grading import (
    Build,
    KnownWrong,
    PartResult,
    check_build,
    diagnosis,
    known_probes,
    module_from_source,
    observe,
    probed,
    replaced,
    verdict,
)
from rosecourse.builds.training_step.reference import clip_gradients, learning_rate
from rosecourse.builds.training_step.reference import train_step as reference_train_step
from rosecourse.course import BUILDS, hints, stub_source
from rosecourse.exercises import same
from rosecourse.exercises.answers import BLIND_KNOWN, BUILD_ALTERNATIVES, BUILD_MUTANTS, load

pytestmark = pytest.mark.usefixtures("one_torch_thread")

load()  # every build's mistakes.py: its wrong answers and alternatives, registered

BUILD = {build.name: build for build in BUILDS}


def alternative_module(build: Build) -> str:
    """The build's file written whole another way that meets the contract (the source of
    its mistakes.py's ALTERNATIVE_MODULE)."""
    return importlib.import_module(f"rosecourse.builds.{build.name}.mistakes").ALTERNATIVE_MODULE


def told(build: Build, name: str, replacements: dict[str, object], known: str) -> KnownWrong:
    """A known mistake written blind (`blind_build`): its writer's answer, to be
    given that mistake's diagnosis."""
    (wrong,) = [wrong for wrong in build.known_wrong if wrong.name == known]
    return KnownWrong(name, replacements, wrong.explanation)


KNOWN = [(build, wrong) for build in BUILDS for wrong in build.known_wrong] + [
    (BUILD[build], told(BUILD[build], *entry))
    for build, entries in BLIND_KNOWN.items()
    if build in BUILD
    for entry in entries
]


def code_lines(source: str) -> int:
    """Lines of code in the bodies of a module's functions and methods: no docstring,
    comment or blank line."""
    lines = source.splitlines()
    count = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef):
            body = node.body[1:] if isinstance(node.body[0], ast.Expr) else node.body
            for line in lines[body[0].lineno - 1 : body[-1].end_lineno]:
                count += bool(line.split("#")[0].strip())
    return count


def test_every_build_has_mutants_and_an_alternative() -> None:
    assert sorted(BUILD_MUTANTS) == sorted(BUILD)
    assert all(alternative_module(build) for build in BUILDS)
    for name, mutants in BUILD_MUTANTS.items():
        known = {wrong.name for wrong in BUILD[name].known_wrong}
        assert len(mutants) >= 5 and not known & {mutant for mutant, _ in mutants}


@pytest.mark.slow
@pytest.mark.parametrize("build", BUILDS, ids=lambda b: b.name)
def test_reference_passes_every_part_and_is_a_real_build(build: Build) -> None:
    results = check_build(build, build.solution_module())
    assert [r.part for r in results] == [p.name for p in build.parts]
    assert all(r.passed for r in results), "\n".join(map(str, results))
    assert code_lines(inspect.getsource(build.solution_module())) >= 30


@pytest.mark.slow
@pytest.mark.parametrize(("build", "wrong"), KNOWN, ids=[f"{b.name}-{w.name}" for b, w in KNOWN])
def test_known_wrong_answer_fails_with_its_diagnosis(build: Build, wrong) -> None:
    results = check_build(build, replaced(build, wrong.replacements, wrong.name))
    failed = [r for r in results if not r.passed]
    assert failed, f"{wrong.name} passes every part"
    assert all(wrong.explanation in r.explanation for r in failed), "\n".join(map(str, failed))


@pytest.mark.parametrize("build", BUILDS, ids=lambda b: b.name)
def test_each_known_wrong_probe_tells_it_apart(build: Build) -> None:
    reference = build.probe(build.solution_module())
    probes = known_probes(build)
    for i, (wrong, outcomes) in enumerate(probes):
        assert outcomes is not None, f"{wrong.name} breaks the probe"
        assert not same(outcomes, reference), f"{wrong.name} probes like the reference"
        for other, other_outcomes in probes[:i]:
            assert not same(outcomes, other_outcomes), f"{wrong.name} probes like {other.name}"


def first_failure(build: Build, module: types.ModuleType) -> PartResult | None:
    """The first part of `build` that `module` fails, judged as `check_build` judges it, or
    None when it passes every part: the parts after it are not run (a wrong answer needs
    one; each part that finds a difference is given the same diagnosis, the probe's)."""
    named = functools.cache(lambda: diagnosis(build, probed(build, module)) or "")
    for part in build.parts:
        result = verdict(build, part, *observe(build, part, module), named)
        if not result.passed:
            return result
    return None


CODED = [(BUILD[name], m) for name, mutants in BUILD_MUTANTS.items() for m in mutants]


# Wrong answers of the general classes (issue 54), each with the clause its failure names.
def _mlp_in_float64(self, x: torch.Tensor) -> torch.Tensor:
    # the mistake: the MLP computes in float64 (close values, another dtype)
    return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")).double()


@torch.no_grad()
def _adamw_skips_zero_gradients(self) -> None:
    for group in self.param_groups:
        lr, (beta1, beta2) = group["lr"], group["betas"]
        for p in group["params"]:
            # the mistake: was `if p.grad is None:` (an all-zero gradient is a gradient)
            if p.grad is None or not p.grad.any():
                continue
            state = self.state[p]
            if not state:
                state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
            state["t"] += 1
            t, m, v, grad = state["t"], state["m"], state["v"], p.grad
            p.mul_(1 - lr * group["weight_decay"])
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            m_hat = m / (1 - beta1**t)
            v_hat = v / (1 - beta2**t)
            p.sub_(lr * m_hat / (v_hat.sqrt() + group["eps"]))


def _pads_on_the_cpu(self, model, batch_size: int, max_len: int, pad_lengths=None) -> None:
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
    # the mistake: was `torch.tensor(pad_lengths or [0] * batch_size, device=weight.device)`
    self.pads = torch.tensor(pad_lengths or [0] * batch_size)
    slots = torch.arange(max_len, device=weight.device)
    self.real = slots[None, :] >= self.pads.to(weight.device)[:, None]


def _positions_kept_from_the_first_call(self, idx: torch.Tensor) -> torch.Tensor:
    # the mistake: the positions made once, on the first call's device, and kept (a plain
    # attribute, not a buffer: moving the model leaves them behind)
    if "positions" not in vars(self):
        self.positions = torch.arange(self.transformer.wpe.num_embeddings, device=idx.device)
    x = self.transformer.wte(idx) + self.transformer.wpe(self.positions[: idx.size(1)])
    for block in self.transformer.h:
        x = block(x)
    return self.lm_head(self.transformer.ln_f(x))


def _softmax_in_float32(self, x: torch.Tensor) -> torch.Tensor:
    B, T, C = x.shape
    q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.c_attn(x).split(C, 2))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.n_head)
    allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    # the mistake: the weights in float32 (scores.float()) multiplied by the model's values
    y = torch.softmax(scores.float(), dim=-1) @ v
    return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def _prompts_padded_in_place(model, prompts, max_new_tokens, prefill_chunk=None):
    longest = max(len(prompt) for prompt in prompts)
    pads = [longest - len(prompt) for prompt in prompts]
    for pad, prompt in zip(pads, prompts, strict=True):
        prompt[:0] = [0] * pad  # the mistake: the caller's lists padded in place
    ids = torch.tensor(prompts, device=model.lm_head.weight.device)
    cache = StaticCache(model, len(prompts), longest + max_new_tokens, pads)
    chunk = prefill_chunk or longest
    for start in range(0, longest, chunk):
        logits = model(ids[:, start : start + chunk], cache=cache).logits[:, -1]
    new_tokens = [[] for _ in prompts]
    for step in range(max_new_tokens):
        next_ids = logits.argmax(dim=-1)
        for row, token in zip(new_tokens, next_ids.tolist(), strict=True):
            row.append(token)
        if step + 1 < max_new_tokens:
            logits = model(next_ids[:, None], cache=cache).logits[:, -1]
    return new_tokens


@torch.no_grad()
def _ids_made_on_the_cpu(model, prompts, max_new_tokens, prefill_chunk=None):
    longest = max(map(len, prompts))
    pads = [longest - len(p) for p in prompts]
    # the mistake: the ids made where torch.tensor makes them, on the CPU (no device=)
    ids = torch.tensor([[0] * pad + p for pad, p in zip(pads, prompts, strict=True)])
    cache = StaticCache(model, len(prompts), longest + max_new_tokens, pads)
    chunk = prefill_chunk or longest
    for start in range(0, longest, chunk):
        logits = model(ids[:, start : start + chunk], cache=cache).logits[:, -1]
    columns = []
    for _ in range(max_new_tokens):
        columns.append(logits.argmax(-1).tolist())
        logits = model(torch.tensor(columns[-1])[:, None], cache=cache).logits[:, -1]
    return [list(row) for row in zip(*columns, strict=True)]


def _slots_made_on_the_cpu(self, batch: int, q_len: int, device: torch.device):
    self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
    self.filled += q_len
    slots = torch.arange(self.max_len)  # the mistake: was `torch.arange(..., device=device)`
    causal = slots[None, :] <= self.input_pos[:, None]
    mask = causal[None, None, :, :] & self.real[:, None, None, :]
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    return (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0), mask


def _autocast_for_cuda(model, optimizer, batches, step, cfg):
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, cfg)
    total = 0.0
    for _ in range(cfg.grad_accum_steps):
        x, y = next(batches)
        # the mistake: autocast for "cuda" whatever the parameters' device (on the CPU it
        # switches itself off, with a warning: the forward runs in float32)
        with torch.autocast("cuda", torch.bfloat16, enabled=cfg.dtype == "bfloat16"):
            loss = model(x, y).loss / cfg.grad_accum_steps
        loss.backward()
        total += loss.item()
    norm = clip_gradients(model.parameters(), cfg.grad_clip or math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, norm


def _weights_in_bfloat16(model, optimizer, batches, step, cfg):
    if cfg.dtype == "bfloat16":
        model.to(torch.bfloat16)  # the mistake: the weights themselves (no float32 ones kept)
    return reference_train_step(model, optimizer, batches, step, cfg)


GENERAL = [
    ("model", {"MLP.forward": _mlp_in_float64}, "dtype torch.float64 where torch.float32 is right"),
    (
        "model",
        {"GPT.forward": _positions_kept_from_the_first_call},
        "run on the CPU, then moved to another device",
    ),
    ("model", {"CausalSelfAttention.forward": _softmax_in_float32}, "in bfloat16"),
    (
        "training_step",
        {"AdamW.step": _adamw_skips_zero_gradients},
        "its gradient all zeros: still a gradient",
    ),
    (
        "cached_loop",
        {"StaticCache.__init__": _pads_on_the_cpu},
        "with the model moved to another device (meta, as to a GPU), StaticCache.prepare raises",
    ),
    (
        "cached_loop",
        {"generate_cached": _prompts_padded_in_place},
        "generate_cached changed the prompt lists it was given",
    ),
    ("cached_loop", {"generate_cached": _ids_made_on_the_cpu}, "feeds it ids on the cpu"),
    (
        "cached_loop",
        {"StaticCache.prepare": _slots_made_on_the_cpu},
        "with the model moved to another device (meta, as to a GPU), _slots_made_on_the_cpu raises",
    ),
    ("training_step", {"train_step": _autocast_for_cuda}, "cfg.dtype bfloat16: rose's trainer"),
    ("training_step", {"train_step": _weights_in_bfloat16}, "cfg.dtype bfloat16: rose's trainer"),
]


@pytest.mark.parametrize(
    ("name", "replacements", "clause"), GENERAL, ids=[f"{g[0]}-{next(iter(g[1]))}" for g in GENERAL]
)
@pytest.mark.slow
def test_a_wrong_answer_of_a_general_class_fails_naming_the_clause(
    name: str, replacements: dict, clause: str
) -> None:
    failed = first_failure(BUILD[name], replaced(BUILD[name], replacements, "general"))
    assert failed is not None and clause in failed.explanation, failed


@pytest.mark.slow
@pytest.mark.parametrize("build", BUILDS, ids=lambda b: b.name)
def test_the_verdict_is_the_graders_whatever_the_checks_process_says(build: Build) -> None:
    """A known wrong answer whose check's process finds no failure (its comparisons there
    forged away): every part is judged again from the values it sent, and one fails."""
    wrong = build.known_wrong[0]
    module = replaced(build, wrong.replacements, wrong.name)
    results = [
        verdict(build, part, observe(build, part, module)[0], None, lambda: "")
        for part in build.parts
    ]
    assert not all(result.passed for result in results), results
    empty = verdict(build, build.parts[0], [], None, lambda: "")  # it sent no value at all
    assert not empty.passed and "the check's process sent no" in empty.explanation, empty


@pytest.mark.slow
@pytest.mark.parametrize(("build", "mutant"), CODED, ids=[f"{b.name}-{m[0]}" for b, m in CODED])
def test_mutant_fails(build: Build, mutant) -> None:
    name, replacements = mutant
    failed = first_failure(build, replaced(build, replacements, name))
    assert failed is not None, f"the mutant {name} passes every part"
    named = [w.name for w in build.known_wrong if w.explanation in failed.explanation]
    assert not named, f"the mutant {name} is told it is {named[0]}"


CODED_RIGHT = [(BUILD[name], a) for name, alts in BUILD_ALTERNATIVES.items() for a in alts]


@pytest.mark.parametrize(
    ("build", "answer"), CODED_RIGHT, ids=[f"{b.name}-{a[0]}" for b, a in CODED_RIGHT]
)
@pytest.mark.slow
def test_alternative_passes(build: Build, answer) -> None:
    name, replacements = answer
    results = check_build(build, replaced(build, replacements, name))
    assert all(r.passed for r in results), "\n".join(map(str, results))


@pytest.mark.slow
@pytest.mark.parametrize("build", BUILDS, ids=lambda b: b.name)
def test_another_answer_that_meets_the_contract_passes(build: Build) -> None:
    module = module_from_source(alternative_module(build), f"alternative_{build.name}")
    results = check_build(build, module)
    assert all(r.passed for r in results), "\n".join(map(str, results))


@pytest.mark.parametrize("build", BUILDS, ids=lambda b: b.name)
def test_stub_fails_every_part_in_one_line(build: Build, tmp_path: Path, capsys) -> None:
    stub = stub_source(build)
    assert "NotImplementedError" in stub and code_lines(stub) == stub.count("NotImplementedError")
    (tmp_path / build.file_name).write_text(stub, encoding="utf-8")
    assert cli.main(["check", build.name, "--dir", str(tmp_path)]) == 1
    *lines, hints = capsys.readouterr().out.splitlines()  # a line per part, the hints used
    assert hints.startswith("hints used: 0 of "), hints
    assert len(lines) == len(build.parts)
    for line, part in zip(lines, build.parts, strict=True):
        assert line.startswith(f"{build.name}/{part.name}: not written yet"), line
    # `rose-course` tells an untouched stub from its source (course.unwritten), without
    # running it: its lines are the ones the parts print when they run the stub.
    ran = check_build(build, module_from_source(stub, f"stub_{build.name}"))
    assert lines == [str(result) for result in ran]


@pytest.mark.slow
def test_list_shows_builds_apart_and_check_grades_one_by_name(tmp_path: Path, capsys) -> None:
    assert cli.main(["list"]) == 0
    listing = capsys.readouterr().out
    exercises, builds = listing.split("\n\n")
    assert "build_" not in exercises
    assert [line.split()[0] for line in builds.splitlines()[1:]] == list(BUILD)
    assert cli.main(["start", str(tmp_path), "--solutions"]) == 0
    capsys.readouterr()
    assert cli.main(["check", "model", "--dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        *(f"model/{p.name}: passed: {BUILD['model'].passed}" for p in BUILD["model"].parts),
        f"hints used: 0 of {len(hints('model'))}",
    ]
