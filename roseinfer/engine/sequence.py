"""A request inside the engine: `EngineSequence`, the request's own state (a `Sequence`:
its tokens, text, stop rules and random stream) and the engine's bookkeeping of it.

Each field has one writer: the request's own fields change only through `Sequence`'s
methods; where its keys and values live only through the `BlockManager`; what it
reported only through `report`, its log-probabilities only through the `LLMEngine`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from roseinfer.engine.outputs import RequestOutput, RequestOutputKind, TokenLogprob
from roseinfer.request.sequence import Sequence


@dataclass(eq=False)
class EngineSequence(Sequence):
    # What its outputs carry (LLMEngine.add_request's caller chooses).
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # BlockManager: its blocks in the pool, their prefix-cache keys, how many of its
    # tokens the pool holds, and how many prompt tokens the prefix cache served.
    block_table: list[int] = field(default_factory=list, init=False, repr=False)
    block_hashes: list[bytes] = field(default_factory=list, init=False, repr=False)
    num_computed_tokens: int = field(default=0, init=False)
    num_cached_tokens: int = field(default=0, init=False)
    # Speculative decoding: the drafted tokens the next step feeds after the sequence's
    # newest token, for the target to verify; [] otherwise. The LLMEngine proposes them
    # after a step (and clears them once verified); the Scheduler drops those that do not
    # fit in the step, and all of them when it preempts the sequence.
    draft_ids: list[int] = field(default_factory=list, init=False, repr=False)
    # LLMEngine: one TokenLogprob per output token (when asked for).
    logprobs: list[TokenLogprob] = field(default_factory=list, init=False, repr=False)
    # report: how much of its output (characters of visible text, token ids) it reported.
    num_reported_chars: int = field(default=0, init=False, repr=False)
    num_reported_tokens: int = field(default=0, init=False, repr=False)

    def fed_slice(self, start: int, end: int) -> list[int]:
        """Its tokens start..end-1 as the pool holds them once this step runs: the
        prompt, the output, then its drafts. Read from those lists in place: a step
        feeds a few tokens of a long sequence, and joining the lists first would copy
        all of them."""
        tokens: list[int] = []
        for part in (self.prompt_ids, self.output_ids, self.draft_ids):
            if end > 0 and start < len(part):
                tokens += part[max(start, 0) : end]
            start, end = start - len(part), end - len(part)  # (the next part's indices)
        return tokens

    def report(self) -> RequestOutput | None:
        """What the request made since its previous output, and the whole of it where its
        output kind asks (see RequestOutputKind); None while a FINAL_ONLY request runs.
        What it returns counts as reported from now on. Only the whole copies anything
        that grows with the request's length."""
        if self.output_kind is RequestOutputKind.FINAL_ONLY and not self.is_finished:
            return None
        whole = self.is_finished or self.output_kind is RequestOutputKind.CUMULATIVE
        asked_logprobs = self.params.logprobs is not None
        num_chars = self.num_visible_chars
        out = RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_ids) if whole else None,
            token_ids=list(self.output_ids) if whole else None,
            text=self.text[:num_chars] if whole else None,
            logprobs=list(self.logprobs) if whole and asked_logprobs else None,
            new_token_ids=self.output_ids[self.num_reported_tokens :],
            new_text=self.text[self.num_reported_chars : num_chars],
            new_logprobs=self.logprobs[self.num_reported_tokens :] if asked_logprobs else None,
            finished=self.is_finished,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            num_cached_tokens=self.num_cached_tokens,
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
            finish_time=self.finish_time,
            error=self.error,
        )
        self.num_reported_chars, self.num_reported_tokens = num_chars, len(self.output_ids)
        return out
