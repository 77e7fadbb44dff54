"""What one request asks for: `SamplingParams`, checked when it is made.

Kept apart from the sampling itself (roseinfer/request/sampling.py, torch) so that the
onnxruntime loop, which runs without torch, reads the same settings and checks.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, replace

from rosetrainer.errors import RoseError

# torch.Generator.manual_seed takes any integer that fits in 64 bits.
MAX_SEED = 2**64 - 1
# The sampler divides float32 logits by the temperature and compares float32 probability
# mass with top_p: a value below float32's smallest normal number rounds to 0 (or a
# denormal flushed to 0), and 0 / 0 gives NaN probabilities. So positive values start here.
FLOAT32_TINY = 1.1754943508222875e-38
MAX_LOGPROBS = 20  # top alternatives per token, at most (OpenAI's limit)
# Stop strings are checked against the text at every step: bound how many and how long.
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_LENGTH = 256  # characters per stop string


class InvalidParam(RoseError):
    """A SamplingParams field the sampler cannot use; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


STRUCTURED = "structured_outputs"  # the field an error in a constraint names


@dataclass(frozen=True)
class StructuredOutputs:
    """One constraint on a request's output (vLLM's `structured_outputs` names).

    json: a JSON schema (a dict, or its JSON text; kept as text, property order intact);
    json_object: any JSON object (OpenAI's `{"type": "json_object"}`); regex: the whole
    output matches it; choice: the output is exactly one of these strings; grammar: a
    Lark grammar in llguidance's dialect (its rule `start` is the output).
    """

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise InvalidParam(
                STRUCTURED, f"json_object is true or false, got {self.json_object!r}"
            )
        given = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise InvalidParam(
                STRUCTURED,
                "structured outputs take exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(given) or 'none'}",
            )
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidParam(
                    STRUCTURED, f"{name} must be a non-empty string, got {value!r:.100}"
                )
            if value is not None:
                _check_unicode(value, name)
        if self.choice is not None:
            choice = (self.choice,) if isinstance(self.choice, str) else tuple(self.choice)
            if not choice or any(not isinstance(c, str) or not c for c in choice):
                raise InvalidParam(
                    STRUCTURED, f"choice is a list of non-empty strings, got {self.choice!r:.200}"
                )
            for c in choice:
                _check_unicode(c, "a choice")
            object.__setattr__(self, "choice", choice)

    @property
    def kind(self) -> str:
        return next(
            name
            for name in ("json", "json_object", "regex", "choice", "grammar")
            if getattr(self, name) not in (None, False)
        )


def _check_unicode(text: str, name: str) -> None:
    """A constraint's text is handed to the grammar library as UTF-8: a lone surrogate
    (JSON's "\\ud800", or a command-line byte that is not UTF-8) is no character."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidParam(
            STRUCTURED,
            f"{name} holds {text[err.start]!r} at character {err.start}, which is not a "
            "character (a lone surrogate, or a byte that is not UTF-8)",
        ) from None


def _schema_text(schema: object) -> str:
    """The schema as compact JSON text. Text too deeply nested for Python's JSON reader,
    or holding an integer past its digit limit, is refused like any text that is not
    JSON (the grammar library reads no deeper than that either)."""
    try:
        if isinstance(schema, str):
            schema = json.loads(schema)
        if not isinstance(schema, dict):
            raise InvalidParam(
                STRUCTURED, f"a JSON schema is a JSON object, got {type(schema).__name__}"
            )
        check_integer_bounds(schema)
        return json.dumps(schema)
    except json.JSONDecodeError as err:
        raise InvalidParam(STRUCTURED, f"the JSON schema is not JSON: {err}") from None
    except RecursionError:
        raise InvalidParam(
            STRUCTURED, "the JSON schema is nested too deeply to read: flatten it"
        ) from None
    except ValueError as err:  # an integer of more digits than Python converts, a cycle
        if "integer string conversion" in str(err):
            err = f"it holds an integer longer than {sys.get_int_max_str_digits()} digits"
        raise InvalidParam(STRUCTURED, f"the JSON schema cannot be read: {err}") from None


INTEGER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
INT64 = (-(2**63), 2**63 - 1)  # the grammar library's integers (it clamps those past)


def check_integer_bounds(schema: dict) -> None:
    """Refuse an integer's bound outside the 64-bit range: the grammar library clamps it
    (a minimum of 1e30 would allow 9223372036854775807)."""
    stack: list[object] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        stack.extend(node.values())
        kind = node.get("type")
        if kind != "integer" and not (isinstance(kind, list) and "integer" in kind):
            continue
        for name in INTEGER_BOUNDS:
            bound = node.get(name)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool):
                if not INT64[0] <= bound <= INT64[1]:
                    raise InvalidParam(
                        STRUCTURED,
                        f"the JSON schema's integer {name} {bound} is outside the 64-bit "
                        f"range [{INT64[0]}, {INT64[1]}] the grammar library can honour",
                    )


@dataclass(frozen=True)
class SamplingParams:
    """Everything that belongs to one request (the engine's own settings live apart).

    The names follow the ones people know from vLLM and the OpenAI API.
    """

    max_tokens: int = 16  # new tokens at most
    temperature: float = 0.0  # 0 means greedy: argmax, no randomness
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all (-1 too: vLLM's "off")
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    seed: int | None = None  # with sampling: one seed, one output (None: a fresh one)
    stop: tuple[str, ...] = ()  # stop once the text contains one of these
    stop_token_ids: tuple[int, ...] = ()  # stop once one of these is sampled (it is kept)
    ignore_eos: bool = False  # go on past end-of-text (it is then an ordinary token)
    logprobs: int | None = None  # also report the log-probabilities of this many top tokens
    # hold the output to a JSON schema, a regex, a choice or a grammar (compiled and
    # matched in roseinfer/request/structured.py)
    structured_outputs: StructuredOutputs | None = None
    # completions of the prompt (vLLM's `n`): `LLM.generate` runs each as a request of its
    # own, choice i sampled with seed + i; the engine's add_request takes one (n=1)
    n: int = 1

    def choices(self) -> list[SamplingParams]:
        """One params of one completion (n=1) for each of the n choices; choice i is
        seeded seed + i, so that seeded choices differ and each can be redrawn alone."""
        if self.n == 1:
            return [self]
        return [
            replace(self, n=1, seed=None if self.seed is None else (self.seed + i) % (MAX_SEED + 1))
            for i in range(self.n)
        ]

    def __post_init__(self) -> None:
        # Accept a single stop string, lists and None, as the OpenAI API does; store tuples.
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids"))
        if not _is_int(self.n) or self.n < 1:
            raise InvalidParam("n", f"n must be an integer >= 1, got {self.n!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidParam(
                "max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"
            )
        if not _is_number(self.temperature) or not (0 <= self.temperature < math.inf):
            raise InvalidParam(
                "temperature",
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}",
            )
        if 0 < self.temperature < FLOAT32_TINY:
            raise InvalidParam(
                "temperature",
                f"temperature {self.temperature!r} is too small to sample with in float32 "
                f"(smallest: {FLOAT32_TINY:.2g}); use 0 for greedy",
            )
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidParam(
                "top_k", f"top_k must be an integer >= 0 (0 or -1 = off), got {self.top_k!r}"
            )
        if self.top_k == -1:  # vLLM's spelling of off: stored as rose's
            object.__setattr__(self, "top_k", 0)
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidParam("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_p < FLOAT32_TINY:
            raise InvalidParam(
                "top_p",
                f"top_p {self.top_p!r} is too small to compare in float32 "
                f"(smallest: {FLOAT32_TINY:.2g}); use top_k=1 for the single likeliest token",
            )
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise InvalidParam(
                "seed", f"seed must be an integer in [0, 2**64 - 1], got {self.seed!r}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidParam(
                "stop", f"stop strings must be non-empty strings, got {list(self.stop)!r:.200}"
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidParam(
                "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"
            )
        if max(map(len, self.stop), default=0) > MAX_STOP_LENGTH:
            raise InvalidParam(
                "stop",
                f"a stop string has {max(map(len, self.stop))} characters; "
                f"at most {MAX_STOP_LENGTH}",
            )
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise InvalidParam(
                "stop_token_ids",
                f"stop_token_ids must be token ids >= 0, got {list(self.stop_token_ids)!r}",
            )
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise InvalidParam(
                "logprobs",
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
            )

        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise InvalidParam(
                    STRUCTURED,
                    "structured_outputs is a StructuredOutputs, got "
                    f"{type(self.structured_outputs).__name__}",
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_tuple(value: object, name: str) -> tuple:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        raise InvalidParam(name, f"{name} must be a list, got {type(value).__name__}") from None


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
