"""The builds: rose's main pieces written whole, each graded part by part against rose.

For every build: the reference solution passes every part; each known wrong answer fails
with its own diagnosis (and its probe tells it apart from the reference and from every
other known mistake); every mutant of tests/mutants.py (a plausible wrong answer beyond
the known ones, written against the contract as code: the reference with a method or
function replaced) fails at least one part, and is not told it is one of the known
mistakes; an answer written another way that meets the contract passes; the stub fails every part in one "not written yet"
line; and `rose-course` lists the builds apart and grades one by name, a line per part.
A known mistake written blind (tests/blind_mutants.py) gets that mistake's diagnosis too.
"""

from __future__ import annotations

import ast
import functools
import inspect
import math
import types
from pathlib import Path

import pytest
import torch
from mutants import BLIND_KNOWN, BUILD_ALTERNATIVES, BUILD_MUTANTS
from torch.nn import functional as F

from rosecourse import cli
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
from rosecourse.course import BUILDS, hints, stub_source
from rosecourse.exercises import same
from rosecourse.solutions.build_cached_loop import StaticCache, StaticLayer
from rosecourse.solutions.build_training_step import clip_gradients, learning_rate
from rosecourse.solutions.build_training_step import train_step as reference_train_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BUILD = {build.name: build for build in BUILDS}

ALTERNATIVES: dict[str, str] = {
    "model": """
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
""",
    "cached_loop": """
import torch


class StaticLayer:
    def __init__(self, k, v):
        self.buffers = (k, v)

    def update(self, input_pos, k, v):
        for buffer, new in zip(self.buffers, (k, v)):
            buffer.index_copy_(2, input_pos, new)
        return self.buffers


class StaticCache:
    def __init__(self, model, batch_size, max_len, pad_lengths=None):
        c = model.config
        w = model.lm_head.weight
        shape = (batch_size, c.n_head, max_len, c.n_embd // c.n_head)
        self.layers = [
            StaticLayer(w.new_zeros(shape), w.new_zeros(shape)) for _ in range(c.n_layer)
        ]
        self.full = torch.ones(max_len, max_len, dtype=torch.bool, device=w.device).tril()
        self.pads = pad_lengths or [0] * batch_size
        self.filled = 0

    @property
    def seq_len(self):
        return self.filled

    def prepare(self, batch, q_len, device):
        self.at = torch.arange(self.filled, self.filled + q_len, device=device)
        self.filled += q_len
        n = self.filled
        rows = self.full[self.at, :n]  # only the filled slots
        real = torch.stack([torch.arange(n, device=device) >= p for p in self.pads])
        mask = rows[None, None] & real[:, None, None]
        mask[~mask.any(-1)] = True
        pads = torch.tensor(self.pads, device=device)[:, None]
        return torch.relu(self.at[None] - pads), mask

    def update(self, layer, k, v):
        keys, values = self.layers[layer].update(self.at, k, v)
        return keys[:, :, : self.filled], values[:, :, : self.filled]


def generate_cached(model, prompts, max_new_tokens, prefill_chunk=None):
    width = max(map(len, prompts))
    pads = [width - len(p) for p in prompts]
    rows = [[0] * (width - len(p)) + p for p in prompts]
    ids = torch.tensor(rows, device=model.lm_head.weight.device)
    cache = StaticCache(model, len(prompts), width + max_new_tokens - 1, pads)
    with torch.inference_mode():
        done = 0
        while done < width:
            step = prefill_chunk or width
            out = model(ids[:, done : done + step], cache=cache).logits
            done += step
        tokens = out[:, -1].argmax(-1, keepdim=True)
        made = [tokens]
        while len(made) < max_new_tokens:
            tokens = model(tokens, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
            made.append(tokens)
    return torch.cat(made, dim=1).tolist()
""",
    "block_manager": """
import collections
import hashlib

from roseinfer.engine.block_manager import Block


def chain_hash(parent, token_ids):
    return hashlib.blake2b(repr((parent, tuple(token_ids))).encode()).digest()


class BlockManager:
    def __init__(self, num_blocks, kv_block_size, enable_prefix_caching):
        self.kv_block_size = kv_block_size
        self.caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids = collections.deque(range(num_blocks))
        self.cached = {}
        self.evictable = collections.OrderedDict()
        self.prefix_cache_queries = self.prefix_cache_hits = self.cache_version = 0

    num_blocks = property(lambda self: len(self.blocks))
    num_free = property(lambda self: len(self.free_ids))
    num_used = property(lambda self: sum(b.ref_count > 0 for b in self.blocks))

    def _full(self, n):
        return (n - 1) // self.kv_block_size if self.caching else 0

    def _blocks(self, n):
        return (n + self.kv_block_size - 1) // self.kv_block_size

    def cached_prefix(self, token_ids):
        out, key = [], b""
        for i in range(self._full(len(token_ids))):
            piece = tuple(token_ids[i * self.kv_block_size : (i + 1) * self.kv_block_size])
            key = chain_hash(key, piece)
            hit = self.cached.get(key)
            if hit is None or self.blocks[hit].token_ids != piece:
                return out
            out.append(hit)
        return out

    def can_start(self, cached_ids, num_tokens):
        room = len(self.free_ids) + len(self.evictable)
        room -= len([b for b in cached_ids if b in self.evictable])
        return self._blocks(num_tokens) - len(cached_ids) <= room

    def start(self, seq, cached_ids, num_tokens):
        self.prefix_cache_queries += self._full(len(seq.all_ids))
        self.prefix_cache_hits += len(cached_ids)
        for b in cached_ids:
            self.evictable.pop(b, None)
            self.blocks[b].ref_count += 1
        seq.block_table = list(cached_ids)
        seq.block_hashes = [self.blocks[b].hash for b in cached_ids]
        seq.num_computed_tokens = len(cached_ids) * self.kv_block_size
        if len(seq.output_ids) == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
        self.grow(seq, num_tokens)

    def can_grow(self, seq, num_tokens):
        missing = self._blocks(num_tokens) - len(seq.block_table)
        return missing <= len(self.free_ids) + len(self.evictable)

    def grow(self, seq, num_tokens):
        for _ in range(self._blocks(num_tokens) - len(seq.block_table)):
            if self.free_ids:
                b = self.free_ids.popleft()
            else:
                b = next(iter(self.evictable))
                del self.evictable[b]
                old = self.blocks[b]
                self.cached.pop(old.hash)
                old.hash, old.token_ids = None, ()
                self.cache_version += 1
            self.blocks[b].ref_count = 1
            seq.block_table.append(b)

    def release(self, seq):
        for b in seq.block_table[::-1]:
            block = self.blocks[b]
            block.ref_count -= 1
            if block.ref_count:
                continue
            if block.hash is None:
                self.free_ids.append(b)
            else:
                self.evictable[b] = None
        seq.block_table, seq.block_hashes, seq.num_computed_tokens = [], [], 0

    def advance(self, seq, num_new):
        seq.num_computed_tokens += num_new
        size = self.kv_block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // size):
            if not self.caching:
                return
            piece = tuple(seq.all_ids[i * size : (i + 1) * size])
            key = chain_hash(seq.block_hashes[i - 1] if i else b"", piece)
            seq.block_hashes.append(key)
            block = self.blocks[seq.block_table[i]]
            if key in self.cached or block.hash is not None:
                continue
            block.hash, block.token_ids = key, piece
            self.cached[key] = block.block_id
            self.cache_version += 1
""",
    "training_step": """
import math

import torch


class AdamW(torch.optim.Optimizer):
    def __init__(self, params, lr, betas, eps=1e-8, weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in (q for q in group["params"] if q.grad is not None):
                s = self.state[p]
                s.setdefault("exp_avg", torch.zeros_like(p))
                s.setdefault("exp_avg_sq", torch.zeros_like(p))
                s["n"] = s.get("n", 0) + 1
                p.mul_(1 - group["lr"] * group["weight_decay"])
                s["exp_avg"].lerp_(p.grad, 1 - b1)
                s["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (s["exp_avg_sq"].sqrt() / math.sqrt(1 - b2 ** s["n"])).add_(group["eps"])
                p.addcdiv_(s["exp_avg"], denom, value=-group["lr"] / (1 - b1 ** s["n"]))


def parameter_groups(model, weight_decay):
    seen, decay, keep = set(), [], []
    for _, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (decay if p.ndim > 1 else keep).append(p)
    return [dict(params=keep, weight_decay=0.0), dict(params=decay, weight_decay=weight_decay)]


def make_optimizer(model, cfg):
    return AdamW(
        parameter_groups(model, cfg.weight_decay), lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2)
    )


def learning_rate(step, cfg):
    end = cfg.max_steps if cfg.lr_decay_steps is None else cfg.lr_decay_steps
    if step < cfg.warmup_steps:
        return (step + 1) * cfg.learning_rate / cfg.warmup_steps
    t = min(1.0, (step - cfg.warmup_steps) / (end - cfg.warmup_steps))
    return cfg.min_lr + (cfg.learning_rate - cfg.min_lr) * (1 + math.cos(math.pi * t)) / 2


def clip_gradients(parameters, max_norm):
    return float(torch.nn.utils.clip_grad_norm_(list(parameters), max_norm))


def train_step(model, optimizer, batches, step, cfg):
    rate = learning_rate(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = rate
    device = next(model.parameters()).device.type
    with torch.autocast(device, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16"):
        losses = [model(*next(batches)).loss for _ in range(cfg.grad_accum_steps)]
    mean = torch.stack(losses).mean()
    mean.backward()
    norm = clip_gradients(model.parameters(), cfg.grad_clip or math.inf)
    optimizer.step()
    optimizer.zero_grad()
    return mean.item(), norm
""",
    "verify": """
import torch


class RollbackCache:
    def __init__(self):
        self.keys, self.values, self.length = {}, {}, 0

    @property
    def seq_len(self):
        return self.length

    def prepare(self, batch, q_len, device):
        start = self.length
        self.length += q_len
        mask = torch.ones(q_len, self.length, dtype=torch.bool, device=device).tril(start)
        return (start + torch.arange(q_len, device=device)).unsqueeze(0), mask

    def update(self, layer, k, v):
        if layer in self.keys:
            k = torch.cat((self.keys[layer], k), 2)
            v = torch.cat((self.values[layer], v), 2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def truncate(self, n):
        self.length = n
        for layer in self.keys:
            self.keys[layer] = self.keys[layer][..., :n, :]
            self.values[layer] = self.values[layer][..., :n, :]


def score(target, cache, last_token, drafts):
    ids = torch.tensor([last_token] + drafts).unsqueeze(0)
    with torch.inference_mode():
        return target(ids, cache=cache).logits.squeeze(0).float()


def verify_greedy(target, cache, last_token, drafts):
    start = cache.seq_len
    best = score(target, cache, last_token, drafts).argmax(-1)
    agree = (torch.tensor(drafts, dtype=torch.long) == best[:-1]).long().cumprod(0)
    n = int(agree.sum())
    out = best[: n + 1].tolist()
    cache.truncate(start + n + 1)
    return out


def accept_or_resample(p, q, drafted, generator):
    if float(torch.rand(1, generator=generator)) < min(1.0, float(p[drafted] / q[drafted])):
        return drafted, True
    left = torch.maximum(p - q, torch.zeros_like(p)).double().cumsum(0)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * left[-1]
    return int(torch.searchsorted(left, u, right=True).clamp(max=len(p) - 1)), False


def verify_sampled(target, cache, last_token, drafts, draft_probs, generator):
    start = cache.seq_len
    probs = score(target, cache, last_token, drafts).softmax(-1)
    out = []
    for i in range(len(drafts) + 1):
        if i == len(drafts):
            out.append(int(probs[i].multinomial(1, generator=generator)))
            break
        token, kept = accept_or_resample(probs[i], draft_probs[i], drafts[i], generator)
        out.append(token)
        if not kept:
            break
    cache.truncate(start + len(out))
    return out
""",
}


def told(build: Build, name: str, replacements: dict[str, object], known: str) -> KnownWrong:
    """A known mistake written blind (tests/blind_mutants.py): its writer's answer, to be
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
    assert sorted(BUILD_MUTANTS) == sorted(BUILD) == sorted(ALTERNATIVES)
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
    module = module_from_source(ALTERNATIVES[build.name], f"alternative_{build.name}")
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
