"""Exercises on the model and its deployments: chapters 00, 01, 10, 15, 16, 17.

The same form as rosecourse/exercises.py (chapters 02 to 09): the learner's function
is swapped in for the real piece, the real code runs on the chapters' random
strong-oracle model, and the first step that parts from the reference is reported,
with the mistake named when the function behaves like a known wrong answer.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from types import SimpleNamespace
from unittest import mock

import torch

import roseinfer.cache.quantized
import rosetrainer.model
from rosecourse.demo import NEW_TOKENS, PROMPT
from rosecourse.exercises import (
    BATCH_TEXTS,
    CheckResult,
    Exercise,
    KnownWrong,
    check,
    encoded,
    oracle_model,
    outcome,
    reference_tokens,
)
from roseinfer.cache.dense import ConcatKVCache
from roseinfer.cache.quantized import Quantized, dequantize, make_kv_cache, quantize
from roseinfer.loops.export_onnx import DecoderWithPast, ExportCache, example_inputs
from roseinfer.loops.generate import generate
from roseinfer.pipeline.stage import PipelineStage, cache_slot
from roseinfer.request.sampling import SamplingParams
from rosetrainer.config import GPTConfig
from rosetrainer.model import GPT

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


def random_qkv(seed: int, shape: tuple[int, ...] = (1, 2, 5, 8)) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for _ in range(3)]


_held: list[Callable] = []


def hold(fn: Callable) -> contextlib.AbstractContextManager:
    """For a piece the check calls itself (a whole loop, a formula): nothing to patch, the
    run calls `held_function()`."""
    _held[:] = [fn]
    return contextlib.nullcontext()


def held_function() -> Callable:
    return _held[0]


def uncached_greedy_run() -> list[tuple[str, Callable, Callable]]:
    """The chapter prompt, greedy and uncached: every step a full causal pass."""
    prompt = encoded(PROMPT)

    def go(on_token: Callable[[int, int], None]) -> list[list[int]]:
        run = generate(oracle_model(), list(prompt), GREEDY, use_cache=False, on_token=on_token)
        return [run.token_ids]

    return [("uncached greedy", lambda: [reference_tokens(prompt, NEW_TOKENS)], go)]


# -- 00: causal self-attention ----------------------------------------------------------------

_real_sdpa = torch.nn.functional.scaled_dot_product_attention


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The reference: what the model's SDPA call computes without a cache."""
    return _real_sdpa(q, k, v, is_causal=True)


def _swap_causal_attention(fn: Callable) -> contextlib.AbstractContextManager:
    """The model's attention calls without a mask (causal, no past) go to `fn`; the rest
    (cached calls, with an explicit mask) stay with PyTorch's."""

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        if is_causal and attn_mask is None and dropout_p == 0.0 and not kwargs:
            return fn(q, k, v)
        return _real_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)

    functional = SimpleNamespace(**vars(torch.nn.functional))
    functional.scaled_dot_product_attention = sdpa
    return mock.patch.object(rosetrainer.model, "F", functional)


def _attention_probe(fn: Callable) -> list[object]:
    return [outcome(lambda s=s: fn(*random_qkv(s))) for s in (0, 1)]


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    return (q @ k.transpose(-2, -1)) * scale


def _future_visible(q, k, v):
    return torch.softmax(_scores(q, k, q.size(-1) ** -0.5), dim=-1) @ v


def _unscaled(q, k, v):
    t = q.size(-2)
    scores = _scores(q, k, 1.0).masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -torch.inf)
    return torch.softmax(scores, dim=-1) @ v


def _softmax_over_queries(q, k, v):
    t = q.size(-2)
    scores = _scores(q, k, q.size(-1) ** -0.5)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -torch.inf)
    return torch.softmax(scores, dim=-2).nan_to_num() @ v


def _mask_upper(q, k, v):
    t = q.size(-2)
    scores = _scores(q, k, q.size(-1) ** -0.5)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).triu(), -torch.inf)
    return torch.softmax(scores, dim=-1) @ v


CAUSAL_ATTENTION = Exercise(
    name="causal_attention",
    reference=causal_attention,
    probe=_attention_probe,
    swapped_in=_swap_causal_attention,
    runs=uncached_greedy_run(),
    known_wrong=[
        KnownWrong(
            "future_visible",
            _future_visible,
            "no causal mask: every position reads the tokens after it, so training would "
            "learn to copy the answer; the last position cannot tell, but from layer 2 on "
            "every earlier position it reads has seen the future",
        ),
        KnownWrong(
            "unscaled",
            _unscaled,
            "the scores are not divided by sqrt(head_dim): the softmax is sharper than the "
            "model was built for",
        ),
        KnownWrong(
            "softmax_over_queries",
            _softmax_over_queries,
            "the softmax runs over the queries (dim -2): each query's weights over its keys "
            "must sum to 1, so normalise along the keys (dim -1)",
        ),
        KnownWrong(
            "mask_upper",
            _mask_upper,
            "your mask is the upper triangle: each position reads itself and the future, "
            "never the past",
        ),
    ],
    fallback="some position's output is not the softmax-weighted sum of the values it may see",
)


def check_causal_attention(fn: Callable) -> CheckResult:
    """Chapter 00: `causal_attention(q, k, v) -> y`, (B, heads, T, head_dim) each."""
    return check(CAUSAL_ATTENTION, fn)


# -- 01: the uncached greedy loop -------------------------------------------------------------


def greedy_decode(model: GPT, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The reference: the teaching loop, uncached."""
    params = SamplingParams(max_tokens=max_new_tokens, ignore_eos=True)
    return generate(model, prompt_ids, params, use_cache=False).token_ids


def _greedy_probe(fn: Callable) -> list[object]:
    model = oracle_model()
    return [outcome(lambda p=p: fn(model, list(p), 3)) for p in ((464, 3290, 318), (50,))]


def _greedy_runs() -> list[tuple[str, Callable, Callable]]:
    prompt = encoded(PROMPT)

    def go(on_token: Callable[[int, int], None]) -> list[list[int]]:
        with torch.no_grad():
            return [list(held_function()(oracle_model(), list(prompt), NEW_TOKENS))]

    return [("the chapter's prompt", lambda: [reference_tokens(prompt, NEW_TOKENS)], go)]


def _first_position(model, prompt_ids, max_new_tokens):
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits
        ids.append(int(logits[0, 0].argmax()))
    return ids[len(prompt_ids) :]


def _prompt_only(model, prompt_ids, max_new_tokens):
    logits = model(torch.tensor([prompt_ids])).logits
    return [int(logits[0, -1].argmax())] * max_new_tokens


def _last_token_only(model, prompt_ids, max_new_tokens):
    new, ids = [], list(prompt_ids)
    for _ in range(max_new_tokens):
        new.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        ids = new[-1:]
    return new


def _with_prompt(model, prompt_ids, max_new_tokens):
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids


GREEDY_DECODE = Exercise(
    name="greedy_decode",
    reference=greedy_decode,
    probe=_greedy_probe,
    swapped_in=hold,
    runs=_greedy_runs(),
    known_wrong=[
        KnownWrong(
            "first_position",
            _first_position,
            "you take the logits of the first position (logits[0, 0]): the next token is "
            "predicted by the last one, logits[0, -1]",
        ),
        KnownWrong(
            "prompt_only",
            _prompt_only,
            "you run the prompt once and repeat its token: each step must feed the sequence "
            "with every token chosen so far",
        ),
        KnownWrong(
            "last_token_only",
            _last_token_only,
            "after the first step you feed only the newest token: without a cache the model "
            "must re-read the whole sequence (that re-reading is what chapter 02's cache saves)",
        ),
        KnownWrong(
            "with_prompt",
            _with_prompt,
            "you return the prompt with the new tokens: return only the new ones",
        ),
    ],
    fallback="your loop does not choose, at each step, the argmax after the whole sequence",
)


def check_greedy_decode(fn: Callable) -> CheckResult:
    """Chapter 01: `greedy_decode(model, prompt_ids, max_new_tokens) -> new token ids`."""
    return check(GREEDY_DECODE, fn)


# -- 10: the bytes a decode step reads --------------------------------------------------------

# (config, batch, context_len, dtype): small configs with a tied and an odd shape each.
BYTES_CASES = [
    (
        GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=32),
        1,
        16,
        torch.float32,
    ),
    (
        GPTConfig(vocab_size=300, block_size=32, n_layer=3, n_head=4, n_embd=48),
        4,
        30,
        torch.bfloat16,
    ),
    (
        GPTConfig(vocab_size=1000, block_size=128, n_layer=1, n_head=1, n_embd=16),
        2,
        100,
        torch.float32,
    ),
]


@functools.cache
def measured_read_bytes(case: int) -> int:
    """What a decode step at `context_len` reads, measured on real objects: every weight of
    a real GPT once, and the keys/values a real ConcatKVCache holds after a prefill."""
    config, batch, context_len, dtype = BYTES_CASES[case]
    model = GPT(config).to(dtype).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once
    cache = ConcatKVCache()
    with torch.inference_mode():
        model(torch.zeros(batch, context_len, dtype=torch.long), cache=cache, last_only=True)
    kv = sum(t.numel() * t.element_size() for layer in cache.past_kv for t in layer)
    return weights + kv


def decode_read_bytes(
    config: GPTConfig, batch: int, context_len: int, bytes_per_number: int
) -> int:
    """The reference, from the formula (the check measures it on real objects)."""
    c = config.n_embd
    per_layer = (
        2 * c + (c * 3 * c + 3 * c) + (c * c + c) + 2 * c + (c * 4 * c + 4 * c) + (4 * c * c + c)
    )
    weights = config.vocab_size * c + config.block_size * c + config.n_layer * per_layer + 2 * c
    kv = 2 * config.n_layer * batch * context_len * c
    return (weights + kv) * bytes_per_number


def _bytes_probe(fn: Callable) -> list[object]:
    return [
        outcome(lambda case=case: fn(case[0], case[1], case[2], case[3].itemsize))
        for case in BYTES_CASES
    ]


def _bytes_runs() -> list[tuple[str, Callable, Callable]]:
    def go(on_token: Callable[[int, int], None]) -> list[list[int]]:
        got = []
        for config, batch, length, dtype in BYTES_CASES:
            got.append(int(held_function()(config, batch, length, dtype.itemsize)))
            on_token(0, got[-1])
        return [got]

    def expected() -> list[tuple[int, ...]]:
        return [tuple(measured_read_bytes(c) for c in range(len(BYTES_CASES)))]

    return [("weights and KV cache measured on real objects", expected, go)]


def _weights_only(config, batch, context_len, bytes_per_number):
    return decode_read_bytes(config, 0, context_len, bytes_per_number)


def _keys_only(config, batch, context_len, bytes_per_number):
    kv = 2 * config.n_layer * batch * context_len * config.n_embd * bytes_per_number
    return decode_read_bytes(config, batch, context_len, bytes_per_number) - kv // 2


def _untied_head(config, batch, context_len, bytes_per_number):
    head = config.vocab_size * config.n_embd * bytes_per_number
    return decode_read_bytes(config, batch, context_len, bytes_per_number) + head


def _one_row(config, batch, context_len, bytes_per_number):
    return decode_read_bytes(config, 1, context_len, bytes_per_number)


def _weights_per_row(config, batch, context_len, bytes_per_number):
    weights = decode_read_bytes(config, 0, context_len, bytes_per_number)
    return decode_read_bytes(config, batch, context_len, bytes_per_number) + (batch - 1) * weights


def _case_name(case: int) -> str:
    config, batch, length, dtype = BYTES_CASES[case]
    return (
        f"case {case}: {config.n_layer} layers, n_embd {config.n_embd}, vocab "
        f"{config.vocab_size}, batch {batch}, context {length}, {dtype}"
    )


DECODE_READ_BYTES = Exercise(
    name="decode_read_bytes",
    reference=decode_read_bytes,
    probe=_bytes_probe,
    swapped_in=hold,
    runs=_bytes_runs(),
    known_wrong=[
        KnownWrong(
            "weights_only",
            _weights_only,
            "you count the weights alone: every decode step also reads every cached key "
            "and value of every row, and at long contexts that is most of the bytes",
        ),
        KnownWrong(
            "keys_only",
            _keys_only,
            "you count the keys but not the values: the cache holds both, per layer",
        ),
        KnownWrong(
            "untied_head",
            _untied_head,
            "you count lm_head apart from wte: GPT-2 ties them, one matrix read once",
        ),
        KnownWrong(
            "one_row",
            _one_row,
            "your cache bytes are one row's: every row of the batch has its own keys/values",
        ),
        KnownWrong(
            "weights_per_row",
            _weights_per_row,
            "you read the weights once per row: a batched step reads them once for all "
            "rows, which is why batching raises the arithmetic intensity",
        ),
    ],
    fallback="the count is neither every weight once nor the whole cache of every row",
    step_label=_case_name,
)


def check_decode_read_bytes(fn: Callable) -> CheckResult:
    """Chapter 10: `decode_read_bytes(config, batch, context_len, bytes_per_number) -> int`."""
    return check(DECODE_READ_BYTES, fn)


# -- 15: the exported graph's prepare ----------------------------------------------------------

_real_export_prepare = ExportCache.prepare


def export_prepare(cache: ExportCache, batch: int, q_len: int, device: torch.device):
    """The reference: ExportCache.prepare."""
    return _real_export_prepare(cache, batch, q_len, device)


def _swap_export_prepare(fn: Callable) -> contextlib.AbstractContextManager:
    return mock.patch.object(ExportCache, "prepare", fn)


def _export_probe(fn: Callable) -> list[object]:
    config = oracle_model().config
    cases = [(2, 3, 4, [0, 2]), (1, 0, 5, None), (3, 6, 1, [1, 0, 3])]
    seen = []
    for batch, past, new, pads in cases:
        _, attention_mask, position_ids, past_kv = example_inputs(config, batch, past, new, pads)
        cache = ExportCache(list(past_kv), attention_mask, position_ids)
        seen.append(outcome(lambda c=cache, b=batch, n=new: fn(c, b, n, torch.device("cpu"))))
    return seen


def padded_greedy(
    step: Callable, prompts: list[tuple[int, ...]], n_new: int, on_token
) -> list[list[int]]:
    """Greedy decoding of left-padded rows through `step(ids, attention_mask, position_ids,
    past)` -> (logits, present): the graph's interface, driven as onnxruntime's loop does."""
    config = oracle_model().config
    width = max(map(len, prompts))
    pads = torch.tensor([width - len(p) for p in prompts])
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    attention_mask = (torch.arange(width)[None, :] >= pads[:, None]).long()
    empty = torch.zeros(len(prompts), config.n_head, 0, config.head_dim)
    past = tuple((empty, empty) for _ in range(config.n_layer))
    made: list[list[int]] = [[] for _ in prompts]
    for _ in range(n_new):
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.size(1) :].clone()
        logits, past = step(ids, attention_mask, positions, past)
        ids = logits[:, -1].argmax(-1, keepdim=True)
        for row, token in enumerate(ids[:, 0].tolist()):
            made[row].append(token)
            on_token(row, token)
        attention_mask = torch.cat([attention_mask, torch.ones_like(ids)], dim=1)
    return made


EXPORT_NEW = 6  # tokens per row through the exported graph (a few, each a graph run)


def _export_runs() -> list[tuple[str, Callable, Callable]]:
    prompts = [encoded(text) for text in BATCH_TEXTS]

    def expected() -> list[tuple[int, ...]]:
        return [reference_tokens(p, EXPORT_NEW) for p in prompts]

    def eager(on_token: Callable[[int, int], None]) -> list[list[int]]:
        module = DecoderWithPast(oracle_model())
        with torch.inference_mode():
            return padded_greedy(module, prompts, EXPORT_NEW, on_token)

    def exported(on_token: Callable[[int, int], None]) -> list[list[int]]:
        dynamic = torch.export.Dim.DYNAMIC
        config = oracle_model().config
        shapes = (
            {0: dynamic, 1: dynamic},
            {0: dynamic, 1: dynamic},
            {0: dynamic, 1: dynamic},
            tuple(
                ({0: dynamic, 2: dynamic}, {0: dynamic, 2: dynamic}) for _ in range(config.n_layer)
            ),
        )
        # Fresh tensors, not views (torch.export guards a view's base, which later steps lack).
        example = torch.utils._pytree.tree_map(torch.clone, example_inputs(config, 2, 3, 4))
        program = torch.export.export(
            DecoderWithPast(oracle_model()), example, dynamic_shapes=shapes
        )
        module = program.module()
        with torch.no_grad():
            return padded_greedy(module, prompts, EXPORT_NEW, on_token)

    return [
        ("eager, a left-padded batch", expected, eager),
        (
            "torch.export'ed once (batch 2, past 3, new 4), run at every step's shapes",
            expected,
            exported,
        ),
    ]


def _baked_length(cache, batch, q_len, device):
    kv_len = int(cache.attention_mask.shape[1])  # a Python int: the graph keeps the example's
    mask = rosetrainer.model.causal_mask(q_len, kv_len, device)
    mask = rosetrainer.model.padding_mask(mask, cache.attention_mask.to(device))
    return cache.position_ids, mask.expand(batch, 1, q_len, kv_len).clone()


def _no_padding(cache, batch, q_len, device):
    kv_len = cache.attention_mask.size(1)
    return cache.position_ids, rosetrainer.model.causal_mask(q_len, kv_len, device)


def _positions_from_past(cache, batch, q_len, device):
    kv_len = cache.attention_mask.size(1)
    mask = rosetrainer.model.padding_mask(
        rosetrainer.model.causal_mask(q_len, kv_len, device), cache.attention_mask
    )
    past = kv_len - q_len
    return torch.arange(past, kv_len, device=device)[None, :].expand(batch, q_len), mask


def _top_left(cache, batch, q_len, device):
    kv_len = cache.attention_mask.size(1)
    mask = torch.ones(kv_len, kv_len, dtype=torch.bool, device=device).tril()[:q_len]
    return cache.position_ids, rosetrainer.model.padding_mask(mask, cache.attention_mask)


EXPORT_PREPARE = Exercise(
    name="export_prepare",
    reference=export_prepare,
    probe=_export_probe,
    swapped_in=_swap_export_prepare,
    runs=_export_runs(),
    known_wrong=[
        KnownWrong(
            "baked_length",
            _baked_length,
            "you read a length as a Python number (int(...)): the trace turns it into a "
            "constant, and the graph is only right at the example's shapes; keep the "
            "tensor's .size(), which stays a symbol",
        ),
        KnownWrong(
            "no_padding",
            _no_padding,
            "your mask ignores attention_mask: a padded row's queries read its padding slots",
        ),
        KnownWrong(
            "positions_from_past",
            _positions_from_past,
            "you count positions from the past's length: a left-padded row's real tokens "
            "then stand as far right as its padding is long; take the graph's position_ids",
        ),
        KnownWrong(
            "top_left",
            _top_left,
            "your mask is aligned top-left (rows 0 .. q_len of the full triangle): with a "
            "past, the new queries get the rows of the oldest positions",
        ),
    ],
    fallback="the positions or the mask the graph computes differ from the uncached run's",
)


def check_export_prepare(fn: Callable) -> CheckResult:
    """Chapter 15: `export_prepare(cache, batch, q_len, device) -> (position_ids, mask)`."""
    return check(EXPORT_PREPARE, fn)


# -- 16: one pipeline stage -------------------------------------------------------------------

_real_stage_forward = PipelineStage.forward


def stage_forward(stage: PipelineStage, x: torch.Tensor, cache) -> torch.Tensor:
    """The reference: PipelineStage.forward."""
    return _real_stage_forward(stage, x, cache)


def _swap_stage_forward(fn: Callable) -> contextlib.AbstractContextManager:
    return mock.patch.object(PipelineStage, "forward", fn)


def pipelined_greedy(n_stages: int, n_new: int, on_token) -> list[list[int]]:
    """The chapter prompt greedy through `n_stages` stages in this process, one cache each."""
    model = oracle_model()
    stages = [PipelineStage(model, s, n_stages) for s in range(n_stages)]
    caches = [ConcatKVCache() for _ in stages]
    ids, made = torch.tensor([encoded(PROMPT)]), []
    with torch.inference_mode():
        for _ in range(n_new):
            x = ids
            for stage, cache in zip(stages, caches, strict=True):
                x = stage(x, cache)
            token = int(x[0].argmax())
            made.append(token)
            on_token(0, token)
            ids = torch.tensor([[token]])
    return [made]


def _stage_runs() -> list[tuple[str, Callable, Callable]]:
    prompt = encoded(PROMPT)
    n_stages = oracle_model().config.n_layer  # one layer a stage: every stage but one is "late"
    return [
        (
            f"{n_stages} stages, one cache each",
            lambda: [reference_tokens(prompt, NEW_TOKENS)],
            lambda on_token: pipelined_greedy(n_stages, NEW_TOKENS, on_token),
        )
    ]


def _stage_probe(fn: Callable) -> list[object]:
    model = oracle_model()
    last = PipelineStage(model, 1, 2)
    hidden = torch.randn(1, 3, model.config.n_embd, generator=torch.Generator().manual_seed(0))

    def two_calls() -> list[torch.Tensor]:
        cache = ConcatKVCache()
        with torch.inference_mode():
            return [fn(last, hidden, cache), fn(last, hidden[:, :1], cache)]

    return [outcome(two_calls)]


def _global_layer(stage, x, cache):
    batch, q_len = x.shape[:2]
    pos, attn_mask = cache.prepare(batch, q_len, x.device)
    parts = stage.transformer
    if stage.is_first:
        x = parts.drop(parts.wte(x) + parts.wpe(pos))
    for local, block in enumerate(parts.h):
        x = block(x, attn_mask, cache, stage.layers[local])
    return stage.lm_head(parts.ln_f(x)[:, -1, :]) if stage.is_last else x


def _every_position(stage, x, cache):
    batch, q_len = x.shape[:2]
    pos, attn_mask = cache.prepare(batch, q_len, x.device)
    parts = stage.transformer
    if stage.is_first:
        x = parts.drop(parts.wte(x) + parts.wpe(pos))
    for local, block in enumerate(parts.h):
        x = block(x, attn_mask, cache, cache_slot(stage.layers, local))
    return stage.lm_head(parts.ln_f(x)) if stage.is_last else x


STAGE_FORWARD = Exercise(
    name="stage_forward",
    reference=stage_forward,
    probe=_stage_probe,
    swapped_in=_swap_stage_forward,
    runs=_stage_runs(),
    known_wrong=[
        KnownWrong(
            "global_layer",
            _global_layer,
            "you hand the cache the block's global layer number: a stage's cache holds "
            "only its own layers, numbered from 0, so a later stage writes past its end "
            "(a concatenating cache starts a new layer there and loses the past)",
        ),
        KnownWrong(
            "every_position",
            _every_position,
            "the last stage returns logits for every position: return the last token's "
            "row alone, (batch, vocab)",
        ),
    ],
    fallback="a stage's output is not what the same layers compute in one process",
)


def check_stage_forward(fn: Callable) -> CheckResult:
    """Chapter 16: `stage_forward(stage, x, cache) -> hidden states or last-token logits`."""
    return check(STAGE_FORWARD, fn)


# -- 17: group quantization --------------------------------------------------------------------


def _quantize_probe(fn: Callable) -> list[object]:
    """Not the codes themselves (float16 rounding may differ by a code): the shapes, the
    code range, and how far each number is read back from itself."""
    x = torch.randn(1, 2, 8, 8, generator=torch.Generator().manual_seed(0)) * 3
    x[..., 3] += 20.0  # an outlier channel, as keys have

    def summary(bits: int, group_size: int, dim: int) -> object:
        q = fn(x, bits, group_size, dim)
        back = dequantize(q, group_size, dim, torch.float32)
        scale = q.scale.float().repeat_interleave(group_size, dim)
        slack = 1e-3 * (1 + x.abs())
        return (
            tuple(q.codes.shape),
            tuple(q.scale.shape),
            q.codes.dtype,
            int(q.codes.max()) <= 2**bits - 1,
            bool(((back - x).abs() <= scale / 2 + slack).all()),
            bool((back <= x + slack).all()),
        )

    return [outcome(lambda a=a: summary(*a)) for a in [(4, 4, 3), (8, 8, 2), (4, 2, 2)]]


QUANT_NEW = 24


def _quantized_runs() -> list[tuple[str, Callable, Callable]]:
    prompt = encoded(PROMPT)

    def go(on_token: Callable[[int, int], None]) -> list[list[int]]:
        model = oracle_model()
        cache = make_kv_cache(model, kv_cache_dtype="int4", window=0, group_size=16)
        run = generate(model, list(prompt), GREEDY_QUANT, cache=cache, on_token=on_token)
        return [run.token_ids]

    @functools.cache
    def expected() -> list[tuple[int, ...]]:  # the real quantizer's run: the oracle here
        return [tuple(go(lambda row, token: None)[0])]

    return [("int4 keys per channel and values per token, no exact window", expected, go)]


GREEDY_QUANT = SamplingParams(max_tokens=QUANT_NEW, ignore_eos=True)


def _swap_quantize(fn: Callable) -> contextlib.AbstractContextManager:
    return mock.patch.object(roseinfer.cache.quantized, "quantize", fn)


def _last_dim_always(x, bits, group_size, dim):
    return quantize(x, bits, group_size, x.dim() - 1)


def _symmetric(x, bits, group_size, dim):
    q = quantize(x, bits, group_size, dim)
    levels = 2**bits - 1
    groups = x.float().movedim(dim, -1).unflatten(-1, (-1, group_size))
    scale = (groups.abs().amax(-1, keepdim=True) / levels).to(torch.float16)
    codes = (groups / scale.float().clamp(min=1e-8)).round().clamp(0, levels).to(torch.uint8)
    return q._replace(
        codes=codes.flatten(-2).movedim(-1, dim),
        scale=scale.squeeze(-1).movedim(-1, dim),
        zero=torch.zeros_like(q.zero),
    )


def _recoded(x, bits, group_size, dim, levels: int, rounding: Callable) -> Quantized:
    """Asymmetric groups as the reference, with another number of levels or rounding."""
    groups = x.float().movedim(dim, -1).unflatten(-1, (-1, group_size))
    zero = groups.amin(-1, keepdim=True).to(torch.float16)
    scale = ((groups.amax(-1, keepdim=True) - zero.float()) / levels).to(torch.float16)
    codes = rounding((groups - zero.float()) / scale.float().clamp(min=1e-8)).clamp(0, levels)
    return Quantized(
        codes.to(torch.uint8).flatten(-2).movedim(-1, dim),
        scale.squeeze(-1).movedim(-1, dim),
        zero.squeeze(-1).movedim(-1, dim),
    )


def _truncates(x, bits, group_size, dim):
    return _recoded(x, bits, group_size, dim, 2**bits - 1, torch.floor)


def _one_level_too_many(x, bits, group_size, dim):
    return _recoded(x, bits, group_size, dim, 2**bits, torch.round)


QUANTIZE = Exercise(
    name="quantize",
    reference=quantize,
    probe=_quantize_probe,
    swapped_in=_swap_quantize,
    runs=_quantized_runs(),
    known_wrong=[
        KnownWrong(
            "last_dim_always",
            _last_dim_always,
            "you group along the last axis whatever `dim` says: keys are grouped along "
            "time (per channel), so each channel's outlier gets a scale of its own",
        ),
        KnownWrong(
            "symmetric",
            _symmetric,
            "your groups are symmetric around 0 with unsigned codes: every negative number "
            "clamps to code 0; store the group's minimum as zero (asymmetric)",
        ),
        KnownWrong(
            "truncates",
            _truncates,
            "you truncate (floor) where rounding is right: every number reads back below "
            "itself, off by up to a whole scale, not half",
        ),
        KnownWrong(
            "one_level_too_many",
            _one_level_too_many,
            "your codes run 0 .. 2**bits, one level too many: the top code does not fit "
            "in `bits` bits (int4 packs two codes a byte)",
        ),
    ],
    fallback="some number is not read back within half its group's scale",
)


def check_quantize(fn: Callable) -> CheckResult:
    """Chapter 17: `quantize(x, bits, group_size, dim) -> Quantized(codes, scale, zero)`."""
    return check(QUANTIZE, fn)
