"""One request's state, from arrival to finish: `Sequence`.

Every generation path keeps one `Sequence` per request instead of parallel lists:
the prompt and the tokens made so far, what the request asked for (`SamplingParams`),
its own random stream, its status, why it finished, and when each thing happened.
The stopping rules live here, in `append_token` (which every loop reaches through
`roseinfer.request.token_step.take_tokens`), so the batch loop, the serving engine, the split
model and the onnxruntime loop stop a request for the same reasons at the same token.
This module needs no torch: the random stream is made by `new_generator`, a torch one
here, a numpy one in the onnxruntime loop (roseinfer/loops/onnx_generate.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from roseinfer.request.detokenizer import Detokenizer
from roseinfer.request.sampling_params import SamplingParams
from rosetrainer.errors import RoseError

if TYPE_CHECKING:
    import torch

    from roseinfer.request.structured import Grammar, GrammarMatcher


# Why a request finished, in the OpenAI API's words: "stop" (end-of-text, a stop token,
# a stop string, or its structured output complete; `stop_reason` names the token id or
# the string, None for the last), "length" (max_tokens or the context window) or
# "abort" (cancelled, or failed: `error` says why).
FINISH_REASONS = ("stop", "length", "abort")

_request_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """Every field below the arguments is written by this class's own methods only."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    eos_id: int | None = None  # end-of-text stops the request unless params.ignore_eos
    decode: Callable[[list[int]], str] | None = None  # ids -> text, for stop strings and text
    device: torch.device | str = "cpu"  # where the request's random stream lives
    arrival_time: float = field(default_factory=time.perf_counter)
    # params.structured_outputs compiled for the tokenizer (request/structured.py)
    grammar: Grammar | None = field(default=None, repr=False)

    output_ids: list[int] = field(default_factory=list, init=False)
    finish_reason: str | None = field(default=None, init=False)
    stop_reason: int | str | None = field(
        default=None, init=False
    )  # the id or string that stopped it
    error: str | None = field(default=None, init=False)  # why it failed ("abort")
    token_times: list[float] = field(default_factory=list, init=False)  # one per sampled token
    finish_time: float | None = field(default=None, init=False)
    # torch.Generator here, numpy's in the onnxruntime loop; None when greedy
    generator: Any = field(default=None, init=False, repr=False)
    # The output's text, when a decode was given
    detokenizer: Detokenizer | None = field(default=None, init=False, repr=False)
    # Where its output stands in its grammar; advanced by append_token only, so it always
    # matches output_ids (a preempted request keeps both and recomputes only its cache).
    matcher: GrammarMatcher | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.request_id:
            self.request_id = f"seq-{next(_request_ids)}"
        if self.params.stop and self.decode is None:
            raise RoseError("stop strings need a decode function (ids -> text)")
        self.generator = self.new_generator()
        if self.decode is not None:
            self.detokenizer = Detokenizer(self.decode, self.params.stop)
        if (self.grammar is None) != (self.params.structured_outputs is None):
            raise RoseError(
                "a request with structured_outputs needs its compiled grammar "
                "(roseinfer.request.structured.grammar_for), and only such a request has one"
            )
        if self.grammar is not None:
            from roseinfer.request.structured import GrammarMatcher

            self.matcher = GrammarMatcher(self.grammar)

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
        return self.finish_reason is not None

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def text(self) -> str:
        """The output decoded so far (complete characters; everything once finished)."""
        return "" if self.detokenizer is None else self.detokenizer.text

    @property
    def num_visible_chars(self) -> int:
        """How many characters of `text` a client may see now (its first ones): never
        half a UTF-8 character, never a tail that could still become a stop string;
        once stopped by a stop string, the text before it."""
        if self.detokenizer is None:
            return 0
        stopped = isinstance(self.stop_reason, str)
        return self.detokenizer.visible_length(self.is_finished, stopped)

    # -- what the loops tell it --

    def append_token(
        self, token_id: int, now: float | None = None, max_len: int | None = None
    ) -> bool:
        """Record one sampled token and finish the request if it should stop here;
        True when the token joined the output.

        End-of-text is not kept in `output_ids` (it ends the text, it is not part of it);
        a stop token id is kept, as is the token that completes a stop string. A request
        with structured output advances its matcher first (a token its grammar forbids
        raises), and stops ("stop") once its grammar is complete.
        max_len: the most tokens the request may hold (prompt and output): a loop whose
        positions end at the context window stops it there ("length").
        """
        if self.matcher is not None:
            self.matcher.advance(token_id)
        self.token_times.append(time.perf_counter() if now is None else now)
        # (A grammar allows end-of-text only where its output is whole: there it ends the
        # request whatever ignore_eos says.)
        if token_id == self.eos_id and (not self.params.ignore_eos or self.matcher is not None):
            self.finish("stop", stop_reason=token_id)
            return False
        self.output_ids.append(token_id)
        stop = None if self.detokenizer is None else self.detokenizer.push(token_id)
        if token_id in self.params.stop_token_ids:
            self.finish("stop", stop_reason=token_id)
        elif stop is not None:
            self.finish("stop", stop_reason=stop)
        elif self.matcher is not None and self.matcher.is_finished:
            self.finish("stop")
        elif len(self.output_ids) >= self.params.max_tokens:
            self.finish("length")
        elif max_len is not None and self.num_tokens > max_len:
            # Its newest token would stand at position max_len: no position left for it.
            self.finish("length")
        return True

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        assert reason in FINISH_REASONS, reason
        if self.is_finished:
            return
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = time.perf_counter()
        if self.detokenizer is not None:
            self.detokenizer.flush()

    def fail(self, error: str) -> None:
        """Something raised while handling this request: it ends now, as "abort"."""
        if self.detokenizer is not None:
            self.detokenizer.pending.clear()  # not decoded: the decode may be what broke
        self.finish("abort")
        self.finish_reason, self.stop_reason, self.error = "abort", None, error

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


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # the new tokens (a final <|endoftext|> is not included)
    finish_reason: str  # "stop" or "length" (FINISH_REASONS says why each)
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
