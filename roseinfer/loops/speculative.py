"""Speculative generation, the teaching loop: k drafts checked in one target call.

Decoding one token reads every weight of the target for one token's worth of work: on
most hardware that step is bound by memory, not arithmetic, so scoring k + 1 tokens in
one call costs little more than scoring one. Speculative decoding spends that slack: a
cheap drafter (roseinfer/speculative/drafters.py) guesses the next k tokens, the target
scores the last accepted token and the k guesses in one call, and the request keeps the
guesses the target agrees with, plus one token of the target's own
(roseinfer/speculative/verify.py). Every kept token is the target's choice, so greedy
output equals the uncached oracle's token for token, whatever the drafter proposes.

One round, for a cache holding every token but the newest:

1. the drafter proposes d <= k tokens (fewer near max_tokens or the context's end);
   a request with structured output has them cut at the first one its grammar forbids
   (`within_grammar`: the target would reject it anyway);
2. `verify_and_rollback`: the target reads [newest] + drafts, d + 1 queries over the
   cache. This is the KV cache's sliced causal mask (query i sees the past and the new
   tokens up to itself: rows kv_len - q_len .. kv_len of the full mask) and its
   position offset (the new tokens stand at past_len .. past_len + d) used on purpose;
   the request takes its tokens (`verify_drafts`), and the cache is cut back to the
   newest token and the accepted drafts (`truncate`): the rejected drafts' keys must
   go, or every later query would attend to tokens that are not in the text;
3. the drafter rolls its own cache back the same way at its next proposal.

Past the context window it follows the oracle's policy (`window_start`): drafts are
capped so the round stays inside the window, and when the window is full it restarts
the cache from the kept tokens, as the cached loop does.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from roseinfer.cache.dense import ConcatKVCache, DenseKVCache
from roseinfer.request import rows
from roseinfer.request.rows import checked_keep, make_sequences
from roseinfer.request.sampling import SamplingParams
from roseinfer.request.sequence import GenerationResult, Sequence
from roseinfer.request.token_step import TokenCallback
from roseinfer.speculative.drafters import Drafter, check_speculative_tokens
from roseinfer.speculative.verify import (
    NO_DRAFT,
    Draft,
    SpeculativeStats,
    verify_drafts,
    within_grammar,
)
from rosetrainer.errors import RoseError
from rosetrainer.model import GPT
from rosetrainer.tokenizer import Tokenizer


def verify_and_rollback(
    target: GPT,
    cache: DenseKVCache,
    held: int,
    seq: Sequence,
    new_ids: list[int],
    draft: Draft,
    on_token: TokenCallback | None = None,
) -> int:
    """One verify step: the target reads new_ids (its newest token, or the whole window
    after a restart) and the drafts in one call over `cache`, which holds `held`
    positions; seq takes the tokens the target chose; the cache is cut back to what seq
    keeps. Returns the drafts accepted."""
    ids = new_ids + draft.tokens
    scored = len(draft.tokens) + 1  # the newest token's row, then one row per draft
    device = target.lm_head.weight.device
    at = torch.arange(len(ids) - scored, len(ids), device=device)
    logits = target(torch.tensor([ids], device=device), cache=cache, logits_at=at).logits[0]
    accepted = verify_drafts(seq, logits, draft, on_token=on_token)
    cache.truncate(held + len(new_ids) + accepted)
    return accepted


def speculative_generate(
    target: GPT,
    drafter: Drafter,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    num_speculative_tokens: int,
    cache: DenseKVCache | None = None,
    eot_id: int | None = None,
    decode: Callable[[list[int]], str] | None = None,
    tokenizer: Tokenizer | None = None,
    on_token: TokenCallback | None = None,
    window_keep: int | None = None,
    stats: SpeculativeStats | None = None,
) -> GenerationResult:
    """Generate after one prompt with drafts from `drafter`, up to num_speculative_tokens
    a round, verified by `target` on `cache` (default: a fresh ConcatKVCache; any cache
    with `truncate`). eot_id, decode, tokenizer, on_token, window_keep: as in
    generate_batch (a request with structured_outputs is masked at every verified
    position as in its plain run); stats: counts drafts, drafted and accepted tokens
    into it (the drafts verified: after the grammar's cut)."""
    (seq,) = make_sequences(target, [prompt_ids], params, eot_id, decode, tokenizer)
    keep = checked_keep(target, window_keep)
    k = num_speculative_tokens
    check_speculative_tokens(k, target, "the target's")
    if target.config.sliding_window is not None:
        raise RoseError(
            "the teaching loop's caches cannot roll a sliding window back: generate with "
            "the engine (LLM, rose-serve), whose paged pool can"
        )
    context = rows.context_limit(target)
    cache = ConcatKVCache() if cache is None else cache
    cache.check_rows(1)
    cache.reset()
    stats = SpeculativeStats() if stats is None else stats
    start, held = 0, 0  # the cache holds the tokens [start, start + held)
    started = time.perf_counter()
    with torch.inference_mode():
        while not seq.is_finished:
            tokens = seq.all_ids
            slid = rows.window_start(start, len(tokens), context, keep)
            if slid != start:  # the window is full: the cache restarts from the kept tokens
                start, held = slid, 0
                cache.reset()
            # Every round stays inside the window the oracle reads (drafts included), and
            # never drafts a token past max_tokens.
            room = min(k, params.max_tokens - len(seq.output_ids) - 1)
            if context is not None:
                room = min(room, context - (len(tokens) - start))
            (draft,) = drafter.propose([seq], [room]) if room > 0 else (NO_DRAFT,)
            draft = within_grammar(seq, draft)
            new_ids = tokens[start + held :]
            accepted = verify_and_rollback(target, cache, held, seq, new_ids, draft, on_token)
            held += len(new_ids) + accepted
            stats.record(len(draft.tokens), accepted)
    drafter.release(seq)
    return seq.result(started)
