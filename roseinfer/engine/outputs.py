"""What the engine reports: per request (`RequestOutput`, `TokenLogprob`) and for
itself (`EngineStats`), and how a request's text is made safe to stream."""

from __future__ import annotations

import codecs
from dataclasses import dataclass

import torch

from roseinfer.request.sequence import Sequence
from rosetrainer.tokenizer import Tokenizer


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
    error: str | None = None  # what failed, when the engine finished this request on an error


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


def token_logprob(logits: torch.Tensor, token_id: int, top_n: int) -> TokenLogprob:
    """The chosen token's log-probability under the raw logits, and the top_n best."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, top_n) if top_n > 0 else None
    pairs = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return TokenLogprob(token_id, float(logprobs[token_id]), pairs)


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could still begin a stop string."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


def visible_text(seq: Sequence, tokenizer: Tokenizer) -> str:
    """The text a client may see now.

    While the request runs, a trailing character whose bytes have not all arrived is
    left out (GPT-2 splits some characters over several tokens), and so is any tail
    that could still grow into a stop string. Once it stopped on a stop string, the
    text ends just before that string.
    """
    if seq.finish_reason == "stop" and isinstance(seq.stop_reason, str):
        return seq.text[: seq.text.find(seq.stop_reason)]
    data = tokenizer.encoding.decode_bytes(seq.output_ids)
    text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(
        data, final=seq.is_finished
    )
    if not seq.is_finished:
        text = text[: len(text) - held_back(text, seq.params.stop)]
    return text


def request_output(seq: Sequence, tokenizer: Tokenizer) -> RequestOutput:
    """The request's state now; what it had not reported before is its `new_` part."""
    text = visible_text(seq, tokenizer)
    new_text, seq.sent_text = text[len(seq.sent_text) :], text
    new_token_ids = seq.output_ids[seq.num_sent_tokens :]
    seq.num_sent_tokens = len(seq.output_ids)
    return RequestOutput(
        request_id=seq.request_id,
        prompt_token_ids=list(seq.prompt_ids),
        token_ids=list(seq.output_ids),
        new_token_ids=new_token_ids,
        text=text,
        new_text=new_text,
        logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
        finished=seq.is_finished,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        num_cached_tokens=seq.num_cached_tokens,
        arrival_time=seq.arrival_time,
        first_token_time=seq.first_token_time,
        finish_time=seq.finish_time,
    )
