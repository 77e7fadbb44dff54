"""A request inside the engine: `EngineSequence`, the request's own state (a `Sequence`:
its tokens, text, stop rules and random stream) and the engine's bookkeeping of it.

Each field has one writer: the request's own fields change only through `Sequence`'s
methods; where its keys and values live only through the `BlockManager`; what it
reported only through `report`, its log-probabilities only through the `LLMEngine`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from roseinfer.engine.outputs import RequestOutput, TokenLogprob
from roseinfer.request.sequence import Sequence


@dataclass(eq=False)
class EngineSequence(Sequence):
    # BlockManager: its blocks in the pool, their prefix-cache keys, how many of its
    # tokens the pool holds, and how many prompt tokens the prefix cache served.
    block_table: list[int] = field(default_factory=list, init=False, repr=False)
    block_hashes: list[bytes] = field(default_factory=list, init=False, repr=False)
    num_computed_tokens: int = field(default=0, init=False)
    num_cached_tokens: int = field(default=0, init=False)
    # Scheduler (speculative decoding): the drafted tokens this step feeds after the
    # sequence's newest token, for the target to verify; [] otherwise.
    draft_ids: list[int] = field(default_factory=list, init=False, repr=False)
    # LLMEngine: one TokenLogprob per output token (when asked for).
    logprobs: list[TokenLogprob] = field(default_factory=list, init=False, repr=False)
    # report: how much of its output (characters of visible text, token ids) it reported.
    num_reported_chars: int = field(default=0, init=False, repr=False)
    num_reported_tokens: int = field(default=0, init=False, repr=False)

    @property
    def fed_ids(self) -> list[int]:
        """The tokens the pool holds once this step runs: its own, then its drafts."""
        return self.all_ids + self.draft_ids if self.draft_ids else self.all_ids

    def output(self) -> RequestOutput:
        """The request's state now (a pure read); its `new_` parts are what it has not
        reported yet."""
        text = self.visible_text
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_ids),
            token_ids=list(self.output_ids),
            new_token_ids=self.output_ids[self.num_reported_tokens :],
            text=text,
            new_text=text[self.num_reported_chars :],
            logprobs=list(self.logprobs) if self.params.logprobs is not None else None,
            finished=self.is_finished,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            num_cached_tokens=self.num_cached_tokens,
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
            finish_time=self.finish_time,
            error=self.error,
        )

    def report(self) -> RequestOutput:
        """`output`, and what it holds counts as reported from now on."""
        out = self.output()
        self.num_reported_chars, self.num_reported_tokens = len(out.text), len(out.token_ids)
        return out
