"""One request's state, from arrival to finish: `Sequence`.

Every generation path keeps one `Sequence` per request instead of parallel lists:
the prompt and the tokens made so far, what the request asked for (`SamplingParams`),
its own random stream, its status, why it finished, and when each thing happened.
The stopping rules live here, in `append_token`, so the batch loop, the serving
engine and the onnxruntime loop stop a request for the same reasons at the same token.
This module needs no torch: the random stream is made by `new_generator`, a torch one
here, a numpy one in the onnxruntime loop (roseinfer/loops/onnx_generate.py).
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from roseinfer.request.sampling_params import SamplingParams
from rosetrainer.errors import RoseError

if TYPE_CHECKING:
    import torch


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # admitted, not yet (or no longer: preempted) holding a cache
    RUNNING = "running"  # in the running batch
    FINISHED = "finished"


# Why a request finished, in the OpenAI API's words: "stop" (end-of-text, a stop token
# or a stop string; `stop_reason` says which), "length" (max_tokens or the context
# window) or "abort" (cancelled while running).
FINISH_REASONS = ("stop", "length", "abort")

_request_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    eos_id: int | None = None  # end-of-text stops the request unless params.ignore_eos
    decode: Callable[[list[int]], str] | None = None  # ids -> text, for stop strings and text
    device: torch.device | str = "cpu"  # where the request's random stream lives
    arrival_time: float = field(default_factory=time.perf_counter)

    output_ids: list[int] = field(default_factory=list, init=False)
    status: SequenceStatus = field(default=SequenceStatus.WAITING, init=False)
    finish_reason: str | None = field(default=None, init=False)
    stop_reason: int | str | None = field(
        default=None, init=False
    )  # the id or string that stopped it
    text: str = field(default="", init=False)  # decode(output_ids), when a decode was given
    token_times: list[float] = field(default_factory=list, init=False)  # one per sampled token
    finish_time: float | None = field(default=None, init=False)
    # torch.Generator here, numpy's in the onnxruntime loop; None when greedy
    generator: Any = field(default=None, init=False, repr=False)

    # The serving engine's bookkeeping (roseinfer/engine): where the request's keys and
    # values live in the block pool, and how much of it has been computed.
    block_table: list[int] = field(default_factory=list, init=False, repr=False)
    block_hashes: list[bytes] = field(default_factory=list, init=False, repr=False)
    num_computed_tokens: int = field(default=0, init=False)  # tokens whose KV the pool holds
    num_cached_tokens: int = field(default=0, init=False)  # prompt tokens the prefix cache served
    logprobs: list = field(default_factory=list, init=False, repr=False)  # TokenLogprob per token
    sent_text: str = field(default="", init=False, repr=False)  # text reported so far
    num_sent_tokens: int = field(default=0, init=False, repr=False)  # output ids reported so far

    def __post_init__(self) -> None:
        if not self.request_id:
            self.request_id = f"seq-{next(_request_ids)}"
        if self.params.stop and self.decode is None:
            raise RoseError("stop strings need a decode function (ids -> text)")
        self.generator = self.new_generator()

    def new_generator(self) -> Any:
        """The request's own random stream, seeded from its params (None when greedy)."""
        import torch  # here, not at the top: the onnxruntime loop's subclass needs no torch

        if self.params.greedy:
            return None  # nothing is drawn
        generator = torch.Generator(device=torch.device(self.device))
        if self.params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.params.seed)
        return generator

    # -- what the loops read --

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    # -- what the loops tell it --

    def append_token(self, token_id: int, now: float | None = None) -> None:
        """Record one sampled token and finish the request if it should stop here.

        End-of-text is not kept in `output_ids` (it ends the text, it is not part of it);
        a stop token id is kept, as is the token that completes a stop string.
        """
        self.token_times.append(time.perf_counter() if now is None else now)
        if token_id == self.eos_id and not self.params.ignore_eos:
            self.finish("stop", stop_reason=token_id)
            return
        self.output_ids.append(token_id)
        if token_id in self.params.stop_token_ids:
            self.finish("stop", stop_reason=token_id)
            return
        stop = self._update_text()
        if stop is not None:
            self.finish("stop", stop_reason=stop)
        elif len(self.output_ids) >= self.params.max_tokens:
            self.finish("length")

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        assert reason in FINISH_REASONS, reason
        if self.is_finished:
            return
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = time.perf_counter()

    def result(self, started: float, step_logits: list[Any] | None = None) -> GenerationResult:
        """What the finished request made, its times counted from `started` (its loop's start)."""
        return GenerationResult(
            prompt_ids=list(self.prompt_ids),
            token_ids=list(self.output_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            step_logits=step_logits,
            time_to_first_token_s=self.token_times[0] - started,
            total_time_s=self.finish_time - started,
        )

    def _update_text(self) -> str | None:
        """Decode the output; return the stop string this token completed, if any.

        A character that GPT-2 splits over several tokens decodes as U+FFFD until its
        last byte arrives, and then replaces that placeholder: so the new text may
        differ from the old one *before* the old one's end. The search starts where the
        two first differ, less the length of the stop string.
        """
        if self.decode is None:
            return None
        old, new = self.text, self.decode(self.output_ids)
        self.text = new
        changed_at = next(
            (i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), len(old)
        )
        for stop in self.params.stop:
            if stop in new[max(0, changed_at - len(stop) + 1) :]:
                return stop
        return None


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # the new tokens (a final <|endoftext|> is not included)
    finish_reason: str  # "stop" (end-of-text, a stop token or string) or "length"
    stop_reason: int | str | None  # the token id or stop string that stopped it
    # (vocab,) float32 per step, when asked for: torch tensors, or numpy arrays from the
    # onnxruntime loop
    step_logits: list[Any] | None
    time_to_first_token_s: float
    total_time_s: float

    @property
    def tokens_per_s(self) -> float:
        decode_time = self.total_time_s - self.time_to_first_token_s
        n = len(self.token_ids) - 1
        return n / decode_time if n > 0 and decode_time > 0 else float("nan")
