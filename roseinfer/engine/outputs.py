"""What the engine reports: per request (`RequestOutput`, `TokenLogprob`, as its
`RequestOutputKind` asks) and for itself (`EngineStats`). A request's output is made
by `EngineSequence.report` (roseinfer/engine/sequence.py); its text by the request's
`Detokenizer`.

A `RequestOutput` also reads as vLLM's: `output.outputs[0].text`, `.token_ids`,
`.finish_reason` (a `CompletionOutput`), `output.prompt`, `output.prompt_token_ids`,
`output.request_id`, `output.finished`, so vLLM's offline examples run on rose's `LLM`
unchanged. rose's own code reads the request's fields directly (`output.text`): a rose
request is one completion (n choices are n requests), so `outputs` holds just one, or,
from `LLM.generate` with n > 1, the prompt's n (the first is the request's own).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from roseinfer.speculative.verify import SpeculativeStats


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float  # log-softmax of the model's raw logits (float32) at the chosen token
    top: list[tuple[int, float]]  # the params.logprobs likeliest (token_id, logprob), best first


class RequestOutputKind(Enum):
    """What a request's outputs carry (vLLM's `RequestOutputKind`, by the same names).

    Copying a request's whole state costs time that grows with its length; done for
    every request at every step, it would grow each step's host work with the context.
    So only CUMULATIVE, for looking at a request step by step, copies it every step.
    """

    CUMULATIVE = "cumulative"  # every output: what is new, and the whole request so far
    DELTA = "delta"  # every output: what is new; the finished one: the whole too (rose-serve)
    FINAL_ONLY = "final_only"  # only the finished output, with the whole (LLM, rose-generate)


@dataclass
class CompletionOutput:
    """One completion of a request, by vLLM's names. `logprobs` are rose's TokenLogprob
    (vLLM's are dicts of token id -> Logprob); `cumulative_logprob` is their sum."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # None: logprobs not asked for
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: int | str | None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's report from one engine step.

    The `new_` fields are deltas: what the request made since its previous output (a
    FINAL_ONLY request's only output: all of it). The whole request so far
    (`prompt_token_ids`, `token_ids`, `text`, `logprobs`) is in a finished output
    whatever the kind, and in every output of a CUMULATIVE request; elsewhere it is None.
    """

    request_id: str
    # The whole request so far (None where this output does not carry it, see above)
    prompt_token_ids: list[int] | None
    token_ids: list[int] | None  # generated (end-of-text is not kept; a stop id is)
    text: str | None  # decoded: never half a UTF-8 character, never a (possible) stop string
    logprobs: list[TokenLogprob] | None  # one per generated token (None also: not asked for)
    # Deltas: what is new since the request's previous output
    new_token_ids: list[int]
    new_text: str  # the text's next characters (the same rules as `text`)
    new_logprobs: list[TokenLogprob] | None  # one per new token (None: not asked for)
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
    prompt: str | None = None  # the prompt's text, where it was given as text (LLM.generate)
    # The prompt's other completions, where LLM.generate was asked for n > 1 (`outputs`
    # lists them after this request's own, index 1 to n - 1)
    more_completions: list[CompletionOutput] = field(default_factory=list)

    @property
    def outputs(self) -> list[CompletionOutput]:
        """The completion, as vLLM's RequestOutput holds it: the whole request where this
        output carries it (a finished one, any CUMULATIVE one), else what is new."""
        whole = self.text is not None
        logprobs = self.logprobs if whole else self.new_logprobs
        completion = CompletionOutput(
            index=0,
            text=self.text if whole else self.new_text,
            token_ids=self.token_ids if whole else self.new_token_ids,
            cumulative_logprob=None if logprobs is None else sum(lp.logprob for lp in logprobs),
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        return [completion, *self.more_completions]


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
