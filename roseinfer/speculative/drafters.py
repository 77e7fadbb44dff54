"""Drafters: where speculative decoding's proposals come from.

A `Drafter` proposes up to k next tokens of a request (`propose(seq, k)`), reading the
request's tokens so far, and forgets what it kept for a request once that request is
done (`release(seq)`). A drafter's proposals never change what the target outputs
(verification keeps only what the target agrees with); they only decide how many
tokens a verify step makes. Three kinds:

* `NgramDrafter` (prompt lookup): the request's last n tokens (n from max_n down to
  min_n) looked up earlier in its prompt and output; the tokens that followed the
  latest match with k tokens after it are the draft. No model at all: it shines where
  the output copies its input (editing, summarising, code).
* `ModelDrafter` with a separate, smaller model sharing the target's tokenizer: it
  keeps its own KV cache per request, synced to the request's tokens by their common
  prefix (what the target rejected is rolled back with `truncate`), then decodes k
  tokens greedily (or, for a sampled request, draws them and hands over their
  distributions for the accept rule). A request with structured output drafts within
  its grammar: the draft logits are masked by a fork of its matcher.
* `ModelDrafter` over `first_layers(target, n)`: self-drafting, the target's first n
  blocks through its own final LayerNorm and LM head (a view sharing its weights, no
  second model; LayerSkip's draft without the early-exit training).

`SpeculativeConfig` is what a user asks for (the CLI's and server's flags, `LLM`'s
`speculative=`); `load_drafter` checks it against the target and builds the drafter.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from roseinfer.cache.dense import ConcatKVCache
from roseinfer.loading import load_model_and_tokenizer
from roseinfer.request.sampling import sampling_probs
from roseinfer.request.sequence import Sequence
from roseinfer.request.structured import GrammarMatcher, allowed_tokens
from roseinfer.speculative.verify import Draft
from rosetrainer.errors import RoseError
from rosetrainer.model import GPT
from rosetrainer.tokenizer import Tokenizer

METHODS = ("draft", "ngram", "self")
# The engine's documented limit, as rose-generate and rose-serve tell it when speculative
# decoding is asked for and a request samples (see docs/speculative-decoding.md, Limits).
SAMPLED_NOT_DRAFTED = (
    "the engine drafts for greedy requests only (temperature 0); a sampled request "
    "decodes one token a step, as without speculative decoding"
)


class Drafter(Protocol):
    """What the speculative loop and the engine ask of a source of drafts."""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """For each request, up to its k tokens that might follow its tokens so far (fewer,
        or none, is allowed). The engine asks for every request of a step at once."""
        ...

    def release(self, seq: Sequence) -> None:
        """seq is done: forget whatever was kept for it."""
        ...


# ---------------------------------------------------------------------------
# Prompt lookup
# ---------------------------------------------------------------------------


def prompt_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The up to k tokens that followed an earlier occurrence of tokens' last n tokens,
    for the longest n in max_n .. min_n that occurs; [] when none does. The occurrence is
    the latest one with k tokens after it, else the one with the most (the earliest)."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        longest: list[int] = []
        # Latest first; a match must leave at least one token after it and may overlap the
        # tail. In text that repeats (a line, a run of newlines) the latest match overlaps
        # the tail and leaves a single token: an earlier one drafts all k.
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                longest = tokens[start + n : start + n + k]
                if len(longest) == k:
                    break
        if longest:
            return longest
    return []


class NgramDrafter:
    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise RoseError(f"n-gram bounds must satisfy 1 <= min <= max, got {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        return [
            Draft(prompt_lookup(seq.all_ids, k, self.min_n, self.max_n))
            for seq, k in zip(seqs, ks, strict=True)
        ]

    def release(self, seq: Sequence) -> None:
        """Nothing is kept per request."""


# ---------------------------------------------------------------------------
# A draft model (a smaller one, or the target's own first layers)
# ---------------------------------------------------------------------------


@dataclass
class DraftState:
    """One request's draft-model cache: it holds the keys of `ids`, which are the
    request's tokens from `start` on (then possibly drafts the target rejected)."""

    cache: ConcatKVCache = dataclasses.field(default_factory=ConcatKVCache)
    ids: list[int] = dataclasses.field(default_factory=list)
    start: int = 0


class ModelDrafter:
    def __init__(self, model: GPT) -> None:
        self.model = model.eval()
        self.caches: dict[Sequence, DraftState] = {}

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        steps = max(ks)
        if not self.model.config.unbounded:  # (k + 1 tokens must fit its context)
            steps = min(steps, self.model.config.block_size - 1)
        states = [self.caches.setdefault(seq, DraftState()) for seq in seqs]
        # A constrained request drafts within its grammar, on a fork of its matcher.
        grammars = [None if seq.matcher is None else seq.matcher.fork() for seq in seqs]
        views = [
            self._view(state, seq.all_ids, steps) for state, seq in zip(states, seqs, strict=True)
        ]
        # Each request's cache first reads the tokens it has not read yet (one call each:
        # how many differs), which gives the logits its first draft comes from ...
        logits = torch.stack(
            [self._catch_up(state, view) for state, view in zip(states, views, strict=True)]
        )
        # ... then every request drafts at once, one batched call per drafted token.
        batch = ConcatKVCache.stacked([state.cache for state in states])
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for step in range(steps):
            chosen = [
                choose_draft(logits[row], seq, probs[row], grammars[row])
                for row, seq in enumerate(seqs)
            ]
            for row, token in enumerate(chosen):
                tokens[row].append(token)
            if step < steps - 1:  # the last draft is never fed: nothing reads its logits
                logits = self._step(chosen, batch)
        for state, cache, view, drafted in zip(
            states, batch.unstacked(), views, tokens, strict=True
        ):
            state.cache, state.ids = cache, view + drafted[:-1]
        return [
            Draft(drafted[:k], torch.stack(qs[:k]) if qs else None)
            for drafted, qs, k in zip(tokens, probs, ks, strict=True)
        ]

    def _catch_up(self, state: DraftState, view: list[int]) -> torch.Tensor:
        """Roll the cache back to what it holds of the request's tokens (never the newest:
        its logits are what the first draft is read from), feed it the rest; those logits."""
        held = common_prefix(state.ids, view, len(view) - 1)
        state.cache.truncate(held)
        return self._step(view[held:], state.cache)[0]

    def release(self, seq: Sequence) -> None:
        self.caches.pop(seq, None)

    def _view(self, state: DraftState, tokens: list[int], k: int) -> list[int]:
        """The request's tokens the draft model reads: all of them, or, once they and k
        - 1 drafts would outgrow its context, the last half context (the cache restarts)."""
        context = self.model.config.block_size
        if not self.model.config.unbounded and len(tokens) - state.start + k - 1 > context:
            state.start = max(0, len(tokens) - (context - k + 1) // 2)
            state.ids, state.cache = [], ConcatKVCache()
        return tokens[state.start :]

    def _step(self, ids: list[int], cache: ConcatKVCache) -> torch.Tensor:
        """Feed ids: one row of tokens to a one-row cache, or one token per row to a
        stacked batch; the logits after each row's last token, (rows, vocab)."""
        device = self.model.lm_head.weight.device
        rows = 1 if cache.pad_lengths is None else len(ids)
        idx = torch.tensor(ids, device=device).view(rows, -1)
        return self.model(idx, cache=cache, last_only=True, validate=False).logits[:, -1]


def choose_draft(
    logits: torch.Tensor,
    seq: Sequence,
    probs: list[torch.Tensor],
    grammar: GrammarMatcher | None,
) -> int:
    """The request's draft from the draft model's logits: the argmax for a greedy
    request, else drawn from its sampling distribution q (kept in probs for the rule).

    grammar: a constrained request's matcher fork, where its drafts so far have taken
    it. The logits are masked by it first, so the draft model proposes only tokens
    the grammar allows (a draft model knows nothing of the grammar: unmasked, its
    drafts would mostly be cut before verification); the chosen token advances it.
    Once the grammar is complete, drafting goes on unmasked (those drafts are cut).
    """
    if grammar is not None and not grammar.is_finished:
        allowed = allowed_tokens([grammar], logits.size(-1))[0]
        logits = logits.masked_fill(~torch.from_numpy(allowed).to(logits.device), -torch.inf)
    if seq.params.greedy:
        token = int(logits.argmax())
    else:
        q = sampling_probs(logits, seq.params)
        probs.append(q)
        token = int(torch.multinomial(q, 1, generator=seq.generator))
    if grammar is not None and not grammar.is_finished:
        grammar.advance(token)
    return token


def common_prefix(a: list[int], b: list[int], most: int) -> int:
    """How many leading tokens a and b share, at most `most`."""
    n = 0
    while n < min(len(a), len(b), most) and a[n] == b[n]:
        n += 1
    return n


def is_first_layers(draft: GPT, target: GPT) -> bool:
    """Whether draft is a view of target's first blocks (`first_layers`): its keys for
    those layers are the target's."""
    blocks, theirs = draft.transformer.h, target.transformer.h
    return (
        draft.lm_head is target.lm_head
        and len(blocks) < len(theirs)
        and all(mine is its for mine, its in zip(blocks, theirs, strict=False))
    )


def first_layers(model: GPT, n: int) -> GPT:
    """A view of `model` with only its first n blocks, then its own final LayerNorm and LM
    head: every parameter shared, nothing copied (the self-draft)."""
    if not 1 <= n < model.config.n_layer:
        raise RoseError(
            f"a self-draft takes the target's first 1 .. {model.config.n_layer - 1} layers "
            f"(it has {model.config.n_layer}), got {n}"
        )
    view = copy.copy(model)
    view._modules = dict(model._modules)
    transformer = copy.copy(model.transformer)
    transformer._modules = dict(model.transformer._modules)
    transformer._modules["h"] = nn.ModuleList(list(model.transformer.h)[:n])
    view._modules["transformer"] = transformer
    view.config = dataclasses.replace(model.config, n_layer=n)
    return view


# ---------------------------------------------------------------------------
# What a user asks for, checked against the target
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: "draft" (a separate model at `model`: a rose checkpoint or a Hugging Face
    GPT-2 directory), "ngram" (prompt lookup over n-grams of ngram_min .. ngram_max
    tokens) or "self" (the target's first `self_layers` layers)."""

    num_speculative_tokens: int
    method: str = "ngram"
    model: str | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    self_layers: int = 1

    def __post_init__(self) -> None:
        check_speculative_tokens(self.num_speculative_tokens)
        if self.method not in METHODS:
            raise RoseError(
                f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}"
            )
        if (self.method == "draft") != (self.model is not None):
            raise RoseError("a draft model's path goes with method 'draft' (and only with it)")
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise RoseError(f"a draft model's path is a string, got {self.model!r}")
        for name in ("ngram_min", "ngram_max", "self_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RoseError(f"speculative {name} must be an integer >= 1, got {value!r}")

    @staticmethod
    def fields_of(method: str) -> set[str]:
        """The fields a method reads (the others keep their defaults)."""
        own = {"draft": {"model"}, "ngram": {"ngram_min", "ngram_max"}, "self": {"self_layers"}}
        return {"num_speculative_tokens", "method"} | own.get(method, set())

    @classmethod
    def from_flags(
        cls, model: str | None, method: str | None, k: int | None, ngram_min: int, ngram_max: int
    ) -> SpeculativeConfig | None:
        """--speculative-model PATH | --speculative-method ngram|self:N, with
        --num-speculative-tokens K (None when no speculative flag is given)."""
        if model is None and method is None:
            if k is not None:
                raise RoseError(
                    "--num-speculative-tokens needs --speculative-model or --speculative-method"
                )
            return None
        if model is not None and method is not None:
            raise RoseError("give --speculative-model or --speculative-method, not both")
        if k is None:
            raise RoseError("speculative decoding needs --num-speculative-tokens K (e.g. 4)")
        if model is not None:
            return cls(k, "draft", model=model)
        if method == "ngram":
            return cls(k, "ngram", ngram_min=ngram_min, ngram_max=ngram_max)
        name, _, layers = method.partition(":")
        # (ASCII digits: str.isdigit also takes "²", which int() does not read)
        if name != "self" or not (layers.isascii() and layers.isdigit()):
            raise RoseError(
                f"--speculative-method is ngram or self:N (the target's first N layers), got {method!r}"
            )
        return cls(k, "self", self_layers=int(layers))

    def describe(self) -> str:
        what = {
            "draft": f"draft model {self.model}",
            "ngram": f"prompt lookup, n-grams of {self.ngram_min}..{self.ngram_max} tokens",
            "self": f"self-draft from the target's first {self.self_layers} layer(s)",
        }[self.method]
        return f"{what}, {self.num_speculative_tokens} tokens a step"


def load_drafter(
    config: SpeculativeConfig,
    target: GPT,
    tokenizer: Tokenizer,
    draft_model: GPT | None = None,
    draft_tokenizer: Tokenizer | None = None,
) -> Drafter:
    """The drafter `config` asks for, checked against the target: k leaves room in the
    context, a draft model reads and writes the target's vocabulary. draft_model (with
    its tokenizer): one already in memory instead of loading config.model."""
    k = config.num_speculative_tokens
    check_speculative_tokens(k, target, "the target's")
    if config.method == "ngram":
        return NgramDrafter(config.ngram_min, config.ngram_max)
    if config.method == "self":
        return ModelDrafter(first_layers(target, config.self_layers))
    if draft_model is None:
        draft_model, draft_tokenizer = load_draft_model(config.model, target)
    check_draft(draft_model, draft_tokenizer or tokenizer, target, tokenizer, k)
    return ModelDrafter(draft_model)


def load_draft_model(path: str, target: GPT) -> tuple[GPT, Tokenizer]:
    """A draft model from a rose checkpoint or a Hugging Face GPT-2 directory, on the
    target's device and in its dtype."""
    where = Path(path)
    if not where.exists():
        raise RoseError(
            f"draft model not found: {path} (a rose .pt, run directory or HF directory)"
        )
    weight = target.lm_head.weight
    hf = (where / "config.json").is_file()
    try:
        model, tokenizer, _ = load_model_and_tokenizer(
            None if hf else path, path if hf else None, None, weight.device, weight.dtype
        )
    except RoseError as error:  # (a corrupt file, a vocabulary its tokenizer does not fit)
        raise RoseError(f"draft model {path}: {error}") from None
    return model, tokenizer


def check_draft(
    draft: GPT, draft_tokenizer: Tokenizer, target: GPT, tokenizer: Tokenizer, k: int
) -> None:
    """The draft speaks the target's tokens: one tokenizer, one vocabulary; k fits its context."""
    if draft_tokenizer.name != tokenizer.name:
        raise RoseError(
            f"the draft model uses tokenizer {draft_tokenizer.name!r} but the target uses "
            f"{tokenizer.name!r}: a draft must share the target's tokenizer"
        )
    if draft.config.vocab_size != target.config.vocab_size:
        raise RoseError(
            f"the draft model's vocabulary has {draft.config.vocab_size} tokens but the "
            f"target's has {target.config.vocab_size}: a draft must share the target's vocabulary"
        )
    check_speculative_tokens(k, draft, "the draft model's")


def check_speculative_tokens(k: int, model: GPT | None = None, whose: str = "the") -> None:
    """k is a whole number >= 1, and a verify chunk of k + 1 tokens fits model's context."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise RoseError(f"the number of speculative tokens must be an integer >= 1, got {k!r}")
    if model is not None and not model.config.unbounded and k >= model.config.block_size:
        raise RoseError(
            f"{k} speculative tokens do not fit {whose} context of {model.config.block_size} "
            f"tokens: use at most {model.config.block_size - 1}"
        )
