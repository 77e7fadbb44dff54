"""What the engine reports: per request (`RequestOutput`, `TokenLogprob`) and for
itself (`EngineStats`). A request's output is made by `EngineSequence.output`
(roseinfer/engine/sequence.py); its text by the request's `Detokenizer`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from roseinfer.speculative.verify import SpeculativeStats


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float  # log-softmax of the model's raw logits (float32) at the chosen token
    top: list[tuple[int, float]]  # the params.logprobs likeliest (token_id, logprob), best first


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every generated id so far (end-of-text is not kept; a stop id is)
    new_token_ids: list[int]  # generated in this step
    text: str  # decoded so far: never half a UTF-8 character, never a (possible) stop string
    new_text: str  # the part of `text` not reported before
    logprobs: list[TokenLogprob] | None  # one per generated token so far
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: int | str | None  # the token id or stop string
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    arrival_time: float  # time.perf_counter() clock
    first_token_time: float | None
    finish_time: float | None
    # Set when handling this request raised inside a step (its sampling, stop check,
    # text): it finished then with finish_reason "abort"; the other requests went on.
    error: str | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int  # total
    num_kv_blocks_used: int  # held by live sequences (cached-but-unreferenced are not "used")
    prefix_cache_queries: int  # blocks looked up (cumulative)
    prefix_cache_hits: int  # blocks found (cumulative)
    num_preemptions: int  # cumulative
    prompt_tokens: int  # cumulative, prompt tokens admitted
    generation_tokens: int  # cumulative, tokens sampled
    kv_pool_bytes: int  # the pool, allocated once: the only copy of the keys and values
    # Speculative decoding's counts (drafts, drafted and accepted tokens; its acceptance
    # rate and mean accepted length); None when the engine runs without a drafter
    speculative: SpeculativeStats | None = None


def token_logprob(logits: torch.Tensor, token_id: int, top_n: int) -> TokenLogprob:
    """The chosen token's log-probability under the raw logits, and the top_n best."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, top_n) if top_n > 0 else None
    pairs = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return TokenLogprob(token_id, float(logprobs[token_id]), pairs)
