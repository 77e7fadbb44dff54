"""Plausible wrong answers to every chapter's exercise, beyond its known-wrong list.

Each is written against the exercise's contract (rosecourse/exercises/chNN_*/reference.py) the way
a learner might get it wrong: off by one, the wrong axis, one row only, a constant where
a parameter belongs, a missing comparison, rounding the wrong way. tests/course/test_mutants.py
asserts that each fails its check without being taken for a known mistake, and that the
alternatives (other answers that meet the contract) pass.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

# The chapters' answers (read in by `load()` below), re-exported beside the builds' for the tests.
from rosecourse.exercises.answers import (  # noqa: F401
    ALTERNATIVES,
    BLIND,
    BLIND_KNOWN,
    CLAUSES,
    MUTANTS,
    load,
)
from rosecourse.solutions import build_block_manager as reference_block_manager
from rosecourse.solutions import build_cached_loop as reference_cached_loop
from rosecourse.solutions import build_model as reference_model
from rosecourse.solutions import build_training_step as reference_training_step

# The names the builds' mutants read (each runs with the learner module's globals: these
# are the reference's, for the reader and the linter).
from rosecourse.solutions.build_block_manager import chain_hash
from rosecourse.solutions.build_cached_loop import StaticCache, StaticLayer
from rosecourse.solutions.build_model import MLP, Block, CausalSelfAttention
from rosecourse.solutions.build_training_step import (
    AdamW,
    clip_gradients,
    learning_rate,
    parameter_groups,
)
from rosecourse.solutions.build_verify import RollbackCache, accept_or_resample, score
from roseinfer.cache.dense import DenseKVCache
from roseinfer.engine.sequence import EngineSequence
from rosetrainer.config import GPTConfig, TrainConfig
from rosetrainer.model import GPT

# The chapters' answers are data in each exercise's folder (rosecourse/exercises/answers.py);
# this file keeps the builds' and reads the chapters' in with `load()`.
load()


# == The builds: wrong answers written as code ===============================================
#
# Each is the build's reference solution (rosecourse/solutions/build_NAME.py) with one
# class or function replaced by the code below. A replacing function runs with the
# learner module's globals (so it builds the StaticCache the check swaps in), a replacing
# class may subclass the reference's. tests/course/test_builds.py asserts that each fails a part
# of its build, and that each alternative passes every part.

BUILD_MUTANTS: dict[str, list[tuple[str, dict[str, object]]]] = {}
BUILD_ALTERNATIVES: dict[str, list[tuple[str, dict[str, object]]]] = {}


def build_mutant(build: str, replaces: str, name: str | None = None) -> Callable:
    """Register the decorated function or class as a wrong answer: the reference with
    `replaces` (a module-level name, or "Class.method") swapped for it. Registered again
    under the same name, it replaces that piece too (one mistake in two places)."""

    def register(obj: Callable) -> Callable:
        mutants = BUILD_MUTANTS.setdefault(build, [])
        key = name or obj.__name__
        same = [replacements for named, replacements in mutants if named == key]
        if same:
            assert replaces not in same[0], f"{build}: {key} replaces {replaces} twice"
            same[0][replaces] = obj
        else:
            mutants.append((key, {replaces: obj}))
        return obj

    return register


def build_alternative(build: str, replaces: str, name: str | None = None) -> Callable:
    """Register the decorated function or class as an answer that meets the contract."""

    def register(obj: Callable) -> Callable:
        BUILD_ALTERNATIVES.setdefault(build, []).append((name or obj.__name__, {replaces: obj}))
        return obj

    return register


# -- build cached_loop: StaticLayer, StaticCache, generate_cached ---------------------------
# These functions run with the learner module's globals: StaticCache is whatever the
# module holds under that name (rose's own static cache while the loop is checked).

END_OF_TEXT = 50256  # GPT-2's <|endoftext|>


def _padded(prompts: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    longest = max(map(len, prompts))
    pads = [longest - len(p) for p in prompts]
    return torch.tensor([[0] * pad + p for pad, p in zip(pads, prompts, strict=True)]), pads


@build_mutant("cached_loop", "generate_cached")
def loop_without_a_cache(model, prompts, max_new_tokens, prefill_chunk=None):
    # The whole sequence through the model every step, one prompt at a time: right tokens,
    # and no cache at all.
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_new_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(prompt) :])
    return out


@build_mutant("cached_loop", "generate_cached")
def one_prompt_at_a_time(model, prompts, max_new_tokens, prefill_chunk=None):
    out = []
    with torch.no_grad():
        for prompt in prompts:
            cache = StaticCache(model, 1, len(prompt) + max_new_tokens)  # noqa: F821
            ids = torch.tensor([prompt])
            chunk = prefill_chunk or len(prompt)
            for start in range(0, len(prompt), chunk):
                logits = model(ids[:, start : start + chunk], cache=cache).logits[:, -1]
            tokens = []
            for _ in range(max_new_tokens):
                tokens.append(int(logits.argmax()))
                logits = model(torch.tensor([[tokens[-1]]]), cache=cache).logits[:, -1]
            out.append(tokens)
    return out


def _cached_loop(model, prompts, max_new_tokens, chunks, stop=None):
    """The reference's loop with the prefill split as `chunks(longest)` says and an
    optional stop(new_tokens) -> bool checked after every step."""
    ids, pads = _padded(prompts)
    longest = ids.size(1)
    cache = StaticCache(model, len(prompts), longest + max_new_tokens, pads)  # noqa: F821
    with torch.no_grad():
        start = 0
        for size in chunks(longest):
            logits = model(ids[:, start : start + size], cache=cache).logits[:, -1]
            start += size
        new_tokens = [[] for _ in prompts]
        for step in range(max_new_tokens):
            next_ids = logits.argmax(dim=-1)
            for row, token in zip(new_tokens, next_ids.tolist(), strict=True):
                row.append(token)
            if stop is not None and stop(new_tokens):
                break
            if step + 1 < max_new_tokens:
                logits = model(next_ids[:, None], cache=cache).logits[:, -1]
    return new_tokens


@build_mutant("cached_loop", "generate_cached")
def prefill_ignores_the_chunk(model, prompts, max_new_tokens, prefill_chunk=None):
    return _cached_loop(model, prompts, max_new_tokens, lambda n: [n])


@build_mutant("cached_loop", "generate_cached")
def stops_at_end_of_text(model, prompts, max_new_tokens, prefill_chunk=None):
    def chunks(n):
        size = prefill_chunk or n
        return [min(size, n - s) for s in range(0, n, size)]

    return _cached_loop(
        model, prompts, max_new_tokens, chunks, lambda rows: END_OF_TEXT in rows[0][-1:]
    )


@build_mutant("cached_loop", "generate_cached")
def prefill_leaves_the_last_token(model, prompts, max_new_tokens, prefill_chunk=None):
    # All but the last prompt token in one call, the last fed as a first decode step.
    return _cached_loop(model, prompts, max_new_tokens, lambda n: [n - 1, 1])


@build_mutant("cached_loop", "generate_cached")
def a_fresh_cache_every_step(model, prompts, max_new_tokens, prefill_chunk=None):
    # A cache, but rebuilt and refilled with the whole sequence every step.
    ids, pads = _padded(prompts)
    new_tokens = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            cache = StaticCache(model, len(prompts), ids.size(1), pads)  # noqa: F821
            next_ids = model(ids, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
            new_tokens.append(next_ids)
            ids = torch.cat([ids, next_ids], dim=1)
    return torch.cat(new_tokens, dim=1).tolist()


@build_mutant("cached_loop", "generate_cached")
def cache_for_the_prefill_alone(model, prompts, max_new_tokens, prefill_chunk=None):
    # The prompts through the cache, then every decode step over each whole sequence.
    ids, pads = _padded(prompts)
    cache = StaticCache(model, len(prompts), ids.size(1), pads)  # noqa: F821
    with torch.no_grad():
        first = model(ids, cache=cache).logits[:, -1].argmax(-1).tolist()
    out = []
    for prompt, token in zip(prompts, first, strict=True):
        seq = [*prompt, token]
        with torch.no_grad():
            for _ in range(max_new_tokens - 1):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        out.append(seq[len(prompt) :])
    return out


@build_mutant("cached_loop", "generate_cached")
def each_row_stops_at_end_of_text(model, prompts, max_new_tokens, prefill_chunk=None):
    def chunks(n):
        size = prefill_chunk or n
        return [min(size, n - s) for s in range(0, n, size)]

    rows = _cached_loop(model, prompts, max_new_tokens, chunks)
    return [row[: row.index(END_OF_TEXT) + 1] if END_OF_TEXT in row else row for row in rows]


@build_mutant("cached_loop", "generate_cached")
def the_last_prompt_tokens_alone_when_chunked(model, prompts, max_new_tokens, prefill_chunk=None):
    # Chunks of prefill_chunk, but a remainder shorter than a chunk fed a token a call.
    def chunks(n):
        size = prefill_chunk or n
        whole = [size] * (n // size)
        return whole + [1] * (n - sum(whole))

    return _cached_loop(model, prompts, max_new_tokens, chunks)


@build_mutant("cached_loop", "StaticCache", name="buffers_in_the_default_dtype")
class DefaultDtypeCache(reference_cached_loop.StaticCache):
    def __init__(self, model, batch_size, max_len, pad_lengths=None):
        super().__init__(model, batch_size, max_len, pad_lengths)
        for layer in self.layers:  # torch.zeros(shape): float32 whatever the model's dtype
            layer.k, layer.v = torch.zeros(layer.k.shape), torch.zeros(layer.v.shape)


@build_mutant("cached_loop", "StaticCache", name="values_in_the_default_dtype")
class DefaultDtypeValues(reference_cached_loop.StaticCache):
    def __init__(self, model, batch_size, max_len, pad_lengths=None):
        super().__init__(model, batch_size, max_len, pad_lengths)
        for layer in self.layers:
            layer.v = torch.zeros(layer.v.shape)


class _CastingLayer(reference_cached_loop.StaticLayer):
    def update(self, input_pos, k, v):
        self.k[:, :, input_pos] = k.to(self.k.dtype)
        self.v[:, :, input_pos] = v.to(self.v.dtype)
        return self.k.to(k.dtype), self.v.to(v.dtype)  # cast back: the dtype looks right


@build_mutant("cached_loop", "StaticCache", name="float32_buffers_cast_back")
class Float32BuffersCastBack(reference_cached_loop.StaticCache):
    def __init__(self, model, batch_size, max_len, pad_lengths=None):
        super().__init__(model, batch_size, max_len, pad_lengths)
        self.layers = [
            _CastingLayer(torch.zeros(layer.k.shape), torch.zeros(layer.v.shape))
            for layer in self.layers
        ]


@build_mutant("cached_loop", "StaticCache", name="padding_queries_see_nothing")
class PaddingQueriesSeeNothing(reference_cached_loop.StaticCache):
    def prepare(self, batch, q_len, device):
        self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
        self.filled += q_len
        slots = torch.arange(self.max_len, device=device)
        causal = slots[None, :] <= self.input_pos[:, None]
        mask = causal[None, None, :, :] & self.real[:, None, None, :]  # all False: NaN rows
        pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)
        return pos, mask


@build_alternative("cached_loop", "generate_cached")
def loop_that_feeds_the_last_token_too(model, prompts, max_new_tokens, prefill_chunk=None):
    # Remainder first, logits of the last position alone, and one decode call a token
    # (the last one's logits unused): a cached loop all the same.
    ids, pads = _padded(prompts)
    ids = ids.to(model.lm_head.weight.device)
    longest = ids.size(1)
    size = prefill_chunk or longest
    cache = StaticCache(model, len(prompts), longest + max_new_tokens, pads)  # noqa: F821
    cuts = [0, *range(longest % size or size, longest + 1, size)]
    out = []
    with torch.inference_mode():
        for start, end in zip(cuts, cuts[1:], strict=False):
            logits = model.forward(idx=ids[:, start:end], cache=cache, last_only=True).logits
        for _ in range(max_new_tokens):
            out.append(logits[:, -1].argmax(-1, keepdim=True))
            logits = model(out[-1], cache=cache, last_only=True).logits
    return torch.cat(out, dim=1).tolist()


@build_alternative("cached_loop", "StaticCache", name="padding_queries_see_themselves")
class PaddingQueriesSeeThemselves(reference_cached_loop.StaticCache):
    def prepare(self, batch, q_len, device):
        self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
        self.filled += q_len
        slots = torch.arange(self.max_len, device=device)
        causal = slots[None, :] <= self.input_pos[:, None]
        mask = causal[None, None, :, :] & self.real[:, None, None, :]
        # A padding slot's query sees its own slot alone (no NaN, and nothing real).
        own = slots[None, :] == self.input_pos[:, None]  # (q_len, max_len)
        padding_query = self.input_pos[None, :] < self.pads[:, None]  # (B, q_len)
        mask = mask | (own[None, None] & padding_query[:, None, :, None])
        pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)
        return pos, mask


# -- build verify: accept_or_resample, verify_sampled (chapter 19) ---------------------------
# These run with the learner module's globals: score, accept_or_resample.


@build_mutant("verify", "accept_or_resample")
def rule_draws_from_the_global_rng(p, q, drafted, generator):
    if torch.rand(()) * q[drafted] < p[drafted]:  # no generator: the global RNG
        return drafted, True
    residual = (p - q).clamp(min=0)
    return int(torch.multinomial(residual, 1)), False


def _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus):
    """The reference's verify_sampled with the rule at each place replaced by
    judge(p_i, q_i, drafted, i) -> (token, kept) and the bonus by bonus(p, q) -> token."""
    with torch.no_grad():
        held = cache.seq_len
        p = torch.softmax(score(target, cache, last_token, drafts), dim=-1)  # noqa: F821
        tokens = []
        for i, drafted in enumerate(drafts):
            token, kept = judge(p[i], draft_probs[i].float(), drafted, i)
            tokens.append(token)
            if not kept:
                break
        else:
            tokens.append(bonus(p[len(drafts)], draft_probs[-1] if drafts else None))
        cache.truncate(held + len(tokens))
    return tokens


@build_mutant("verify", "verify_sampled")
def bonus_from_the_global_rng(target, cache, last_token, drafts, draft_probs, generator):
    def judge(p, q, drafted, i):
        return accept_or_resample(p, q, drafted, generator)  # noqa: F821

    def bonus(p, q):
        return int(torch.multinomial(p, 1))  # no generator: the global RNG

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_mutant("verify", "verify_sampled")
def one_uniform_for_the_step(target, cache, last_token, drafts, draft_probs, generator):
    u = torch.rand((), generator=generator)  # drawn once, read at every place

    def judge(p, q, drafted, i):
        if u * q[drafted] < p[drafted]:
            return drafted, True
        residual = (p - q).clamp(min=0)
        return int(torch.multinomial(residual, 1, generator=generator)), False

    def bonus(p, q):
        return int(torch.multinomial(p, 1, generator=generator))

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_mutant("verify", "verify_sampled")
def residual_drawn_from_p(target, cache, last_token, drafts, draft_probs, generator):
    # The rule written inline, a rejection drawing its token from p itself.
    def judge(p, q, drafted, i):
        if torch.rand((), generator=generator) * q[drafted] < p[drafted]:
            return drafted, True
        return int(torch.multinomial(p, 1, generator=generator)), False

    def bonus(p, q):
        return int(torch.multinomial(p, 1, generator=generator))

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_mutant("verify", "verify_sampled")
def sampled_step_judged_greedily(target, cache, last_token, drafts, draft_probs, generator):
    # A draft kept when it is p's argmax, the argmax taken in place of one that is not;
    # only the bonus sampled.
    def judge(p, q, drafted, i):
        best = int(p.argmax())
        return best, best == drafted

    def bonus(p, q):
        return int(torch.multinomial(p, 1, generator=generator))

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_mutant("verify", "verify_sampled")
def bonus_from_the_draft_distribution(target, cache, last_token, drafts, draft_probs, generator):
    def judge(p, q, drafted, i):
        return accept_or_resample(p, q, drafted, generator)  # noqa: F821

    def bonus(p, q):  # q: the last draft's distribution, not the target's after it
        return int(torch.multinomial(p if q is None else q.float(), 1, generator=generator))

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_mutant("verify", "verify_sampled")
def global_rng_seeded_from_the_generator(target, cache, last_token, drafts, draft_probs, generator):
    # Reproducible under one seed, but it draws from (and reseeds) the global RNG.
    torch.manual_seed(int(torch.randint(2**31, (), generator=generator)))

    def judge(p, q, drafted, i):
        if torch.rand(()) * q[drafted] < p[drafted]:
            return drafted, True
        residual = (p - q).clamp(min=0)
        return int(torch.multinomial(residual, 1)), False

    def bonus(p, q):
        return int(torch.multinomial(p, 1))

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_mutant("verify", "verify_sampled")
def rejected_place_keeps_its_draft_distribution(
    target, cache, last_token, drafts, draft_probs, generator
):
    # On a rejection, the token is drawn from max(0, q - p): what the drafter over-offers.
    def judge(p, q, drafted, i):
        if torch.rand((), generator=generator) * q[drafted] < p[drafted]:
            return drafted, True
        residual = (q - p).clamp(min=0)
        return int(torch.multinomial(residual, 1, generator=generator)), False

    def bonus(p, q):
        return int(torch.multinomial(p, 1, generator=generator))

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_alternative("verify", "verify_sampled")
def every_uniform_drawn_at_once(target, cache, last_token, drafts, draft_probs, generator):
    # One uniform per draft, all drawn together before any is read: right.
    uniforms = torch.rand(len(drafts), generator=generator)

    def judge(p, q, drafted, i):
        if uniforms[i] * q[drafted] < p[drafted]:
            return drafted, True
        residual = (p - q).clamp(min=0)
        return int(torch.multinomial(residual, 1, generator=generator)), False

    def bonus(p, q):
        return int(torch.multinomial(p, 1, generator=generator))

    return _sampled_step(target, cache, last_token, drafts, draft_probs, generator, judge, bonus)


@build_alternative("verify", "accept_or_resample")
def uniform_drawn_only_when_needed(p, q, drafted, generator):
    # p >= q keeps the draft for sure: no draw then; the residual by inverse CDF.
    ratio = float(p[drafted]) / float(q[drafted]) if float(q[drafted]) > 0 else 1.0
    if ratio >= 1 or float(torch.rand(1, generator=generator, dtype=torch.float64)) < ratio:
        return drafted, True
    cdf = (p - q).clamp(min=0).double().cumsum(0)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp(max=len(p) - 1)), False


# -- build training_step: AdamW, train_step (chapter 00) -------------------------------------
# These run with the learner module's globals: learning_rate, clip_gradients, math, torch.


def _train_step(model, optimizer, batches, step, cfg, norm_of):
    """The reference's train_step, its returned norm norm_of(norm before clipping,
    max_norm, model)."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, cfg)  # noqa: F821
    total = 0.0
    for _ in range(cfg.grad_accum_steps):
        x, y = next(batches)
        loss = model(x, y).loss / cfg.grad_accum_steps
        loss.backward()
        total += loss.item()
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    norm = clip_gradients(model.parameters(), max_norm)  # noqa: F821
    returned = norm_of(norm, max_norm, model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, returned


@build_mutant("training_step", "train_step")
def norm_zero_when_not_clipped(model, optimizer, batches, step, cfg):
    return _train_step(
        model,
        optimizer,
        batches,
        step,
        cfg,
        lambda norm, max_norm, m: norm if cfg.grad_clip else 0.0,
    )


@build_mutant("training_step", "train_step")
def norm_measured_after_clipping(model, optimizer, batches, step, cfg):
    def after(norm, max_norm, m):
        grads = [p.grad for p in m.parameters() if p.grad is not None]
        return float(torch.stack([g.norm() for g in grads]).norm())

    return _train_step(model, optimizer, batches, step, cfg, after)


@build_mutant("training_step", "train_step")
def norm_capped_at_the_threshold(model, optimizer, batches, step, cfg):
    return _train_step(
        model, optimizer, batches, step, cfg, lambda norm, max_norm, m: min(norm, max_norm)
    )


@build_mutant("training_step", "train_step")
def norm_per_micro_batch(model, optimizer, batches, step, cfg):
    return _train_step(
        model, optimizer, batches, step, cfg,
        lambda norm, max_norm, m: norm / cfg.grad_accum_steps,
    )  # fmt: skip


@build_mutant("training_step", "train_step")
def gradients_cleared_first(model, optimizer, batches, step, cfg):
    # Cleared at the start of the step instead of after it: the same updates, and the
    # gradients left set on return.
    optimizer.zero_grad(set_to_none=True)
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, cfg)  # noqa: F821
    total = 0.0
    for _ in range(cfg.grad_accum_steps):
        x, y = next(batches)
        loss = model(x, y).loss / cfg.grad_accum_steps
        loss.backward()
        total += loss.item()
    norm = clip_gradients(model.parameters(), cfg.grad_clip or math.inf)  # noqa: F821
    optimizer.step()
    return total, norm


@build_mutant("training_step", "clip_gradients")
def clip_iterates_the_parameters_twice(parameters, max_norm):
    # Right for a list; a generator (model.parameters()) is empty the second time round.
    norm = torch.stack([p.grad.norm() for p in parameters if p.grad is not None]).norm().item()
    if max_norm / (norm + 1e-6) < 1.0:
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(max_norm / (norm + 1e-6))
    return norm


@build_mutant("training_step", "parameter_groups")
def frozen_parameters_grouped(model, weight_decay):
    params = list(model.parameters())  # those that do not require a gradient too
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


class _AdamReading(reference_training_step.AdamW):
    """The reference's AdamW with each group's settings read through `setting`."""

    def setting(self, group, name):
        return group[name]

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr = group["lr"]
            beta1, beta2 = self.setting(group, "betas")
            eps = self.setting(group, "eps")
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                state["t"] += 1
                t, m, v, grad = state["t"], state["m"], state["v"], p.grad
                p.mul_(1 - lr * group["weight_decay"])
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                p.sub_(lr * (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps))


@build_mutant("training_step", "AdamW", name="betas_from_the_constructor")
class BetasFromTheConstructor(_AdamReading):
    def setting(self, group, name):
        return self.defaults[name] if name == "betas" else group[name]


@build_mutant("training_step", "AdamW", name="eps_from_the_constructor")
class EpsFromTheConstructor(_AdamReading):
    def setting(self, group, name):
        return self.defaults[name] if name == "eps" else group[name]


@build_mutant("training_step", "AdamW", name="settings_kept_from_the_constructor")
class SettingsKeptFromTheConstructor(_AdamReading):
    # betas and eps copied onto the optimizer when it is built, as plain attributes.
    def __init__(self, params, lr, betas, eps=1e-8, weight_decay=0.0):
        super().__init__(params, lr, betas, eps, weight_decay)
        self.betas, self.eps = betas, eps

    def setting(self, group, name):
        return getattr(self, name)


@build_alternative("training_step", "AdamW", name="adam_reading_every_group_setting")
class AdamReadingEveryGroupSetting(_AdamReading):
    pass


# -- build model: CausalSelfAttention, MLP, Block, GPT (chapter 00) --------------------------
# The contract: the model runs without dropout (config.dropout is 0 here), in train mode too.


@build_mutant("model", "Block", name="dropout_hard_coded_on")
class DropoutHardCodedOn(reference_model.Block):
    def __init__(self, config):
        super().__init__(config)
        self.dropout = nn.Dropout(0.1)  # nanoGPT's value, whatever the config says

    def forward(self, x):
        x = x + self.dropout(self.attn(self.ln_1(x)))
        return x + self.dropout(self.mlp(self.ln_2(x)))


@build_mutant("model", "CausalSelfAttention", name="attention_weights_dropped")
class AttentionWeightsDropped(reference_model.CausalSelfAttention):
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
class EmbeddingsDropped(reference_model.GPT):
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
class DropoutDefaultedWhenZero(reference_model.MLP):
    def __init__(self, config):
        super().__init__(config)
        self.dropout = nn.Dropout(config.dropout or 0.1)

    def forward(self, x):
        return self.dropout(super().forward(x))


@build_alternative("model", "Block", name="dropout_read_from_the_config")
class DropoutReadFromTheConfig(reference_model.Block):
    # Dropout as rose's model has it, at config.dropout (0 here): right.
    def __init__(self, config):
        super().__init__(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = x + self.dropout(self.attn(self.ln_1(x)))
        return x + self.dropout(self.mlp(self.ln_2(x)))


# -- build block_manager: BlockManager (chapters 11-13) ---------------------------------------

_chain_hash = reference_block_manager.chain_hash


@build_mutant("block_manager", "BlockManager", name="cache_version_never_changes")
class CacheVersionNeverChanges(reference_block_manager.BlockManager):
    # the mistake: keys enter and leave `cached`, and cache_version stays 0 (the scheduler
    # keeps serving a waiting request its first lookup's blocks)
    cache_version = property(lambda self: 0, lambda self, value: None)


@build_mutant("block_manager", "BlockManager", name="lookup_skips_a_missing_block")
class LookupSkipsAMissingBlock(reference_block_manager.BlockManager):
    def cached_prefix(self, token_ids):
        found, parent, size = [], b"", self.kv_block_size
        for i in range(self.lookup_blocks(len(token_ids))):
            tokens = tuple(token_ids[i * size : (i + 1) * size])
            parent = _chain_hash(parent, tokens)
            block_id = self.cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                continue  # on to the next block: the table no longer lines up with the text
            found.append(block_id)
        return found


class _AdvanceOf(reference_block_manager.BlockManager):
    """The reference's advance, the blocks keyed up to keyed_end(seq) tokens, each keyed by
    tokens_of(seq, i)."""

    def keyed_end(self, seq):
        return seq.num_computed_tokens

    def tokens_of(self, seq, i):
        return tuple(seq.all_ids[i * self.kv_block_size : (i + 1) * self.kv_block_size])

    def keying(self):
        return self.enable_prefix_caching

    def advance(self, seq, num_new):
        seq.num_computed_tokens += num_new
        if not self.keying():
            return
        while len(seq.block_hashes) < self.keyed_end(seq) // self.kv_block_size:
            i = len(seq.block_hashes)
            tokens = self.tokens_of(seq, i)
            key = _chain_hash(seq.block_hashes[-1] if seq.block_hashes else b"", tokens)
            seq.block_hashes.append(key)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and key not in self.cached:
                block.hash, block.token_ids = key, tokens
                self.cached[key] = block.block_id
                self.cache_version += 1


@build_mutant("block_manager", "BlockManager", name="generated_blocks_never_cached")
class GeneratedBlocksNeverCached(_AdvanceOf):
    def keyed_end(self, seq):
        return min(seq.num_computed_tokens, len(seq.prompt_ids))


@build_mutant("block_manager", "BlockManager", name="blocks_keyed_from_the_prompt_alone")
class BlocksKeyedFromThePromptAlone(_AdvanceOf):
    def tokens_of(self, seq, i):
        return tuple(seq.prompt_ids[i * self.kv_block_size : (i + 1) * self.kv_block_size])


@build_mutant("block_manager", "BlockManager", name="blocks_keyed_with_prefix_caching_off")
class BlocksKeyedWithPrefixCachingOff(_AdvanceOf):
    def keying(self):
        return True  # lookup_blocks still finds nothing without prefix caching


@build_mutant("block_manager", "BlockManager", name="evicted_keys_left_in_the_map")
class EvictedKeysLeftInTheMap(reference_block_manager.BlockManager):
    def grow(self, seq, num_tokens):
        while len(seq.block_table) * self.kv_block_size < num_tokens:
            if self.free_ids:
                block_id = self.free_ids.pop()
            else:
                block_id, _ = self.evictable.popitem(last=False)
                block = self.blocks[block_id]
                block.hash, block.token_ids = None, ()  # its key left in self.cached
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)


@build_mutant("block_manager", "BlockManager", name="queries_counted_by_the_tokens_to_hold")
class QueriesCountedByTheTokensToHold(reference_block_manager.BlockManager):
    def start(self, seq, cached_ids, num_tokens):
        queries = self.prefix_cache_queries + self.lookup_blocks(num_tokens)
        super().start(seq, cached_ids, num_tokens)
        self.prefix_cache_queries = queries  # by the tokens this start holds, not the text's


@build_mutant("block_manager", "BlockManager", name="hits_counted_at_lookup")
class HitsCountedAtLookup(reference_block_manager.BlockManager):
    def cached_prefix(self, token_ids):
        found = super().cached_prefix(token_ids)
        self.prefix_cache_hits += len(found)  # a lookup that starts nothing counted too
        return found

    def start(self, seq, cached_ids, num_tokens):
        hits = self.prefix_cache_hits
        super().start(seq, cached_ids, num_tokens)
        self.prefix_cache_hits = hits


@build_mutant("block_manager", "BlockManager", name="unkeyed_blocks_kept_evictable")
class UnkeyedBlocksKeptEvictable(reference_block_manager.BlockManager):
    def release(self, seq):
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:  # every block kept for later, keyed or not
                self.evictable[block_id] = None
        seq.block_table, seq.block_hashes, seq.num_computed_tokens = [], [], 0


@build_mutant("block_manager", "BlockManager", name="num_used_sums_ref_counts")
class NumUsedSumsRefCounts(reference_block_manager.BlockManager):
    @property
    def num_used(self):
        return sum(block.ref_count for block in self.blocks)  # a shared block counted twice


# == The builds: wrong answers first written as edits of the reference's text ==============
#
# Each is the reference solution (rosecourse/solutions/build_NAME.py) with the method or
# function named in its decorator written wrong: "# the mistake" marks the line. A mutant
# that replaces two pieces is registered twice under one name.


# -- build model: CausalSelfAttention, MLP, Block, GPT -----------------------------------


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


# -- build training_step: AdamW, parameter_groups, learning_rate, clip_gradients, train_step


@build_mutant("training_step", "AdamW.step")
@torch.no_grad()
def adam_with_l2(self) -> None:
    for group in self.param_groups:
        lr, (beta1, beta2) = group["lr"], group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
            state["t"] += 1
            # the mistake: was `t, m, v, grad = state["t"], state["m"], state["v"], p.grad`
            t, m, v, grad = state["t"], state["m"], state["v"], p.grad + group["weight_decay"] * p
            # the mistake: `p.mul_(1 - lr * group["weight_decay"])` left out
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            m_hat = m / (1 - beta1**t)
            v_hat = v / (1 - beta2**t)
            p.sub_(lr * m_hat / (v_hat.sqrt() + group["eps"]))


@build_mutant("training_step", "AdamW.step")
@torch.no_grad()
def no_bias_correction(self) -> None:
    for group in self.param_groups:
        lr, (beta1, beta2) = group["lr"], group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
            state["t"] += 1
            m, v, grad = state["m"], state["v"], p.grad
            p.mul_(1 - lr * group["weight_decay"])
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            # the mistake: was `m_hat = m / (1 - beta1**t)`, t = state["t"]
            m_hat = m
            # the mistake: was `v_hat = v / (1 - beta2**t)`
            v_hat = v
            p.sub_(lr * m_hat / (v_hat.sqrt() + group["eps"]))


@build_mutant("training_step", "AdamW.step")
@torch.no_grad()
def eps_inside_the_root(self) -> None:
    for group in self.param_groups:
        lr, (beta1, beta2) = group["lr"], group["betas"]
        for p in group["params"]:
            if p.grad is None:
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
            # the mistake: was `p.sub_(lr * m_hat / (v_hat.sqrt() + group["eps"]))`
            p.sub_(lr * m_hat / (v_hat + group["eps"]).sqrt())


@build_mutant("training_step", "AdamW.step")
@torch.no_grad()
def decay_before_the_rate_is_known(self) -> None:
    for group in self.param_groups:
        lr, (beta1, beta2) = group["lr"], group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
            state["t"] += 1
            t, m, v, grad = state["t"], state["m"], state["v"], p.grad
            # the mistake: was `p.mul_(1 - lr * group["weight_decay"])`
            p.mul_(1 - group["weight_decay"])
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            m_hat = m / (1 - beta1**t)
            v_hat = v / (1 - beta2**t)
            p.sub_(lr * m_hat / (v_hat.sqrt() + group["eps"]))


@build_mutant("training_step", "parameter_groups")
def everything_decays(model: nn.Module, weight_decay: float) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    # the mistake: was `decay = [p for p in params if p.dim() >= 2]`
    decay = params
    # the mistake: was `no_decay = [p for p in params if p.dim() < 2]`
    no_decay = []
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


@build_mutant("training_step", "train_step")
def gradients_never_cleared(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    step: int,
    cfg: TrainConfig,
) -> tuple[float, float]:
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, cfg)
    total = 0.0
    for _ in range(cfg.grad_accum_steps):
        x, y = next(batches)
        loss = model(x, y).loss / cfg.grad_accum_steps
        loss.backward()
        total += loss.item()
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    norm = clip_gradients(model.parameters(), max_norm)
    optimizer.step()
    # the mistake: `optimizer.zero_grad(set_to_none=True)` left out
    return total, norm


@build_mutant("training_step", "train_step")
def rate_never_set(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    step: int,
    cfg: TrainConfig,
) -> tuple[float, float]:
    # the mistake: `for group in optimizer.param_groups: group["lr"] = learning_rate(step,
    # cfg)` left out
    total = 0.0
    for _ in range(cfg.grad_accum_steps):
        x, y = next(batches)
        loss = model(x, y).loss / cfg.grad_accum_steps
        loss.backward()
        total += loss.item()
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    norm = clip_gradients(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, norm


@build_mutant("training_step", "learning_rate")
def cosine_to_zero(step: int, cfg: TrainConfig) -> float:
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    if step >= decay_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / (decay_steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    # the mistake: was `return cfg.min_lr + cosine * (cfg.learning_rate - cfg.min_lr)`
    return cosine * cfg.learning_rate


@build_mutant("training_step", "learning_rate")
def no_floor(step: int, cfg: TrainConfig) -> float:
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    # the mistake: `if step >= decay_steps: return cfg.min_lr` left out
    progress = (step - cfg.warmup_steps) / (decay_steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + cosine * (cfg.learning_rate - cfg.min_lr)


@build_mutant("training_step", "learning_rate")
def progress_from_step_0(step: int, cfg: TrainConfig) -> float:
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    if step >= decay_steps:
        return cfg.min_lr
    # the mistake: was `progress = (step - cfg.warmup_steps) / (decay_steps - cfg.warmup_steps)`
    progress = step / decay_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + cosine * (cfg.learning_rate - cfg.min_lr)


@build_mutant("training_step", "train_step")
def a_micro_batch_short(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    step: int,
    cfg: TrainConfig,
) -> tuple[float, float]:
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, cfg)
    total = 0.0
    # the mistake: was `for _ in range(cfg.grad_accum_steps):`
    for _ in range(cfg.grad_accum_steps - 1):
        x, y = next(batches)
        loss = model(x, y).loss / cfg.grad_accum_steps
        loss.backward()
        total += loss.item()
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    norm = clip_gradients(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, norm


@build_mutant("training_step", "clip_gradients")
def always_scaled(parameters: Iterable[nn.Parameter], max_norm: float) -> float:
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.stack([g.norm() for g in grads]).norm().item()  # the norm of the norms
    scale = max_norm / (norm + 1e-6)
    # the mistake: was `if scale < 1.0: for g in grads: g.mul_(scale)`
    for g in grads:
        g.mul_(scale)
    return norm


@build_mutant("training_step", "make_optimizer")
def betas_swapped(model: nn.Module, cfg: TrainConfig) -> AdamW:
    groups = parameter_groups(model, cfg.weight_decay)
    # the mistake: was `return AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2))`
    return AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta2, cfg.beta1))


@build_mutant("training_step", "train_step")
def last_micro_batch_loss(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    step: int,
    cfg: TrainConfig,
) -> tuple[float, float]:
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, cfg)
    total = 0.0
    for _ in range(cfg.grad_accum_steps):
        x, y = next(batches)
        loss = model(x, y).loss / cfg.grad_accum_steps
        loss.backward()
        # the mistake: was `total += loss.item()`
        total = loss.item()
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    norm = clip_gradients(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, norm


# -- build cached_loop: StaticLayer, StaticCache, generate_cached ------------------------


@build_mutant("cached_loop", "StaticLayer.update")
def written_out_of_place(
    self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # the mistake: was `self.k[:, :, input_pos] = k`
    self.k = self.k.index_copy(2, input_pos, k)
    # the mistake: was `self.v[:, :, input_pos] = v`
    self.v = self.v.index_copy(2, input_pos, v)
    return self.k, self.v


@build_mutant("cached_loop", "StaticCache.prepare", name="query_blind_to_itself")
def query_blind_to_itself_in_the_cache(
    self, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
    self.filled += q_len
    slots = torch.arange(self.max_len, device=device)
    # The rows input_pos of the full causal mask: the bottom q_len of filled rows.
    # the mistake: was `causal = slots[None, :] <= self.input_pos[:, None]`
    causal = slots[None, :] < self.input_pos[:, None]
    mask = causal[None, None, :, :] & self.real[:, None, None, :]
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)
    return pos, mask


@build_mutant("cached_loop", "StaticCache.prepare")
def filled_never_advances(
    self, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
    # the mistake: `self.filled += q_len` left out
    slots = torch.arange(self.max_len, device=device)
    # The rows input_pos of the full causal mask: the bottom q_len of filled rows.
    causal = slots[None, :] <= self.input_pos[:, None]
    mask = causal[None, None, :, :] & self.real[:, None, None, :]
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)
    return pos, mask


@build_mutant("cached_loop", "StaticCache.__init__")
def padding_taken_from_the_right(
    self, model: GPT, batch_size: int, max_len: int, pad_lengths: list[int] | None = None
) -> None:
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
    # the mistake: was `self.real = slots[None, :] >= self.pads[:, None]`
    self.real = slots[None, :] < max_len - self.pads[:, None]


@build_mutant("cached_loop", "StaticCache.__init__")
def one_real_slot_masked(
    self, model: GPT, batch_size: int, max_len: int, pad_lengths: list[int] | None = None
) -> None:
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
    # the mistake: was `self.real = slots[None, :] >= self.pads[:, None]`
    self.real = slots[None, :] > self.pads[:, None]


@build_mutant("cached_loop", "StaticCache.prepare")
def keeps_every_mask(
    self, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
    self.filled += q_len
    slots = torch.arange(self.max_len, device=device)
    # The rows input_pos of the full causal mask: the bottom q_len of filled rows.
    causal = slots[None, :] <= self.input_pos[:, None]
    mask = causal[None, None, :, :] & self.real[:, None, None, :]
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    pos = (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0)
    # the mistake: was `return pos, mask`
    self.masks = [*getattr(self, "masks", []), mask]
    return pos, mask


@build_mutant("cached_loop", "generate_cached")
@torch.no_grad()
def argmax_over_rows(
    model: GPT, prompts: list[list[int]], max_new_tokens: int, prefill_chunk: int | None = None
) -> list[list[int]]:
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
        # the mistake: was `next_ids = logits.argmax(dim=-1)`
        next_ids = logits.argmax(dim=0)
        for row, token in zip(new_tokens, next_ids.tolist(), strict=True):
            row.append(token)
        if step + 1 < max_new_tokens:  # the last token is never fed back
            logits = model(next_ids[:, None], cache=cache).logits[:, -1]
    return new_tokens


@build_mutant("cached_loop", "generate_cached")
@torch.no_grad()
def last_chunk_skipped(
    model: GPT, prompts: list[list[int]], max_new_tokens: int, prefill_chunk: int | None = None
) -> list[list[int]]:
    longest = max(len(prompt) for prompt in prompts)
    pads = [longest - len(prompt) for prompt in prompts]
    rows = [[0] * pad + prompt for pad, prompt in zip(pads, prompts, strict=True)]
    ids = torch.tensor(rows, device=model.lm_head.weight.device)
    cache = StaticCache(model, len(prompts), longest + max_new_tokens, pads)
    chunk = prefill_chunk or longest
    # the mistake: was `for start in range(0, longest, chunk):`
    for start in range(0, longest - chunk, chunk):
        logits = model(ids[:, start : start + chunk], cache=cache).logits[:, -1]
    new_tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        next_ids = logits.argmax(dim=-1)
        for row, token in zip(new_tokens, next_ids.tolist(), strict=True):
            row.append(token)
        if step + 1 < max_new_tokens:  # the last token is never fed back
            logits = model(next_ids[:, None], cache=cache).logits[:, -1]
    return new_tokens


@build_mutant("cached_loop", "generate_cached")
@torch.no_grad()
def prefill_logits_of_the_first_token(
    model: GPT, prompts: list[list[int]], max_new_tokens: int, prefill_chunk: int | None = None
) -> list[list[int]]:
    longest = max(len(prompt) for prompt in prompts)
    pads = [longest - len(prompt) for prompt in prompts]
    rows = [[0] * pad + prompt for pad, prompt in zip(pads, prompts, strict=True)]
    ids = torch.tensor(rows, device=model.lm_head.weight.device)
    cache = StaticCache(model, len(prompts), longest + max_new_tokens, pads)
    chunk = prefill_chunk or longest
    for start in range(0, longest, chunk):
        # the mistake: was `logits = model(ids[:, start : start + chunk], cache=cache).logits[:, -1]
        # new_tokens: list[list[int]] = [[] for _ in prompts]`
        logits = model(ids[:, start : start + chunk], cache=cache).logits[:, 0]
    new_tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        next_ids = logits.argmax(dim=-1)
        for row, token in zip(new_tokens, next_ids.tolist(), strict=True):
            row.append(token)
        if step + 1 < max_new_tokens:  # the last token is never fed back
            logits = model(next_ids[:, None], cache=cache).logits[:, -1]
    return new_tokens


# -- build block_manager: chain_hash, BlockManager ---------------------------------------


@build_mutant("block_manager", "chain_hash")
def key_without_separator(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    # the mistake: was `data = parent + b"|" + ",".join(map(str, token_ids)).encode()`
    data = parent + b"|" + "".join(map(str, token_ids)).encode()
    return hashlib.sha256(data).digest()


@build_mutant("block_manager", "BlockManager.release")
def released_first_block_first(self, seq: EngineSequence) -> None:
    # the mistake: was `for block_id in reversed(seq.block_table):`
    for block_id in seq.block_table:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self.evictable[block_id] = None
            else:
                self.free_ids.append(block_id)
    seq.block_table = []
    seq.block_hashes = []
    seq.num_computed_tokens = 0


@build_mutant("block_manager", "BlockManager.can_grow")
def room_for_the_whole_sequence(self, seq: EngineSequence, num_tokens: int) -> bool:
    # the mistake: was `-(-num_tokens // self.kv_block_size)`: room for the whole sequence,
    # not for the chunk asked for (a prompt prefilled under a small budget is preempted
    # where it fits; only a budget below the prompt shows it)
    needed = -(-seq.num_tokens // self.kv_block_size) - len(seq.block_table)
    return needed <= self.num_free + len(self.evictable)


@build_mutant("block_manager", "BlockManager.can_start")
def blocks_rounded_down(self, cached_ids: list[int], num_tokens: int) -> bool:
    unheld = sum(1 for block_id in cached_ids if self.blocks[block_id].ref_count == 0)
    # the mistake: was `needed = -(-num_tokens // self.kv_block_size) - len(cached_ids)`
    needed = num_tokens // self.kv_block_size - len(cached_ids)
    return needed <= self.num_free + len(self.evictable) - unheld


@build_mutant("block_manager", "BlockManager.grow")
def grows_a_block_too_many(self, seq: EngineSequence, num_tokens: int) -> None:
    # the mistake: was `while len(seq.block_table) * self.kv_block_size < num_tokens:`
    while len(seq.block_table) * self.kv_block_size <= num_tokens:
        if self.free_ids:
            block_id = self.free_ids.pop()
        else:
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self.cached[block.hash]
            self.cache_version += 1
            block.hash, block.token_ids = None, ()
        self.blocks[block_id].ref_count = 1
        seq.block_table.append(block_id)


@build_mutant("block_manager", "BlockManager.start")
def hits_not_counted(self, seq: EngineSequence, cached_ids: list[int], num_tokens: int) -> None:
    self.prefix_cache_queries += self.lookup_blocks(len(seq.all_ids))
    # the mistake: `self.prefix_cache_hits += len(cached_ids)` left out
    for block_id in cached_ids:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.evictable[block_id]
        block.ref_count += 1
    seq.block_table = list(cached_ids)
    seq.block_hashes = [self.blocks[block_id].hash for block_id in cached_ids]
    seq.num_computed_tokens = len(cached_ids) * self.kv_block_size
    if not seq.output_ids:
        seq.num_cached_tokens = seq.num_computed_tokens
    self.grow(seq, num_tokens)


@build_mutant("block_manager", "BlockManager.start")
def served_count_reset_on_restart(
    self, seq: EngineSequence, cached_ids: list[int], num_tokens: int
) -> None:
    self.prefix_cache_queries += self.lookup_blocks(len(seq.all_ids))
    self.prefix_cache_hits += len(cached_ids)
    for block_id in cached_ids:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.evictable[block_id]
        block.ref_count += 1
    seq.block_table = list(cached_ids)
    seq.block_hashes = [self.blocks[block_id].hash for block_id in cached_ids]
    seq.num_computed_tokens = len(cached_ids) * self.kv_block_size
    # the mistake: was `if not seq.output_ids: seq.num_cached_tokens = seq.num_computed_tokens`
    if True:
        seq.num_cached_tokens = seq.num_computed_tokens
    self.grow(seq, num_tokens)


@build_mutant("block_manager", "BlockManager.advance")
def cached_key_moved_to_the_copy(self, seq: EngineSequence, num_new: int) -> None:
    seq.num_computed_tokens += num_new
    if not self.enable_prefix_caching:
        return
    size = self.kv_block_size
    while len(seq.block_hashes) < seq.num_computed_tokens // size:
        i = len(seq.block_hashes)
        tokens = tuple(seq.all_ids[i * size : (i + 1) * size])
        key = chain_hash(seq.block_hashes[-1] if seq.block_hashes else b"", tokens)
        seq.block_hashes.append(key)
        block = self.blocks[seq.block_table[i]]
        # the mistake: was `if block.hash is None and key not in self.cached:`
        if block.hash is None:
            block.hash, block.token_ids = key, tokens
            self.cached[key] = block.block_id
            self.cache_version += 1


# -- build verify: RollbackCache, verify_greedy, accept_or_resample, verify_sampled ------


@build_mutant("verify", "RollbackCache.prepare")
def top_left_mask(
    self, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    past, kv_len = self.seq_len, self.seq_len + q_len
    query_pos = torch.arange(past, kv_len, device=device)
    key_pos = torch.arange(kv_len, device=device)
    # the mistake: was `return query_pos[None, :], key_pos[None, :] <= query_pos[:, None]`
    return query_pos[None, :], key_pos[None, :] <= query_pos[:, None] - past


@build_mutant("verify", "RollbackCache.prepare", name="positions_one_late")
def rollback_positions_one_late(
    self, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    past, kv_len = self.seq_len, self.seq_len + q_len
    # the mistake: was `query_pos = torch.arange(past, kv_len, device=device)`
    query_pos = torch.arange(past + 1, kv_len + 1, device=device)
    key_pos = torch.arange(kv_len, device=device)
    return query_pos[None, :], key_pos[None, :] <= query_pos[:, None]


@build_mutant("verify", "RollbackCache.truncate")
def truncate_keeps_one_more(self, n: int) -> None:
    # the mistake: was `self.past = [(k[:, :, :n], v[:, :, :n]) for k, v in self.past]`
    self.past = [(k[:, :, : n + 1], v[:, :, : n + 1]) for k, v in self.past]


@build_mutant("verify", "verify_greedy")
@torch.no_grad()
def rollback_one_too_far(
    target: GPT, cache: DenseKVCache | RollbackCache, last_token: int, drafts: list[int]
) -> list[int]:
    held = cache.seq_len
    choices = score(target, cache, last_token, drafts).argmax(dim=-1).tolist()
    accepted = 0
    for drafted, chosen in zip(drafts, choices, strict=False):
        if drafted != chosen:
            break
        accepted += 1
    tokens = drafts[:accepted] + [choices[accepted]]
    # the mistake: was `cache.truncate(held + len(tokens)) return tokens`
    cache.truncate(held + len(tokens) - 1)
    return tokens


@build_mutant("verify", "verify_greedy")
@torch.no_grad()
def drafts_read_against_the_next_row(
    target: GPT, cache: DenseKVCache | RollbackCache, last_token: int, drafts: list[int]
) -> list[int]:
    held = cache.seq_len
    choices = score(target, cache, last_token, drafts).argmax(dim=-1).tolist()
    accepted = 0
    # the mistake: was `for drafted, chosen in zip(drafts, choices, strict=False):`
    for drafted, chosen in zip(drafts, choices[1:], strict=False):
        if drafted != chosen:
            break
        accepted += 1
    tokens = drafts[:accepted] + [choices[accepted]]
    cache.truncate(held + len(tokens))
    return tokens


@build_mutant("verify", "verify_greedy")
@torch.no_grad()
def scored_one_token_a_call(
    target: GPT, cache: DenseKVCache | RollbackCache, last_token: int, drafts: list[int]
) -> list[int]:
    held = cache.seq_len
    # the mistake: was `choices = score(target, cache, last_token, drafts).argmax(dim=-1).tolist()`
    choices = [int(score(target, cache, t, []).argmax()) for t in [last_token, *drafts]]
    accepted = 0
    for drafted, chosen in zip(drafts, choices, strict=False):
        if drafted != chosen:
            break
        accepted += 1
    tokens = drafts[:accepted] + [choices[accepted]]
    cache.truncate(held + len(tokens))
    return tokens


@build_mutant("verify", "accept_or_resample")
def ratio_inverted(
    p: torch.Tensor, q: torch.Tensor, drafted: int, generator: torch.Generator
) -> tuple[int, bool]:
    u = torch.rand((), generator=generator)
    # the mistake: was `if u * q[drafted] < p[drafted]: # u < p / q, without dividing by a zero q`
    if u * p[drafted] < q[drafted]:  # u < p / q, without dividing by a zero q
        return drafted, True
    residual = (p - q).clamp(min=0)
    token = torch.multinomial(residual / residual.sum(), 1, generator=generator)
    return int(token), False


@build_mutant("verify", "accept_or_resample")
def residual_reversed(
    p: torch.Tensor, q: torch.Tensor, drafted: int, generator: torch.Generator
) -> tuple[int, bool]:
    u = torch.rand((), generator=generator)
    if u * q[drafted] < p[drafted]:  # u < p / q, without dividing by a zero q
        return drafted, True
    # the mistake: was `residual = (p - q).clamp(min=0)`
    residual = (q - p).clamp(min=0)
    token = torch.multinomial(residual / residual.sum(), 1, generator=generator)
    return int(token), False


@build_mutant("verify", "verify_sampled")
@torch.no_grad()
def bonus_from_the_last_draft_row(
    target: GPT,
    cache: DenseKVCache | RollbackCache,
    last_token: int,
    drafts: list[int],
    draft_probs: torch.Tensor,
    generator: torch.Generator,
) -> list[int]:
    held = cache.seq_len
    p = torch.softmax(score(target, cache, last_token, drafts), dim=-1)
    tokens = []
    for i, drafted in enumerate(drafts):
        token, kept = accept_or_resample(p[i], draft_probs[i].float(), drafted, generator)
        tokens.append(token)
        if not kept:
            break
    else:  # every draft kept: the bonus token
        # the mistake: was `tokens.append(int(torch.multinomial(p[len(drafts)], 1,
        # generator=generator)))`
        tokens.append(int(torch.multinomial(p[len(drafts) - 1], 1, generator=generator)))
    cache.truncate(held + len(tokens))
    return tokens


@build_mutant("verify", "verify_sampled")
@torch.no_grad()
def sampled_step_never_rolls_back(
    target: GPT,
    cache: DenseKVCache | RollbackCache,
    last_token: int,
    drafts: list[int],
    draft_probs: torch.Tensor,
    generator: torch.Generator,
) -> list[int]:
    p = torch.softmax(score(target, cache, last_token, drafts), dim=-1)
    tokens = []
    for i, drafted in enumerate(drafts):
        token, kept = accept_or_resample(p[i], draft_probs[i].float(), drafted, generator)
        tokens.append(token)
        if not kept:
            break
    else:  # every draft kept: the bonus token
        tokens.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator)))
    # the mistake: `cache.truncate(held + len(tokens))` left out (held: the cache's seq_len
    # before the pass), so the rejected drafts' keys stay
    return tokens


@build_mutant("verify", "verify_sampled")
@torch.no_grad()
def sampled_rows_shifted(
    target: GPT,
    cache: DenseKVCache | RollbackCache,
    last_token: int,
    drafts: list[int],
    draft_probs: torch.Tensor,
    generator: torch.Generator,
) -> list[int]:
    held = cache.seq_len
    p = torch.softmax(score(target, cache, last_token, drafts), dim=-1)
    tokens = []
    for i, drafted in enumerate(drafts):
        # the mistake: was `token, kept = accept_or_resample(p[i], draft_probs[i].float(), drafted,
        # generator)`
        token, kept = accept_or_resample(p[i + 1], draft_probs[i].float(), drafted, generator)
        tokens.append(token)
        if not kept:
            break
    else:  # every draft kept: the bonus token
        tokens.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator)))
    cache.truncate(held + len(tokens))
    return tokens


# == Written blind ===========================================================================
#
# tests/blind_mutants.py holds wrong answers written blind, by someone who had not read these
# lists nor the exercises' and builds' known wrong answers (issue 45): each registered with
# `blind` or `blind_build` below, as a mutant like the ones above, or, where the check names
# it as one of the known mistakes (the blind writer found that one too), with `known=` that
# mistake, whose diagnosis it must then get (tests/course/test_mutants.py, tests/course/test_builds.py).


def blind_build(
    build: str, replaces: str, name: str | None = None, known: str | None = None
) -> Callable:
    """Register a build's wrong answer written blind, as `build_mutant` does (registered
    again under one name, it replaces that piece too), or as the known mistake `known`."""

    def register(obj: Callable) -> Callable:
        key = name or obj.__name__
        if known is None:
            names = BLIND.setdefault(build, [])
            taken = {named for named, _ in BUILD_MUTANTS.get(build, [])} - set(names)
            assert key not in taken, f"{build}: {key} is a mutant written with the lists read"
            build_mutant(build, replaces, key)(obj)
            names += [] if key in names else [key]
            return obj
        told = BLIND_KNOWN.setdefault(build, [])
        same = [replacements for named, replacements, _ in told if named == key]
        if same:
            same[0][replaces] = obj
        else:
            told.append((key, {replaces: obj}, known))
        return obj

    return register


import blind_mutants  # noqa: E402, F401  (registers them: kept apart, see its docstring)
