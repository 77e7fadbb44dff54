"""Build (chapter 19): the verify-and-rollback step, graded against the oracle.

Contract: rosecourse/builds/verify/reference.py. The learner's cache runs inside rose's GPT
(the chapters' random strong-oracle model): passes of k + 1 tokens after a past, and
passes of which some tokens are rolled back, each row's logits held to the uncached
oracle's by rose's one tolerance rule (rosetrainer/numerics.py). The learner's greedy
verify step runs on rose's own caches (so it is graded on its own) in a loop the grader
drives: with rose's prompt-lookup drafter for k = 1..8, with rose's self-draft on a static
cache, and with drafts scripted to be rejected at every place (and all kept); every token
must be the uncached greedy run's, each call must run the target once and return the
drafts it agrees with and one token more, and after every call the cache must hold
exactly the text but its newest token.

The sampled rule and the sampled verify step are held to their exact law (`law`): seeded
outcomes counted against it, an outcome the law rules out failing at once and the rest
by a chi-square test (its p-value at least P_VALUE). The rule on drafts that disagree
with the target and on deterministic ones (q one-hot); the step on the oracle with q = p
(every draft kept, the bonus token drawn from p) and with a one-hot q on a token p hardly
gives, and on a target with a five-token vocabulary, where its whole outcome (which drafts
are kept, which token is drawn) is counted. Both draw from their `generator` alone: the
same seed twice gives the same draws, and the global RNG's state is left as it was.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import types
from collections import Counter
from collections.abc import Callable, Iterator

import torch

from rosecourse.builds.grading import (
    Build,
    Mismatch,
    Part,
    first_gap,
    judging,
    made,
    seen,
)
from rosecourse.builds.verify.mistakes import KNOWN_WRONG
from rosecourse.demo import PROMPT
from rosecourse.exercises import encoded, oracle_model, reference_tokens
from roseinfer.cache.dense import ConcatKVCache, StaticKVCache
from roseinfer.request.rows import make_sequences
from roseinfer.request.sampling import SamplingParams
from roseinfer.request.sequence import Sequence
from roseinfer.request.token_step import take_tokens
from roseinfer.speculative.drafters import Drafter, ModelDrafter, NgramDrafter, first_layers
from rosetrainer.config import GPTConfig
from rosetrainer.model import GPT
from rosetrainer.numerics import logit_tolerance

NEW = 16  # tokens generated per greedy run
DRAWS = 2500  # draws of the sampled rule per case
# The chi-square tests' threshold: a right answer falls below it once in 10,000 seeds.
P_VALUE = 1e-4
# The rule's cases (p, q): a draft that disagrees with the target, and deterministic drafts.
RULE_CASES = (
    (torch.tensor([0.5, 0.3, 0.15, 0.05]), torch.tensor([0.1, 0.2, 0.3, 0.4])),
    (torch.tensor([0.5, 0.3, 0.15, 0.05]), torch.tensor([0.0, 0.0, 1.0, 0.0])),
    (torch.tensor([0.05, 0.6, 0.1, 0.25]), torch.tensor([0.3, 0.0, 0.3, 0.4])),
)


def prompt() -> list[int]:
    """A prompt that repeats itself, so prompt lookup finds matches (kept and rejected)."""
    return list(encoded(PROMPT)) * 2


def oracle() -> list[int]:
    """The uncached greedy run after prompt(): every greedy token must be one of these."""
    return list(reference_tokens(tuple(prompt()), NEW))


@functools.cache
def oracle_logits(tokens: tuple[int, ...]) -> torch.Tensor:
    """(len(tokens), vocab): the uncached model's next-token logits after each token."""
    with torch.no_grad():
        return oracle_model()(torch.tensor([tokens])).logits[0]


def prefilled(cache: object, tokens: list[int], target: GPT | None = None) -> object:
    """`cache` after the target (the oracle by default) has read `tokens`: the text but its
    newest token."""
    with torch.no_grad():
        (target or oracle_model())(torch.tensor([tokens]), cache=cache)
    return cache


@contextlib.contextmanager
def target_calls() -> Iterator[list[int]]:
    """Counts the target's (the oracle's) calls while the block runs (in a one-item list)."""
    calls = [0]
    hook = oracle_model().register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        yield calls
    finally:
        hook.remove()


# ---------------------------------------------------------------------------
# The learner's cache inside rose's GPT
# ---------------------------------------------------------------------------

# A part's passes, in order: (tokens of the text, then tokens not in it), each pass followed
# by truncate(the text's length) and seq_len read.
PASSES = ((10, 0), (1, 0), (2, 0), (4, 0), (9, 0), (5, 0))  # a prefill, then k + 1 for k = 0..8
ROLLBACKS = ((12, 0), (3, 3), (3, 0), (1, 4), (3, 0), (6, 0), (3, 0))


def passed(cache: object, ids: list[int], right: int, keep: int) -> tuple[torch.Tensor, int]:
    """rose's GPT reads `ids` over `cache`: the logits of its first `right` rows; then
    truncate(keep), and the cache's seq_len after."""
    with torch.no_grad():
        logits = oracle_model()(torch.tensor([ids]), cache=cache).logits[0, :right]
    cache.truncate(keep)
    return logits, cache.seq_len


def cache_passes(passes: tuple[tuple[int, int], ...]) -> Callable[[types.ModuleType], None]:
    def part(module: types.ModuleType) -> None:
        text, vocab = prompt() + oracle(), oracle_model().config.vocab_size
        cache, held = module.RollbackCache(), 0
        for right, wrong in passes:
            ids = text[held : held + right]
            ids += [(t + 1) % vocab for t in text[held + right : held + right + wrong]]
            where = f"the pass over positions {held}..{held + right + wrong - 1}"
            where += f" (the last {wrong} not the text's)" if wrong else ""
            logits, length = made(where, functools.partial(passed, cache, ids, right, held + right))
            if judging():  # the oracle's logits are the grader's to make, for its comparisons
                want = oracle_logits(tuple(text[: held + right]))[held:]
                gap = first_gap(logits, want, logit_tolerance(want))
                if gap is not None:
                    raise Mismatch(f"{where}: {gap}")
            held += right
            if length != held:
                raise Mismatch(f"after {where} and truncate({held}), seq_len is {length}")

    return part


# ---------------------------------------------------------------------------
# The greedy verify step, in a loop the grader drives
# ---------------------------------------------------------------------------

Drafts = Callable[[Sequence, int, int], list[int]]  # (request, k, tokens made so far) -> drafts


def greedy_call(module: types.ModuleType, cache: object, last: int, drafts: list[int]) -> tuple:
    """The learner's verify_greedy on `cache`: what it returns, how many times it ran the
    target, and the cache's length after."""
    with target_calls() as calls:
        got = module.verify_greedy(oracle_model(), cache, last, list(drafts))
    return got, calls[0], cache.seq_len


def run(module: types.ModuleType, cache: object, drafts: Drafts, k: int, lengths: bool) -> None:
    """Generate NEW tokens with the learner's verify step, `drafts` proposing up to k a
    round: each call's tokens against the uncached greedy run's; with `lengths`, the
    cache's length after each call first."""
    want = oracle()
    params = SamplingParams(max_tokens=NEW + 9, ignore_eos=True)  # never stops the run itself
    (seq,) = make_sequences(oracle_model(), [prompt()], params, None, None)
    prefilled(cache, prompt()[:-1])
    while len(seq.output_ids) < NEW:
        at = len(seq.output_ids)
        proposed = list(drafts(seq, min(k, NEW - at - 1), at))
        call = functools.partial(greedy_call, module, cache, seq.all_ids[-1], proposed)
        got, passes, held = made(f"k = {k}, the call at token {at}", call)
        agreed = next((i for i, t in enumerate(proposed) if t != want[at + i]), len(proposed))
        right = want[at : at + agreed + 1]
        where = f"k = {k}, a call at token {at} given the drafts {proposed}"
        if passes != 1:
            raise Mismatch(f"{where} ran the target {passes} times: one pass is the point")
        if not isinstance(got, list) or got != right:
            raise Mismatch(
                f"{where} (the target agrees with {agreed} of them) returns {got!r} where the "
                f"uncached oracle gives {right}: the drafts it agrees with, then its own token"
            )
        if lengths and held != len(seq.all_ids) + agreed:
            raise Mismatch(
                f"{where} leaves the cache holding {held} positions where "
                f"{len(seq.all_ids) + agreed} are right (the text but its newest token)"
            )
        for token in right:
            take_tokens([seq], [token])


def greedy(
    drafts: Callable[[int], Drafts], cache: Callable[[], object], ks: tuple[int, ...], lengths: bool
) -> Callable[[types.ModuleType], None]:
    """A part: a run for each k of `ks`, with fresh drafts(k) and cache()."""

    def part(module: types.ModuleType) -> None:
        for k in ks:
            run(module, cache(), drafts(k), k, lengths)

    return part


def drafted_by(make: Callable[[], Drafter]) -> Callable[[int], Drafts]:
    """Drafts proposed by a fresh drafter of rose's."""

    def drafts(k: int) -> Drafts:
        drafter = make()
        return lambda seq, room, at: drafter.propose([seq], [room])[0].tokens if room else []

    return drafts


def scripted(k: int) -> Drafts:
    """The oracle's next tokens with the one at place j made wrong, j = 0, 1, ..., k in
    turn (j = k: every draft right, so the step ends with the bonus token)."""
    rounds, vocab = itertools.count(), oracle_model().config.vocab_size

    def drafts(seq: Sequence, room: int, at: int) -> list[int]:
        j = next(rounds) % (k + 1)
        return [(t + 1) % vocab if i == j else t for i, t in enumerate(oracle()[at : at + room])]

    return drafts


# ---------------------------------------------------------------------------
# The sampled rule and the sampled verify step, against their exact law
# ---------------------------------------------------------------------------


def rule_law(p: torch.Tensor, q: torch.Tensor) -> dict[tuple, float]:
    """The rule's (token, kept) with the draft drawn from q: kept y with min(p, q)(y);
    rejected, then y, with max(0, p - q)(y). Both sum to p: the token is distributed as
    the target's."""
    rows = ((True, torch.minimum(p, q)), (False, (p - q).clamp(min=0)))
    return {(y, kept): share for kept, row in rows for y, share in enumerate(row.tolist()) if share}


def law(p: torch.Tensor, q: torch.Tensor, drafts: list[int]) -> dict[tuple, float]:
    """A sampled verify step's tokens -> their probability: draft i kept with min(1, p_i /
    q_i); in place of the first rejected one, a token from max(0, p_i - q_i) normalised;
    after every draft kept, the bonus from p_k. p: (k + 1, vocab), q: (k, vocab)."""
    outcomes, reach = {}, 1.0  # reach: the chance that every draft so far was kept
    for i, drafted in enumerate(drafts):
        keep = min(1.0, float(p[i, drafted] / q[i, drafted]))
        residual = (p[i] - q[i]).clamp(min=0)
        rejected = keep < 1 and float(residual.sum()) > 0
        for token, share in enumerate((residual / residual.sum()).tolist() if rejected else []):
            outcomes[(*drafts[:i], token)] = reach * (1 - keep) * share
        reach *= keep
    for token, share in enumerate(p[-1].tolist()):
        outcomes[(*drafts, token)] = reach * share
    return outcomes


def expect_law(what: str, outcomes: list, exact: dict[tuple, float]) -> None:
    """Seeded `outcomes` against their `exact` law: none it rules out (expected less than
    once in a million runs), and a chi-square test over those expected at least 5 times,
    the rest pooled."""
    n, counts = len(outcomes), Counter(outcomes)
    ruled_out = [o for o in counts if exact.get(o, 0) * n < 1e-6]
    if ruled_out:
        raise Mismatch(f"{what}: it gives {ruled_out[0]}, which the rule never gives")
    likely = [o for o in exact if exact[o] * n >= 5]
    expected = [exact[o] * n for o in likely] + [n - sum(exact[o] * n for o in likely)]
    got = [counts[o] for o in likely] + [n - sum(counts[o] for o in likely)]
    live = [(g, e) for g, e in zip(got, expected, strict=True) if e > 1e-9]
    statistic = sum((g - e) ** 2 / e for g, e in live)
    dof = torch.tensor((len(live) - 1) / 2)
    p_value = float(torch.special.gammaincc(dof, torch.tensor(statistic / 2))) if live[1:] else 1
    if p_value < P_VALUE:
        shown = {o: (round(counts[o] / n, 3), round(exact[o], 3)) for o in likely}
        raise Mismatch(
            f"{what}: (frequency, probability) per outcome {shown} in {n} draws "
            f"(chi-square p-value {p_value:.2g} < {P_VALUE:g})"
        )


def expect_own_generator(what: str, draws: Callable[[torch.Generator], list]) -> None:
    """`draws` from one seed of `generator` twice: the same draws, and the global RNG's
    state left as it was (a seeded request samples the same alone or beside others)."""
    before = torch.get_rng_state()
    first = draws(torch.Generator().manual_seed(11))
    again = draws(torch.Generator().manual_seed(11))
    moved = seen(f"{what}: the global RNG moved", not torch.equal(torch.get_rng_state(), before))
    if first != again:
        raise Mismatch(f"{what}, run twice from one seed of `generator`, differ")
    if moved:
        raise Mismatch(
            f"{what} move the global RNG's state (torch.rand or torch.multinomial without "
            "generator=, or torch.manual_seed): every random draw comes from `generator`"
        )


def rounded(values: torch.Tensor) -> list:
    return [round(float(x), 3) for x in values] if values.dim() == 1 else list(map(rounded, values))


def rule_draws(
    module: types.ModuleType,
    p: torch.Tensor,
    q: torch.Tensor,
    n: int,
    generator: torch.Generator | None = None,
) -> list:
    """n outcomes (token, kept) of the learner's rule, each draft drawn from q, every draw
    from `generator` (by default, one seeded with 0)."""
    generator = generator or torch.Generator().manual_seed(0)

    def draws() -> list[tuple[int, bool]]:
        outcomes = []
        for _ in range(n):
            drafted = int(torch.multinomial(q, 1, generator=generator))
            token, kept = module.accept_or_resample(p, q, drafted, generator)
            outcomes.append((int(token), bool(kept)))
        return outcomes

    return made(f"{n} draws of the rule", draws)


def _rule(module: types.ModuleType) -> None:
    for p, q in RULE_CASES:
        what = f"p = {rounded(p)}, q = {rounded(q)}: (token, kept)"
        expect_law(what, rule_draws(module, p, q, DRAWS), rule_law(p, q))


def _rule_generator(module: types.ModuleType) -> None:
    p, q = RULE_CASES[0]
    expect_own_generator("the sampled rule's draws", lambda g: rule_draws(module, p, q, 100, g))


def probs(target: GPT, tokens: list[int]) -> torch.Tensor:
    """The target's distributions after each of `tokens` (temperature 1), in float64."""
    with torch.no_grad():
        return torch.softmax(target(torch.tensor([tokens])).logits[0].double(), dim=-1)


def sampled_steps(
    module: types.ModuleType,
    target: GPT,
    text: list[int],
    drafts: list[int],
    q: torch.Tensor,
    generator: torch.Generator,
    n: int,
) -> list[tuple[int, ...]]:
    """n sampled verify steps of the learner's from one place (the cache rolled back after
    each): their tokens, each call held to the cache's length after it."""

    def steps() -> list[tuple]:
        cache, outcomes = prefilled(ConcatKVCache(), text[:-1], target), []
        for _ in range(n):
            got = module.verify_sampled(target, cache, text[-1], list(drafts), q.clone(), generator)
            outcomes.append((tuple(int(t) for t in got), cache.seq_len))
            if cache.seq_len != len(text) - 1 + len(got):
                break  # judged below, before a later call trips over it
            cache.truncate(len(text) - 1)
        return outcomes

    outcomes = made(f"{n} sampled steps after drafts {drafts}", steps)
    for tokens, held in outcomes:
        if held != len(text) - 1 + len(tokens):
            raise Mismatch(
                f"a sampled step that returned {list(tokens)} leaves the cache holding {held} "
                f"positions where {len(text) - 1 + len(tokens)} are right (the text but its "
                "newest token)"
            )
    return [tokens for tokens, _ in outcomes]


def _sampled_verify(module: types.ModuleType) -> None:
    target, text, drafts = oracle_model(), prompt(), []
    for _ in range(3):  # the target's likeliest tokens, so no p is tiny
        drafts.append(int(probs(target, text + drafts)[-1].argmax()))
    p = probs(target, text + drafts)[len(text) - 1 :]
    q = p[:-1].float()  # each draft drawn from the target's own distribution
    outcomes = sampled_steps(module, target, text, drafts, q, torch.Generator().manual_seed(1), 100)
    what = f"drafts {drafts} drawn from q = p: all kept, then the bonus from p"
    expect_law(what, outcomes, law(p, q.double(), drafts))


# A target with a five-token vocabulary, so a verify step's every outcome can be listed.
SMALL_CONFIG = GPTConfig(vocab_size=5, block_size=16, n_layer=1, n_head=1, n_embd=8)
SMALL_TEXT = [0, 1, 2, 3]  # the text: the cache holds all but its newest token
SMALL_DRAFTS = [1, 2]  # k = 2 drafts, and what they were drawn from (neither p nor one-hot)
SMALL_Q = torch.tensor([[0.1, 0.4, 0.2, 0.2, 0.1], [0.1, 0.1, 0.5, 0.2, 0.1]])
SMALL_STEPS = 900  # sampled verify steps counted


@functools.cache
def small_target() -> GPT:
    """A random GPT over five tokens whose distributions are spread (none near one-hot)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = GPT(SMALL_CONFIG).eval()
        with torch.no_grad():
            for weight in model.parameters():
                weight.normal_(0, 0.4)
    return model


def _sampled_law(module: types.ModuleType) -> None:
    target = small_target()

    def steps(generator: torch.Generator, n: int) -> list[tuple[int, ...]]:
        return sampled_steps(module, target, SMALL_TEXT, SMALL_DRAFTS, SMALL_Q, generator, n)

    expect_own_generator("sampled verify steps", lambda generator: steps(generator, 20))
    p = probs(target, SMALL_TEXT + SMALL_DRAFTS)[len(SMALL_TEXT) - 1 :]
    expect_law(
        f"drafts {SMALL_DRAFTS} drawn from q = {rounded(SMALL_Q)} on a 5-token target",
        steps(torch.Generator().manual_seed(2), SMALL_STEPS),
        law(p, SMALL_Q.double(), SMALL_DRAFTS),
    )


def _probe(module: types.ModuleType) -> list[object]:
    """The learner's cache on a pass after a past, greedy calls with every draft right and
    with one rejected (their tokens, passes and the cache's length), and the sampled
    rule's first draws."""
    text, cache = prompt() + oracle(), module.RollbackCache()
    passes = [passed(cache, text[:6], 6, 6), passed(cache, text[6:10], 4, 10)]
    calls, at, rose_cache = [], len(prompt()), prefilled(ConcatKVCache(), prompt()[:-1])
    for drafts in (oracle()[:2], [oracle()[2], 0, 0]):
        calls.append(greedy_call(module, rose_cache, text[at - 1], drafts))
        at += len(calls[-1][0])
    return [passes, calls, rule_draws(module, *RULE_CASES[0], 100)]


VERIFY = Build(
    name="verify",
    chapters="19",
    task="speculative decoding's verify-and-rollback step, greedy and sampled",
    parts=(
        Part("cache, a pass of k + 1 after a past", cache_passes(PASSES)),
        Part("cache, rollback", cache_passes(ROLLBACKS)),
        Part(
            "greedy, prompt lookup, k = 1..8",
            greedy(drafted_by(lambda: NgramDrafter(1, 3)), ConcatKVCache, range(1, 9), False),
        ),
        Part(
            "greedy, self-draft on a static cache, k = 1, 3, 8",
            greedy(
                drafted_by(lambda: ModelDrafter(first_layers(oracle_model(), 1))),
                lambda: StaticKVCache(oracle_model()),
                (1, 3, 8),  # (each round drafts k tokens with a model: the slow drafter)
                False,
            ),
        ),
        Part(
            "greedy, the cache's length after every call",
            greedy(scripted, ConcatKVCache, (1, 3, 8), True),
        ),
        Part("greedy, the run past a rejection", greedy(scripted, ConcatKVCache, (1, 3, 8), False)),
        Part("sampled rule", _rule),
        Part("sampled rule, its generator", _rule_generator),
        Part("sampled verify", _sampled_verify),
        Part("sampled verify, the exact law on a 5-token vocabulary", _sampled_law),
    ),
    probe=_probe,
    known_wrong=KNOWN_WRONG,
    passed="as rose: the uncached oracle's tokens, the target's distribution",
)
