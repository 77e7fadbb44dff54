"""Structured output: a request's text held to a JSON schema, a regex, a list of choices
or a grammar, by a mask over the vocabulary at every step.

Reading order:

* `StructuredOutputs` (roseinfer/request/sampling_params.py, beside the rest of what a
  request asks for): one of json, json_object, regex, choice, grammar, checked when it
  is made; it rides in `SamplingParams.structured_outputs`.
* `compile_grammar`: the constraint -> a `Grammar` for one tokenizer, through llguidance
  (https://github.com/guidance-ai/llguidance). Compiling walks the grammar's lexer over
  the whole token trie once, so a step later costs microseconds; a compiled grammar is
  kept (a bounded LRU, by tokenizer and grammar) and reused by every request that asks
  for it. A constraint is compiled first in a worker process
  (roseinfer/request/grammar_process.py), which a crash of the library ends alone and
  which is killed past COMPILE_TIMEOUT_S; one the library refuses, that crashes it, that
  runs past the bound or that accepts no text (`first_steps`) raises `InvalidParam`
  with the reason: the server compiles at admission, in its request handler, so a bad
  schema is that request's 400 and never reaches the engine.
* `GrammarMatcher`: one request's position in its grammar. `Sequence.append_token` is
  the only caller of `advance` (so a speculative verify step, which appends only the
  accepted tokens, keeps it in step with the output); `allowed_tokens` fills the masks
  of a batch of them at once (roseinfer/request/sampling.py applies them);
  `allowed_prefix` looks ahead through a speculative draft and comes back, so drafts
  the grammar forbids are cut before the target verifies them.

Three traps closed here, all reported against other engines:

* whitespace: JSON allows any amount between tokens, and a model that likes whitespace
  (a random one, a weak one) can spend all of max_tokens on it. Here a JSON constraint
  allows at most JSON_WHITESPACE_MAX whitespace characters in a row, and the schema's
  own `x-guidance` settings cannot lift that bound.
* a value without end: inside a string almost every token is allowed and few end it,
  and a number's digits need never stop, so a weak model's JSON is often cut by
  max_tokens, and does not parse. Near max_tokens a JSON output is closed instead: the
  shortest text that makes it whole (`json_closing`) is forced once it is due
  (`GrammarMatcher.closing_token`).
* a pathological schema (huge enums, deeply nested $refs, regexes whose automaton
  explodes): the library's parser limits bound its work, the compile runs first in a
  process that can crash or be killed alone, and a step's masks are bounded in time
  (`fill_masks`), so no request stalls the others.

llguidance is imported on first use (it is the `[structured]` extra): a request without
structured output never needs it.
"""

from __future__ import annotations

import functools
import json
import queue
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from roseinfer.request.sampling_params import STRUCTURED as PARAM
from roseinfer.request.sampling_params import InvalidParam, StructuredOutputs
from roseinfer.request.schema_cycles import dead_schema
from rosetrainer.errors import RoseError

if TYPE_CHECKING:
    import llguidance

    from rosetrainer.tokenizer import Tokenizer

# At most this many whitespace characters between two JSON tokens (enough for a
# newline and a little indentation; never a loop).
JSON_WHITESPACE_MAX = 4
# llguidance's JSON settings, applied over the schema's own `x-guidance` ones: separators
# without whitespace of their own, whitespace bounded as above.
JSON_OVERRIDES = {
    "item_separator": ",",
    "key_separator": ":",
    "whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{1,{JSON_WHITESPACE_MAX}}}",
}
# A JSON output is closed (`GrammarMatcher.closing_token`) when the tokens that close it
# come within CLOSING_MARGIN of the tokens left; looked for in the last CLOSING_WITHIN.
CLOSING_MARGIN = 4
CLOSING_WITHIN = 64
COMPILE_TIMEOUT_S = 10.0  # a constraint that compiles longer than this is refused
# Masks checked at compile time along the text a grammar forces before any choice.
FORCED_STEPS = 16
# The longest a batch's masks may take in one step (`fill_masks`): a request whose mask
# takes longer is stopped, so that it does not hold up the others.
MASK_TIMEOUT_S = 2.0
HELPER_IDLE_S = 60.0  # a mask helper with nothing to do this long ends
CACHE_SIZE = 64  # compiled grammars kept after their last request finished
# llguidance's parser holds at most this many items in a row (LLParserLimits'
# max_items_in_row): a rule of as many alternatives or more fails at its first token.
MAX_ALTERNATIVES = 2000
# Tokens tried on copies of the matcher at the first choice (`first_steps`).
PROBE_TOKENS = 8


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.tiktoken
    except ImportError:
        raise RoseError(
            "structured outputs need llguidance: pip install 'rose[structured]'"
        ) from None
    return llguidance


def grammar_text(spec: StructuredOutputs) -> str:
    """The constraint in llguidance's grammar format (what is compiled and cached)."""
    LLMatcher = _llguidance().LLMatcher
    if spec.json is not None or spec.json_object:
        schema = spec.json if spec.json is not None else '{"type": "object"}'
        try:
            return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OVERRIDES)
        except ValueError as err:
            raise InvalidParam(PARAM, f"invalid JSON schema: {err}") from None
    if spec.regex is not None:
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return LLMatcher.grammar_from_lark(choice_lark(spec.choice))
    check_alternatives(spec.grammar)
    return LLMatcher.grammar_from_lark(spec.grammar)


def check_alternatives(lark: str) -> None:
    """Refuse a Lark rule of MAX_ALTERNATIVES alternatives or more: it compiles, and the
    library's parser fails at its first token (a row over its item limit)."""
    rule, count = "", 0
    for line in lark.splitlines():
        head = re.match(r"\s*[?!]?([A-Za-z_][A-Za-z_0-9]*)(\.-?\d+)?\s*:", line)
        if head and not line[: head.start(1)].strip(" \t?!"):
            rule, count = head.group(1), 1
            line = line[head.end() :]
        elif not line.strip() or line.lstrip().startswith("//"):
            continue
        elif not line[:1].isspace() and not line.lstrip().startswith("|"):
            rule, count = "", 0  # (a directive ends a rule)
            continue
        if not rule:
            continue
        count += _top_level_bars(line)
        if count >= MAX_ALTERNATIVES:
            raise InvalidParam(
                PARAM,
                f"invalid constraint: rule {rule!r} has {MAX_ALTERNATIVES} alternatives or "
                f"more; the grammar library allows fewer (match them with one regex instead)",
            )


def _top_level_bars(text: str) -> int:
    """The `|` in one line of a Lark rule outside strings, regexes, groups and comments."""
    bars = depth = 0
    i = 0
    while i < len(text):
        c = text[i]
        if text.startswith("//", i):
            break
        if c in '"/':  # a string or a regex: skip to its unescaped end
            i += 1
            while i < len(text) and text[i] != c:
                i += 2 if text[i] == "\\" else 1
        elif c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == "|" and depth == 0:
            bars += 1
        i += 1
    return bars


def choice_lark(choices: Sequence[str]) -> str:
    """A choice constraint as a Lark grammar: one terminal, one alternative per choice.

    A terminal, not a rule of alternatives: the lexer reads any number of them as one
    automaton, where the parser holds one item per alternative in a row and gives up
    past 2,000 (a choice of 10,000 strings failed at its first token). The masks are
    the same either way."""
    # Lark string literals read JSON's escapes, so json.dumps quotes any choice.
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices)


# ---------------------------------------------------------------------------
# Compiling, with a bound on time and a cache
# ---------------------------------------------------------------------------


class Grammar:
    """A compiled constraint for one tokenizer: a matcher at the start, copied per request."""

    def __init__(
        self,
        text: str,
        start: llguidance.LLMatcher,
        tokenizer: llguidance.LLTokenizer,
        is_json: bool,
    ) -> None:
        self.text = text
        self.start = start
        self.tokenizer = tokenizer
        self.n_vocab = tokenizer.vocab_size  # the mask's width
        self.is_json = is_json  # a JSON schema or object: closed before max_tokens


@functools.cache
def ll_tokenizer(name: str) -> llguidance.LLTokenizer:
    """llguidance's view of a tiktoken encoding: every token's bytes, in a trie (built
    once per encoding: a noticeable pause for GPT-2's 50,257 tokens, paid once)."""
    from rosetrainer.tokenizer import get_encoding

    return _llguidance().tiktoken.lltokenizer_from_encoding(get_encoding(name))


_lock = threading.Lock()
_recent: OrderedDict[tuple[str, str], Grammar] = OrderedDict()  # the LRU
# Every grammar a live request (or a handler about to admit one) holds, however old: the
# engine finds the one its handler compiled even if the LRU has dropped it since.
_held: weakref.WeakValueDictionary[tuple[str, str], Grammar] = weakref.WeakValueDictionary()


def compile_grammar(
    spec: StructuredOutputs,
    tokenizer: Tokenizer,
    timeout_s: float = COMPILE_TIMEOUT_S,
    abandoned: threading.Event | None = None,
) -> Grammar:
    """`spec` compiled for `tokenizer`'s vocabulary, from the cache when it is there.

    Raises InvalidParam naming the library's reason when the constraint is invalid, when
    it accepts no text (`check_compile`), when compiling it crashes the library or takes
    longer than `timeout_s`: it is compiled first in a worker process, which dies alone
    or is killed (roseinfer/request/grammar_process.py), then here. `abandoned`: see
    grammar_for.
    """
    from roseinfer.request.grammar_process import pool

    if not hasattr(tokenizer, "encoding"):  # a Hugging Face folder's tokenizer.json
        raise InvalidParam(
            PARAM,
            "structured outputs need a tiktoken tokenizer (llguidance reads its table); this "
            "model brings a Hugging Face tokenizer.json",
        )
    text = grammar_text(spec)
    grammar = cached_grammar(tokenizer.name, text)
    if grammar is not None:
        return grammar
    if spec.json is not None:  # (a schema that refers to itself without end: before the library)
        dead = dead_schema(json.loads(spec.json))
        if dead is not None:
            raise InvalidParam(PARAM, f"invalid JSON schema: {dead}")
    pool.check(tokenizer.name, text, spec.kind, timeout_s, abandoned)
    grammar = _compile(tokenizer.name, text, spec.json is not None or spec.json_object)
    key = (tokenizer.name, text)
    with _lock:
        _recent[key] = _held[key] = grammar
        while len(_recent) > CACHE_SIZE:
            _recent.popitem(last=False)
    return grammar


def cached_grammar(tokenizer_name: str, text: str) -> Grammar | None:
    """The grammar `text` (`grammar_text`) compiled for this tokenizer, if it is cached
    or held: found at once, never compiled here."""
    key = (tokenizer_name, text)
    with _lock:
        grammar = _held.get(key) or _recent.get(key)
        if grammar is not None:
            _recent[key] = grammar
            _recent.move_to_end(key)
        return grammar


def _compile(tokenizer_name: str, text: str, is_json: bool) -> Grammar:
    """The grammar, compiled in this process (once the worker has compiled it)."""
    return Grammar(text, _matcher(tokenizer_name, text), ll_tokenizer(tokenizer_name), is_json)


def _matcher(tokenizer_name: str, text: str) -> llguidance.LLMatcher:
    # log_level 0: the library's warnings would go to stderr; its errors come back here.
    start = _llguidance().LLMatcher(ll_tokenizer(tokenizer_name), text, log_level=0)
    if start.is_error():
        raise InvalidParam(PARAM, f"invalid constraint: {one_line(start.get_error())}")
    return start


def check_compile(tokenizer_name: str, text: str) -> None:
    """What the worker process runs: compile, then `first_steps`; InvalidParam names
    what is wrong."""
    first_steps(_matcher(tokenizer_name, text), ll_tokenizer(tokenizer_name))


def first_steps(start: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer) -> None:
    """Raise InvalidParam when the grammar fails before the model has a choice to make:
    its first mask, then each mask along the text it forces (up to FORCED_STEPS).

    A grammar that accepts no text (a rule that derives only itself, the regex
    `[^\\s\\S]`) compiles, and its first mask leaves the matcher in error, allowing
    end-of-text alone: a request would end at once, reported complete ("stop") with
    text the grammar never accepted. The library's own limits (a parser row of more
    than its items) show there too, not at the first token of a request.
    """
    matcher = start.deep_copy()
    bits = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.int32)
    for _ in range(FORCED_STEPS):
        matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        if matcher.is_error():
            raise InvalidParam(PARAM, f"invalid constraint: {failure(matcher.get_error())}")
        forced = matcher.compute_ff_bytes()
        if not forced:
            probe_tokens(matcher, bits)
            return
        if not matcher.consume_tokens(tokenizer.tokenize_bytes(forced)):
            return


def probe_tokens(matcher: llguidance.LLMatcher, bits: np.ndarray) -> None:
    """Consume a few of the allowed tokens, each on a copy: a grammar over the parser's
    limits (a rule of too many alternatives) passes its first mask and fails only here."""
    allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
    for token in allowed[:PROBE_TOKENS]:
        probe = matcher.deep_copy()
        probe.consume_token(int(token))
        if probe.is_error() and "Parser Error" in probe.get_error():
            raise InvalidParam(PARAM, f"invalid constraint: {failure(probe.get_error())}")


def failure(reason: str) -> str:
    """The library's reason a matcher failed, on one line; a grammar left with no way
    on (its "no extension" state) said in words."""
    first = next(iter(reason.splitlines()), "")
    if first.strip() == "NoExtensionBias":
        return (
            "it accepts no text here: a rule or $ref that refers only to itself, or a "
            "pattern that matches nothing"
        )
    return one_line(reason)


def one_line(reason: str) -> str:
    """The library's message on one line: its text, without the source excerpt and the
    carets it draws under it."""
    kept = []
    for line in reason.splitlines():
        line = line.strip()
        if line and set(line) - {"^", " "} and not re.match(r"\d+ \|", line):
            kept.append(line)
    return " ".join(kept)


def grammar_for(
    spec: StructuredOutputs | None,
    tokenizer: Tokenizer | None,
    vocab_size: int,
    abandoned: threading.Event | None = None,
) -> Grammar | None:
    """A request's constraint compiled (None: unconstrained), for a model whose logits
    have `vocab_size` entries. abandoned: set when nobody waits for it any more (a
    compile still waiting for a worker then gives up: grammar_process.Abandoned)."""
    if spec is None:
        return None
    check_vocabulary(tokenizer, vocab_size)
    return compile_grammar(spec, tokenizer, abandoned=abandoned)


def check_vocabulary(tokenizer: Tokenizer | None, vocab_size: int) -> None:
    """Raise RoseError unless a model with `vocab_size` logits can follow constraints
    spelled in `tokenizer`'s tokens."""
    if tokenizer is None:
        raise RoseError("structured outputs need the tokenizer: its vocabulary is the mask's")
    if vocab_size < tokenizer.n_vocab:
        # The library spells a forced string with the tokenizer's own tokens ("name", not
        # n-a-m-e): a model without them could not follow the grammar.
        raise RoseError(
            f"structured outputs need a model with the whole vocabulary of its tokenizer "
            f"({tokenizer.n_vocab} tokens); this one has {vocab_size}"
        )


def clear_cache() -> None:
    """Forget every compiled grammar (the benchmark's first compile); requests that hold
    one keep it."""
    with _lock:
        _recent.clear()
        _held.clear()


# ---------------------------------------------------------------------------
# One request's matcher, and a batch's masks
# ---------------------------------------------------------------------------


class GrammarMatcher:
    """Where one request stands in its grammar: which tokens may come next, and whether
    it is complete. Its state is the request's output so far, token for token."""

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self.matcher = grammar.start.deep_copy()
        self.tokens: list[int] = []  # consumed: its output (and an end-of-text that ended it)
        self.closing: list[int] = []  # the tokens that close its JSON, once they must come
        self.late = False  # a mask of it ran past MASK_TIMEOUT_S (`fill_masks`)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def advance(self, token_id: int) -> None:
        """Consume one token the request took; a token the grammar forbids raises."""
        if not self.matcher.consume_token(token_id):
            raise RoseError(f"token {token_id} breaks the grammar: {self.error}")
        self.tokens.append(token_id)
        if self.closing:
            self.closing = self.closing[1:] if self.closing[0] == token_id else []

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` tokens (a rejected draft's, say)."""
        if not 0 <= num_tokens <= self.num_tokens or not self.matcher.rollback(num_tokens):
            raise RoseError(
                f"cannot roll back {num_tokens} of {self.num_tokens} tokens: {self.error}"
            )
        del self.tokens[len(self.tokens) - num_tokens :]
        self.closing = []  # planned for a longer output: planned again when needed

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the first, the grammar allows in a row from here
        (speculative decoding's drafts are cut there); the matcher is left as it was.

        The library's state is advanced through the tokens up to the first one it
        forbids (or past which the grammar is complete), then rolled back by as many.
        Neither `tokens` nor the closing plan is touched: this is a look ahead, not
        output (a plan forgotten here would be made again at another step than the
        plain run makes it).
        """
        consumed = self.matcher.try_consume_tokens(tokens)
        if consumed and not self.matcher.rollback(consumed):
            raise RoseError(f"cannot roll back {consumed} looked-ahead tokens: {self.error}")
        return consumed

    def fork(self) -> GrammarMatcher:
        """A copy at this one's state, to write ahead with (a draft model's drafts):
        advancing it leaves this one, and the request's output, alone."""
        fork = GrammarMatcher.__new__(GrammarMatcher)
        fork.grammar, fork.matcher = self.grammar, self.matcher.deep_copy()
        fork.tokens, fork.closing, fork.late = list(self.tokens), [], False
        return fork

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write which tokens may come next into `out`: int32, one bit per token id
        (32 ids a word, the lowest bit first), as wide as the tokenizer's vocabulary."""
        if self.late:  # (its library state is still in a helper's hands)
            raise RoseError(self.late_error)
        if self.matcher.is_error():
            raise RoseError(f"the grammar matcher failed: {failure(self.matcher.get_error())}")
        # (the library writes through a raw pointer: the buffer must be what it expects)
        if (
            out.dtype != np.int32
            or not out.flags.c_contiguous
            or out.size * 32 < self.grammar.n_vocab
        ):
            raise RoseError(f"the mask is {self.grammar.n_vocab} bits in contiguous int32 words")
        self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if self.matcher.is_error():
            # No way on (the grammar leads into a rule that derives nothing, past what
            # the compile-time check could see): the request fails, never "stop" with
            # text the grammar does not accept.
            raise RoseError(
                f"the grammar allows no next token: {failure(self.matcher.get_error())}"
            )

    @property
    def late_error(self) -> str:
        return (
            f"the constraint's mask took longer than {MASK_TIMEOUT_S:g} s to compute: "
            "the request is stopped so that it does not hold up the others (simplify it)"
        )

    def closing_token(self, tokens_left: int) -> int | None:
        """The token that must come next so that the JSON is closed within `tokens_left`
        tokens, or None while the model may still choose (or when no closing fits).

        A JSON output cut by max_tokens does not parse. So once the shortest text that
        closes it (`json_closing`), in tokens, is within CLOSING_MARGIN of the tokens
        left, those tokens are planned and forced one by one; the margin covers a token
        that opens several values at once. A schema that does not take the closing text
        (its values are not numbers, say) is left to run to "length".
        """
        if self.closing:
            return self.closing[0]
        if tokens_left > CLOSING_WITHIN or not self.grammar.is_json:
            return None
        text = self.grammar.tokenizer.decode_bytes(self.tokens).decode("utf-8", "replace")
        suffix = json_closing(text)
        if suffix is None:
            return None
        plan = self.grammar.tokenizer.tokenize_str(suffix)
        trial = self.matcher.deep_copy()
        if not (trial.consume_tokens(plan) and trial.is_accepting()):
            return None
        if not trial.is_stopped():  # a value that could go on (a number): end-of-text ends it
            plan.append(self.grammar.tokenizer.eos_token)
        if len(plan) + CLOSING_MARGIN < tokens_left:
            return None  # room enough: the model writes on
        self.closing = plan
        return plan[0]

    @property
    def error(self) -> str:
        """The library's error, its first line (the rest dumps the parser's state)."""
        return next(iter(self.matcher.get_error().splitlines()), "")

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and takes no further token (end-of-text aside)."""
        return self.matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The output so far is a whole match (it could end here, or go on)."""
        return self.matcher.is_accepting()


def allowed_tokens(
    matchers: list[GrammarMatcher], width: int, tokens_left: list[int] | None = None
) -> np.ndarray:
    """(len(matchers), width) bool: which token ids each matcher allows next.

    `width` is the logits' (a model may pad its vocabulary past the tokenizer's, as
    GPT-2 checkpoints trained at 50,304 do): ids the tokenizer does not have are never
    allowed. The library writes one bit per token (32 tokens per int32 word); numpy
    unpacks them in token order. tokens_left: each request's tokens until max_tokens; a
    JSON output that must close now allows only its closing token (`closing_token`).
    """
    n_vocab = matchers[0].grammar.n_vocab
    words = (n_vocab + 31) // 32
    bits = np.zeros((len(matchers), words), dtype=np.int32)
    if any(m.grammar.n_vocab != n_vocab for m in matchers):
        raise RoseError("the requests of one batch share one tokenizer")
    fill_masks(matchers, bits)
    unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
    allowed = np.zeros((len(matchers), width), dtype=bool)
    known = min(width, n_vocab)
    allowed[:, :known] = unpacked[:, :known]
    for row, left in enumerate(tokens_left or ()):
        forced = matchers[row].closing_token(left)
        if forced is not None:
            allowed[row] = False
            allowed[row, forced] = True
    return allowed


def fill_masks(matchers: list[GrammarMatcher], bits: np.ndarray) -> None:
    """Each matcher's mask into its row of `bits`, within MASK_TIMEOUT_S.

    A mask usually takes microseconds, but its cost is the grammar's, and a request
    chooses its grammar: the regex `a{100000}` compiles at once and then takes seconds
    for every mask, and the engine thread, computing it, held every other request up as
    long. So the rows are filled one after another on a helper thread (one handoff a
    step, not one a row: a mask costs less than a handoff), and the caller waits for
    them at most MASK_TIMEOUT_S. Past it, the matcher being filled is marked late and
    this raises; the engine then fails that request alone (its other rows are filled
    again, each by itself) and the others keep their step. The library's call cannot
    be interrupted: the helper finishes that one mask, then ends, and the next batch
    gets a new helper. A late matcher raises at once ever after.
    """
    job = MaskJob(matchers, bits)
    helper = getattr(_helpers, "helper", None)
    if helper is None or not helper.take(job):
        helper = _helpers.helper = MaskHelper()
        helper.take(job)
    if not job.done.wait(MASK_TIMEOUT_S):
        with job.lock:
            job.abandoned = True
            row = job.row
        if not job.done.is_set():
            _helpers.helper = None  # busy with the late mask until it ends
            matchers[row].late = True
            raise RoseError(matchers[row].late_error)
    if job.error is not None:
        raise job.error


class MaskHelper:
    """A thread that fills batches of masks (`fill_masks`); one per calling thread, so
    that one engine's late mask is never another's wait. Idle for HELPER_IDLE_S, it
    ends (a thread that stopped asking, an engine gone, leaves no thread behind)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[MaskJob] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.alive = True  # takes jobs
        threading.Thread(target=self._run, name="grammar-masks", daemon=True).start()

    def take(self, job: MaskJob) -> bool:
        """Queue `job`; False when this helper has ended (or is ending)."""
        with self.lock:
            if self.alive:
                self.jobs.put(job)
            return self.alive

    def _run(self) -> None:
        while True:
            try:
                job = self.jobs.get(timeout=HELPER_IDLE_S)
            except queue.Empty:
                with self.lock:
                    if self.jobs.empty():
                        self.alive = False
                        return
                continue
            job.run()
            if job.abandoned:  # given up on: a new helper has the next batch
                with self.lock:
                    self.alive = False
                return


class MaskJob:
    def __init__(self, matchers: list[GrammarMatcher], bits: np.ndarray) -> None:
        self.matchers, self.bits = matchers, bits
        self.row = 0  # the row being filled
        self.abandoned = False  # the caller stopped waiting: fill no further row
        self.error: BaseException | None = None
        self.lock, self.done = threading.Lock(), threading.Event()

    def run(self) -> None:
        try:
            for row, matcher in enumerate(self.matchers):
                with self.lock:
                    if self.abandoned:
                        return
                    self.row = row
                matcher.fill_bitmask(self.bits[row])
        except BaseException as err:  # (raised in the caller's thread)
            self.error = err
        finally:
            self.done.set()


_helpers = threading.local()


def json_closing(text: str) -> str | None:
    """The shortest text that makes `text`, the start of a JSON object, whole: it ends
    an open string (and its escape), number or literal, gives a key its value (0), and
    closes every open object and array. None when `text` is not read as JSON here.
    """
    if not text.strip():
        return "{}"
    stack: list[str] = []  # the open objects and arrays, outermost first
    expect = "value"  # what comes next: value, key, colon, more (a comma or a close)
    in_string, is_key, escape, word = False, False, "", ""
    for ch in text:
        if in_string:
            if escape:  # "\\" then one letter, or "\\u" then four hex digits
                escape = "" if escape == "\\" and ch != "u" else escape + ch
                escape = "" if len(escape) == 6 else escape
            elif ch == "\\":
                escape = "\\"
            elif ch == '"':
                in_string, expect = False, "colon" if is_key else "more"
            continue
        if word:  # a number or true/false/null, until a character that ends it
            if ch.isalnum() or ch in "+-.":
                word += ch
                continue
            word, expect = "", "more"
        if ch.isspace():
            continue
        if ch == '"':
            in_string, is_key = True, expect == "key"
        elif ch in "{[":
            stack.append(ch)
            expect = "key" if ch == "{" else "value"
        elif ch in "}]":
            if not stack:
                return None
            stack.pop()
            expect = "more"
        elif ch == ":":
            expect = "value"
        elif ch == ",":
            if not stack:
                return None
            expect = "key" if stack[-1] == "{" else "value"
        else:
            word = ch
    # An empty object or array closes as it is; a key or a comma needs its value.
    just_opened = not in_string and not word and text.rstrip()[-1:] in ("{", "[")
    suffix = ""
    if in_string:
        if escape:
            suffix += "n" if escape == "\\" else "0" * (6 - len(escape))
        suffix += '"'
        expect = "colon" if is_key else "more"
    elif word:
        suffix += _finish_word(word)
        expect = "more"
    if not just_opened:
        suffix += {"key": '"":0', "colon": ":0", "value": "0", "more": ""}[expect]
    return suffix + "".join("}" if c == "{" else "]" for c in reversed(stack))


def _finish_word(word: str) -> str:
    """What ends a number or a literal begun as `word`."""
    for literal in ("true", "false", "null"):
        if literal.startswith(word):
            return literal[len(word) :]
    return "0" if word[-1] in "+-.eE" else ""
