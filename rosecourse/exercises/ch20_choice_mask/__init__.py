"""Chapter 20's exercise: the allowed-token mask of a choice constraint.

The learner's mask is graded against llguidance's, read through rose's GrammarMatcher,
on GPT-2's 50,257 tokens, on a small vocabulary whose end-of-text sits among the
others and on another whose end-of-text token is another one ("</s>") and whose tokens
run past a choice's end by half a character; then it replaces the library's mask in a constrained generation (a batch of
requests, each held to its own choices), whose tokens must be the library-masked runs'.

The library is asked with its forcing off (NO_FORCING): where a grammar leaves only one
text to write, llguidance by default allows only the first token of that text's usual
tokenization (see chapter 20), a refinement on top of the mask the contract describes.

The contract is the docstring of rosecourse/exercises/ch20_choice_mask/reference.py.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from unittest import mock

import numpy as np
import torch

import roseinfer.request.sampling
from rosecourse.demo import PROMPT
from rosecourse.exercises.answers import known_mistakes
from rosecourse.exercises.common import (
    CheckResult,
    Exercise,
    Outcomes,
    Probe,
    check,
    encoded,
    held_function,
    hold,
    oracle_model,
)
from roseinfer.loops.generate import generate, generate_batch
from roseinfer.request import grammar_process
from roseinfer.request.sampling_params import SamplingParams, StructuredOutputs
from roseinfer.request.structured import (
    Grammar,
    GrammarMatcher,
    allowed_tokens,
    choice_lark,
    compile_grammar,
)
from rosetrainer.tokenizer import Tokenizer

# llguidance's grammar option that turns its forcing off: the mask is every token whose
# bytes the grammar accepts.
NO_FORCING = '%llguidance { "no_forcing": true }\n'


@functools.cache
def tokenizer() -> Tokenizer:
    return Tokenizer("gpt2")


@functools.cache
def gpt2_vocab() -> tuple[bytes, ...]:
    """GPT-2's tokens as bytes, by id (the end-of-text token's are its name's)."""
    encoding = tokenizer().encoding
    return tuple(encoding.decode_single_token_bytes(t) for t in range(encoding.n_vocab))


# A small vocabulary: every byte alone (so any output can be spelled), tokens that write a
# choice in one piece or part of it, run past its end, hold half a character or start
# with a space, and the end-of-text token among them, not last.
SMALL_EOT = 5
SMALL_WORDS = [b"ye", b"yes", b"yess", b"es", b"no"]
SMALL_WORDS += [b"<|endoftext|>", b"nope", b"yes!", b" p", b" please", b"please"]
SMALL_WORDS += [b"caf", b"caf\xc3", b"\xc3\xa9", b"\xe6\x97", b"New", b" New", b" Y", b" York"]
SMALL_VOCAB = tuple(SMALL_WORDS + [bytes([b]) for b in range(256)])
assert SMALL_VOCAB[SMALL_EOT] == b"<|endoftext|>" and len(set(SMALL_VOCAB)) == len(SMALL_VOCAB)


# Another small vocabulary, whose end-of-text token is another one ("</s>", id 4) and
# where GPT-2's end-of-text name is an ordinary token; tokens that run past a choice's
# end by half a character ("no\xc3", "caf\xc3"): read with the half character dropped,
# they would look like a whole choice.
OTHER_EOT = 4
OTHER_WORDS = [b"caf", b"caf\xc3", b"\xc3\xa9", b"no\xc3", b"</s>", b"<|endoftext|>", b"yes", b"no"]
OTHER_VOCAB = tuple(OTHER_WORDS + [bytes([b]) for b in range(256)])
assert OTHER_VOCAB[OTHER_EOT] == b"</s>" and len(set(OTHER_VOCAB)) == len(OTHER_VOCAB)
# The small vocabularies by size (each size is one vocabulary's): (tokens, end-of-text).
SMALL_VOCABS = {
    len(SMALL_VOCAB): (SMALL_VOCAB, SMALL_EOT),
    len(OTHER_VOCAB): (OTHER_VOCAB, OTHER_EOT),
}


class _SmallTokenizer:
    """A small vocabulary as llguidance's TokenizerWrapper reads a tokenizer."""

    bos_token_id = None

    def __init__(self, vocab: tuple[bytes, ...], eot_id: int) -> None:
        self.vocab, self.eos_token_id = vocab, eot_id
        self.tokens, self.special_token_ids = list(vocab), [eot_id]

    def __call__(self, text: bytes) -> list[int]:
        # Byte by byte (the library calls it once, to learn that it takes bytes; with its
        # forcing off it tokenizes nothing else).
        return [self.vocab.index(bytes([b])) for b in text]


def own_grammars() -> contextlib.AbstractContextManager:
    """rose compiling only the check's own grammars: without the worker process that first
    compiles a request's constraint where a crash or a runaway costs only that constraint
    (roseinfer/request/grammar_process.py), which guards a server against hostile ones and
    here would only start a Python process to compile these again."""
    return mock.patch.object(grammar_process.pool, "check", lambda *args: None)


@functools.cache
def library_grammar(vocab_size: int, choices: tuple[str, ...]) -> Grammar:
    """The choices compiled by llguidance, forcing off, for GPT-2's vocabulary (as rose
    compiles any request's constraint) or for a small one (SMALL_VOCABS)."""
    text = NO_FORCING + choice_lark(choices)
    if vocab_size == len(gpt2_vocab()):
        with own_grammars():
            return compile_grammar(StructuredOutputs(grammar=text), tokenizer())
    assert vocab_size in SMALL_VOCABS, "the library's mask is known for three vocabularies"
    import llguidance

    wrapped = llguidance.TokenizerWrapper(_SmallTokenizer(*SMALL_VOCABS[vocab_size]))
    small = llguidance.LLTokenizer(wrapped)
    grammar = llguidance.LLMatcher.grammar_from_lark(text)
    return Grammar(grammar, llguidance.LLMatcher(small, grammar, log_level=0), small, False)


def library_mask(
    vocab: list[bytes], choices: list[str], prefix: bytes, eot_id: int
) -> torch.Tensor:
    """The library's mask where the contract asks for the learner's: a matcher fed the
    prefix one byte-token at a time (any spelling of the same bytes gives the same mask)."""
    grammar = library_grammar(len(vocab), tuple(choices))
    assert grammar.tokenizer.eos_token == eot_id
    byte_ids = {token: t for t, token in enumerate(vocab) if len(token) == 1 and t != eot_id}
    matcher = GrammarMatcher(grammar)
    for byte in prefix:
        matcher.advance(byte_ids[bytes([byte])])
    return torch.from_numpy(allowed_tokens([matcher], len(vocab))[0])


# -- probes: the mask as the set of tokens it allows, each written as its text -------------


def token_label(vocab: tuple[bytes, ...], t: int, eot_id: int) -> str:
    if t == eot_id:
        return "<end-of-text>"
    try:
        return repr(vocab[t].decode("utf-8"))
    except UnicodeDecodeError:
        return repr(vocab[t])  # part of a character: its bytes


def allowed_set(mask: object, vocab: tuple[bytes, ...], eot_id: int) -> object:
    """The tokens a mask allows, by their text; or what is wrong with the mask's form."""
    if not isinstance(mask, torch.Tensor):
        return f"a {type(mask).__name__}, not a tensor"
    if tuple(mask.shape) != (len(vocab),):
        return f"a tensor of shape {tuple(mask.shape)}, not ({len(vocab)},)"
    if mask.dtype != torch.bool:
        return f"a tensor of {mask.dtype}, not torch.bool"
    return frozenset(token_label(vocab, t, eot_id) for t in mask.nonzero().flatten().tolist())


YES = ["yes", "yes please", "no"]  # one choice the beginning of another
UNICODE = ["café", "cafe", "日本", "日曜"]  # characters of two and three bytes
CITIES = [" New York", " New Jersey", " Newark"]  # space-led tokens
QUOTED = ['say "hi"', "a\\b"]  # what a grammar must escape
GPT2_CASES = [
    (YES, b""),
    (YES, b"y"),
    (YES, b"yes"),
    (YES, b"yes "),
    (YES, b"yes please"),
    (UNICODE, b"caf"),
    (UNICODE, b"caf\xc3"),
    (UNICODE, b"\xe6\x97"),
    (UNICODE, b"\xe6\x97\xa5"),
    (CITIES, b""),
    (CITIES, b" New"),
    (CITIES, b" New J"),
    (QUOTED, b""),
]
SMALL_CASES = [
    (["yes", "yes!", "nope"], b""),
    (["yes", "yes!", "nope"], b"y"),
    (["yes", "yes!", "nope"], b"yes"),
    (["yes", "yes please"], b"yes "),
    (["café", "cafe"], b"caf"),
    (["café", "cafe"], b"caf\xc3"),
    (["New", " New York"], b""),
    (["New", " New York"], b" New"),
]


OTHER_CASES = [
    (["caf", "cafe"], b""),  # "caf\xc3" runs past "caf" by half a character
    (["no", "nope"], b""),
    (["caf", "café"], b"caf"),
    (["caf", "café"], b"caf\xc3"),  # not a whole choice: no end-of-text
    (["yes", "no"], b"yes"),  # end-of-text is "</s>" here
]


def _probe(fn: Callable) -> Probe:
    """The tokens `fn` allows in each case, computed as they are read (Outcomes), the
    small vocabularies' cases first: a known wrong answer's masks over GPT-2's 50,257
    tokens, in Python, are the costliest part of a failing check, and most are told
    from the learner's answer by a small vocabulary's case, before any is made."""
    calls: dict[str, Callable[[], object]] = {}
    vocabularies = [
        ("SMALL_VOCAB", SMALL_VOCAB, SMALL_EOT, SMALL_CASES),
        ("OTHER_VOCAB", OTHER_VOCAB, OTHER_EOT, OTHER_CASES),
        ("GPT2_VOCAB", gpt2_vocab(), tokenizer().eot_id, GPT2_CASES),
    ]
    for name, vocab, eot_id, cases in vocabularies:
        for choices, prefix in cases:
            call = f"choice_mask({name}, {choices!r}, {prefix!r}, eot_id={eot_id})"
            # (a copy of the vocabulary each call: a function that changes it changes
            # nothing for the next)
            calls[call] = lambda v=vocab, c=choices, p=prefix, e=eot_id: allowed_set(
                fn(list(v), list(c), p, e), v, e
            )
    return Outcomes(calls)


# -- runs: the learner's mask in place of the library's, in a batch of constrained requests --

# The first request's greedy output is "yes", ended by end-of-text where it could go on.
RUN_REQUESTS = [
    ("Reply:", ["yes", "yes please", "no", "nope"]),
    (PROMPT, ["café", "cafe", "日本", "🌹🌹"]),
    ("The city is", CITIES),
]
RUN_MAX_TOKENS = 12


def _params(choices: list[str]) -> SamplingParams:
    # Forcing off, as in the probes: the library's mask is the contract's.
    constraint = StructuredOutputs(grammar=NO_FORCING + choice_lark(choices))
    return SamplingParams(max_tokens=RUN_MAX_TOKENS, structured_outputs=constraint)


def _masks_of(fn: Callable) -> Callable:
    """rose's `allowed_tokens` (the batch's masks), each row's mask made by `fn`."""
    choices_of = {library_grammar(len(gpt2_vocab()), tuple(c)).text: c for _, c in RUN_REQUESTS}

    def masks(matchers: list[GrammarMatcher], width: int, tokens_left=None) -> np.ndarray:
        vocab = gpt2_vocab()
        rows = []
        for matcher in matchers:
            prefix = b"".join(vocab[t] for t in matcher.tokens)
            choices = choices_of[matcher.grammar.text]
            mask = fn(list(vocab), list(choices), prefix, tokenizer().eot_id)
            if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool):
                raise TypeError("choice_mask must return a bool tensor")
            if tuple(mask.shape) != (width,):
                raise ValueError(f"choice_mask gave shape {tuple(mask.shape)}, not ({width},)")
            rows.append(mask.numpy())
        return np.stack(rows)

    return masks


@functools.cache
def _library_run(prompt: str, choices: tuple[str, ...]) -> tuple[int, ...]:
    """One request alone, uncached, masked by the library."""
    with own_grammars():
        run = generate(
            oracle_model(),
            list(encoded(prompt)),
            _params(list(choices)),
            use_cache=False,
            eot_id=tokenizer().eot_id,
            tokenizer=tokenizer(),
        )
    return tuple(run.token_ids)


def _runs() -> list[tuple[str, Callable, Callable]]:
    def expected() -> list[tuple[int, ...]]:
        return [_library_run(prompt, tuple(choices)) for prompt, choices in RUN_REQUESTS]

    def go(on_token: Callable[[int, int], None]) -> list[list[int]]:
        masks = _masks_of(held_function())
        with own_grammars(), mock.patch.object(roseinfer.request.sampling, "allowed_tokens", masks):
            runs = generate_batch(
                oracle_model(),
                [list(encoded(prompt)) for prompt, _ in RUN_REQUESTS],
                [_params(choices) for _, choices in RUN_REQUESTS],
                eot_id=tokenizer().eot_id,
                tokenizer=tokenizer(),
                on_token=on_token,
            )
        return [run.token_ids for run in runs]

    label = f"a cached batch of {len(RUN_REQUESTS)} requests, each held to its own choices"
    return [(label, expected, go)]


# -- known wrong answers --------------------------------------------------------------------


EXERCISE = Exercise(
    name="choice_mask",
    reference=library_mask,
    probe=_probe,
    swapped_in=hold,
    runs=_runs(),
    known_wrong=known_mistakes(__name__),
    fallback="it allows a different set of tokens than the choices leave open",
)


def check_choice_mask(fn: Callable) -> CheckResult:
    """Chapter 20: `choice_mask(vocab, choices, prefix, eot_id) -> mask` over the vocabulary."""
    return check(EXERCISE, fn)
