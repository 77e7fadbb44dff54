"""What one request asks for: `SamplingParams`, checked when it is made.

Kept apart from the sampling itself (roseinfer/request/sampling.py, torch) so that the
onnxruntime loop, which runs without torch, reads the same settings and checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rosetrainer.errors import RoseError

# torch.Generator.manual_seed takes any integer that fits in 64 bits.
MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """Everything that belongs to one request (the engine's own settings live apart).

    The names follow the ones people know from vLLM and the OpenAI API.
    """

    max_tokens: int = 16  # new tokens at most
    temperature: float = 0.0  # 0 means greedy: argmax, no randomness
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    seed: int | None = None  # with sampling: one seed, one output (None: a fresh one)
    stop: tuple[str, ...] = ()  # stop once the text contains one of these
    stop_token_ids: tuple[int, ...] = ()  # stop once one of these is sampled (it is kept)
    ignore_eos: bool = False  # go on past end-of-text (it is then an ordinary token)
    logprobs: int | None = None  # also report the log-probabilities of this many top tokens

    def __post_init__(self) -> None:
        # Accept a single stop string and lists, as the OpenAI API does; store tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise RoseError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not (0 <= self.temperature < math.inf):
            raise RoseError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not _is_int(self.top_k) or self.top_k < 0:
            raise RoseError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise RoseError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise RoseError(f"seed must be an integer in [0, 2**64 - 1], got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RoseError(f"stop strings must be non-empty strings, got {list(self.stop)!r}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise RoseError(
                f"stop_token_ids must be token ids >= 0, got {list(self.stop_token_ids)!r}"
            )
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise RoseError(f"logprobs must be an integer >= 0, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def params_per_prompt(
    prompts: list[list[int]], params: SamplingParams | list[SamplingParams], block_size: int
) -> list[SamplingParams]:
    """Check a batch of prompts against the context window; one SamplingParams per prompt
    (one given for all, or one each)."""
    if not prompts:
        raise RoseError("no prompts given: pass at least one list of token ids")
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if len(params) != len(prompts):
        raise RoseError(
            f"{len(params)} SamplingParams for {len(prompts)} prompt(s): give one, or one per prompt"
        )
    for prompt in prompts:
        if not prompt:
            raise RoseError("a prompt is empty: start it from the end-of-text token instead")
        if len(prompt) > block_size:
            raise RoseError(
                f"a prompt has {len(prompt)} tokens but the model's context (block_size) is "
                f"{block_size}: shorten the prompt"
            )
    return list(params)
