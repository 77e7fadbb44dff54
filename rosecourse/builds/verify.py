"""Build (chapter 19): the verify-and-rollback step, graded against the oracle.

Contract: rosecourse/solutions/build_verify.py. The learner's cache runs inside rose's GPT
(the chapters' random strong-oracle model): a pass of k + 1 tokens after a past, and a
pass after a rollback, each row's logits held to the uncached oracle's by rose's one
tolerance rule (rosetrainer/numerics.py). The learner's greedy verify step runs on rose's
own caches (so it is graded on its own) in a loop the grader drives: with rose's
prompt-lookup drafter for k = 1..8, with rose's self-draft on a static cache, and with
drafts scripted to be rejected at every place (and all kept); every token must be the
uncached greedy run's, each call must run the target once and return the drafts it
agrees with and one token more, and after every call the cache must hold exactly the
text but its newest token. The sampled rule and the sampled verify step are held to the target's
distribution: seeded draws of (token, kept) against the exact probabilities of the rule
(a chi-square test, its p-value at least P_VALUE), and sampled verify steps: those whose
outcome the rule fixes (q equal to p keeps every draft; a one-hot q on a token p hardly
gives is rejected), the bonus token's frequencies against p, and on a target with a
five-token vocabulary the step's whole outcome (which drafts are kept, which token is
drawn) against its exact law, computed from the rule's acceptance probabilities with q
neither p nor one-hot. Both are held to their `generator`: the same seed twice gives the
same draws, and the global RNG's state is left as it was.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import types
from collections.abc import Callable, Iterator

import torch

from rosecourse.builds.grading import (
    Build,
    KnownWrong,
    Mismatch,
    Part,
    expect_close,
    made,
    seen,
)
from rosecourse.demo import PROMPT
from rosecourse.exercises import encoded, oracle_model, reference_tokens
from rosecourse.solutions.build_verify import RollbackCache, score
from roseinfer.cache.dense import ConcatKVCache, DenseKVCache, StaticKVCache
from roseinfer.request.rows import make_sequences
from roseinfer.request.sampling import SamplingParams
from roseinfer.request.sequence import Sequence
from roseinfer.request.token_step import take_tokens
from roseinfer.speculative.drafters import Drafter, ModelDrafter, NgramDrafter, first_layers
from rosetrainer.config import GPTConfig
from rosetrainer.model import GPT
from rosetrainer.numerics import logit_tolerance

NEW = 16  # tokens generated per run
DRAWS = 4000  # draws of the sampled rule per case
BONUS_DRAWS = 150  # sampled verify steps whose bonus token is counted
P_VALUE = 1e-4  # the chi-square test's threshold: a right rule falls below it once in 10,000 seeds
# The rule's cases: a draft that disagrees with the target, and deterministic drafts (q one-hot).
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


def prefilled(cache: object, tokens: list[int]) -> object:
    """`cache` after rose's GPT has read `tokens` (the text but its newest token)."""
    with torch.no_grad():
        oracle_model()(torch.tensor([tokens]), cache=cache)
    return cache


# ---------------------------------------------------------------------------
# The learner's cache inside rose's GPT
# ---------------------------------------------------------------------------


def fed(cache: object, text: list[int], start: int, end: int) -> torch.Tensor:
    """Feed text[start:end] to rose's GPT on `cache`; its logits against the oracle's."""
    with torch.no_grad():
        logits = oracle_model()(torch.tensor([text[start:end]]), cache=cache).logits[0]
    want = oracle_logits(tuple(text[:end]))[start:end]
    new = "1 new token" if end - start == 1 else f"{end - start} new tokens"
    where = f"the pass over positions {start}..{end - 1} ({new})"
    expect_close(where, logits, want, logit_tolerance(want))
    return logits


def _cache_pass(module: types.ModuleType) -> None:
    text = prompt() + oracle()
    cache = module.RollbackCache()
    start = 0
    for q_len in (10, 1, 2, 4, 9, 5):  # a prefill, then passes of k + 1 for k = 0, 1, 3, 8, 4
        fed(cache, text, start, start + q_len)
        start += q_len
        held = seen(f"seq_len after {start} tokens", cache.seq_len)
        if held != start:
            raise Mismatch(f"after reading {start} tokens the cache's seq_len is {held}")


def _cache_rollback(module: types.ModuleType) -> None:
    text = prompt() + oracle()
    cache = module.RollbackCache()
    fed(cache, text, 0, 12)
    for kept, rejected in ((2, 3), (0, 4), (5, 0)):  # drafts kept, then drafts rejected
        held = cache.seq_len
        vocab = oracle_model().config.vocab_size
        wrong = [(t + 1) % vocab for t in text[held + kept : held + kept + rejected]]
        with torch.no_grad():  # one pass: the text's next tokens, then tokens not in it
            oracle_model()(torch.tensor([text[held : held + kept] + wrong]), cache=cache)
        cache.truncate(held + kept)
        left = seen(f"seq_len after truncate({held + kept})", cache.seq_len)
        if left != held + kept:
            raise Mismatch(
                f"truncate({held + kept}) on a cache of {held + kept + rejected} positions "
                f"leaves seq_len {left}"
            )
        fed(cache, text, held + kept, held + kept + 3)


# ---------------------------------------------------------------------------
# The greedy verify step, in a loop the grader drives
# ---------------------------------------------------------------------------


def new_sequence(prompt_ids: list[int]) -> Sequence:
    params = SamplingParams(max_tokens=NEW + 9, ignore_eos=True)  # never stops the run itself
    (seq,) = make_sequences(oracle_model(), [prompt_ids], params, None, None)
    return seq


Drafts = Callable[[Sequence, int, int], list[int]]  # (request, k, tokens made so far) -> drafts


def run(
    module: types.ModuleType, cache: object, drafts: Drafts, k: int, label: str, lengths: bool
) -> None:
    """Generate NEW tokens with the learner's verify step, `drafts` proposing up to k a
    round: each call's tokens against the uncached greedy run's; with `lengths`, the
    cache's length after each call first."""
    want = oracle()
    seq = new_sequence(prompt())
    prefilled(cache, prompt()[:-1])
    while len(seq.output_ids) < NEW:
        made = len(seq.output_ids)
        proposed = drafts(seq, min(k, NEW - made - 1), made)
        with target_calls() as calls:
            got = module.verify_greedy(oracle_model(), cache, seq.all_ids[-1], list(proposed))
        got, passes, held = seen(
            f"{label}: the call at token {made}", (got, calls[0], getattr(cache, "seq_len", None))
        )
        if passes != 1:
            raise Mismatch(
                f"{label}: a call given {drafted(len(proposed))} ran the target {passes} "
                f"times: one pass over the newest token and the drafts is the point"
            )
        if not isinstance(got, list) or not 1 <= len(got) <= len(proposed) + 1:
            raise Mismatch(
                f"{label}: given {drafted(len(proposed))} it returns {got!r}: between 1 and "
                f"{len(proposed) + 1} tokens are right"
            )
        if lengths and held != len(seq.all_ids) + len(got) - 1:
            raise Mismatch(
                f"{label}: after a call given {drafted(len(proposed))} that returned {len(got)} "
                f"token(s), the cache holds {held} positions where "
                f"{len(seq.all_ids) + len(got) - 1} are right (the text but its newest token)"
            )
        for i, token in enumerate(got):
            if token != want[made + i]:
                raise Mismatch(
                    f"{label}: token {made + i} is {token} where the uncached oracle gives "
                    f"{want[made + i]} (a call given the drafts {list(proposed)})"
                )
        agreed = next((i for i, t in enumerate(proposed) if t != want[made + i]), len(proposed))
        if len(got) != agreed + 1:
            raise Mismatch(
                f"{label}: given the drafts {list(proposed)}, of which the target agrees with "
                f"{agreed}, it returns {len(got)} token(s) where {agreed + 1} are right"
            )
        for token in got:
            take_tokens([seq], [int(token)])


@contextlib.contextmanager
def target_calls() -> Iterator[list[int]]:
    """Counts the target's calls while the block runs (in a one-item list)."""
    calls = [0]
    hook = oracle_model().register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        yield calls
    finally:
        hook.remove()


def drafted(n: int) -> str:
    return "1 draft" if n == 1 else f"{n} drafts"


def from_drafter(drafter: Drafter) -> Drafts:
    def drafts(seq: Sequence, k: int, made: int) -> list[int]:
        return drafter.propose([seq], [k])[0].tokens if k > 0 else []

    return drafts


def scripted(k: int) -> Drafts:
    """The oracle's next k tokens with the one at place j made wrong, j = 0, 1, ..., k in
    turn (j = k: every draft right, so the step ends with the bonus token)."""
    rounds = itertools.count()
    vocab = oracle_model().config.vocab_size

    def drafts(seq: Sequence, room: int, made: int) -> list[int]:
        j = next(rounds) % (k + 1)
        right = oracle()[made : made + room]
        return [(t + 1) % vocab if i == j else t for i, t in enumerate(right)]

    return drafts


def prompt_lookup(module: types.ModuleType) -> None:
    for k in range(1, 9):
        drafts = from_drafter(NgramDrafter(1, 3))
        run(module, ConcatKVCache(), drafts, k, f"prompt lookup, k = {k}", lengths=False)


def self_draft(module: types.ModuleType) -> None:
    for k in range(1, 9):
        drafts = from_drafter(ModelDrafter(first_layers(oracle_model(), 1)))
        cache = StaticKVCache(oracle_model())
        run(module, cache, drafts, k, f"self-draft on a static cache, k = {k}", lengths=False)


def cache_length(module: types.ModuleType) -> None:
    for k in (1, 3, 8):
        run(module, ConcatKVCache(), scripted(k), k, f"k = {k}", lengths=True)


def past_rejection(module: types.ModuleType) -> None:
    for k in (1, 3, 8):
        label = f"k = {k}, drafts rejected at each place in turn"
        run(module, ConcatKVCache(), scripted(k), k, label, lengths=False)


# ---------------------------------------------------------------------------
# The sampled rule and the sampled verify step
# ---------------------------------------------------------------------------


def rule_draws(
    module: types.ModuleType, p: torch.Tensor, q: torch.Tensor, draws: int
) -> list[tuple[int, bool]]:
    """`draws` outcomes of the learner's rule, each draft drawn from q, from one seed."""
    generator = torch.Generator().manual_seed(0)
    outcomes = []
    for _ in range(draws):
        drafted = int(torch.multinomial(q, 1, generator=generator))
        token, kept = module.accept_or_resample(p, q, drafted, generator)
        outcomes.append((int(token), bool(kept)))
    return seen(f"{draws} draws of the rule", outcomes)


def _rule(module: types.ModuleType) -> None:
    for p, q in RULE_CASES:
        # The exact law of (kept, token): kept y with min(p, q)(y); rejected, then y, with
        # max(0, p - q)(y). Its two rows sum to p: the token is distributed as the target's.
        expected = torch.stack([(p - q).clamp(min=0), torch.minimum(p, q)]).double() * DRAWS
        counts = torch.zeros_like(expected)
        for token, kept in rule_draws(module, p, q, DRAWS):
            counts[int(kept), token] += 1
        what = f"p = {rounded(p)}, q = {rounded(q)}"
        seen, right = counts / DRAWS, expected / DRAWS
        law = (
            f"{what}: in {DRAWS} draws, (rejected, kept) frequencies per token "
            f"{[rounded(row) for row in seen]} where the rule gives "
            f"{[rounded(row) for row in right]}"
        )
        if bool((counts[expected == 0] > 0).any()):
            raise Mismatch(f"{law} (an outcome of probability 0 occurs)")
        live = expected > 0
        statistic = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
        p_value = chi_square_p_value(statistic, int(live.sum()) - 1)
        if p_value < P_VALUE:
            raise Mismatch(f"{law} (chi-square p-value {p_value:.2g} < {P_VALUE:g})")


@contextlib.contextmanager
def own_generator(what: str) -> Iterator[None]:
    """Fails the block when it moves the global RNG's state: every random draw of the
    contract comes from the `generator` it is given."""
    before = torch.get_rng_state()
    yield
    if not torch.equal(torch.get_rng_state(), before):
        raise Mismatch(
            f"{what} move(s) the global RNG's state (torch.rand or torch.multinomial without "
            "generator=, or torch.manual_seed): every random draw comes from `generator`, so "
            "a seeded request samples the same alone or beside others"
        )


def expect_reproducible(what: str, draws: Callable[[torch.Generator], list[object]]) -> None:
    """The same seed of `generator` twice: the same draws."""
    first = seen(f"{what}, run once", draws(torch.Generator().manual_seed(11)))
    again = seen(f"{what}, run again", draws(torch.Generator().manual_seed(11)))
    if first != again:
        at = next(i for i, (a, b) in enumerate(zip(first, again, strict=False)) if a != b)
        raise Mismatch(
            f"{what}, run twice from one seed of `generator`, differ at draw {at} ({first[at]} "
            f"then {again[at]}): every random draw comes from `generator`"
        )


def _rule_generator(module: types.ModuleType) -> None:
    p, q = RULE_CASES[0]
    with own_generator("the sampled rule's draws"):
        expect_reproducible(
            "the sampled rule's draws",
            lambda generator: [
                module.accept_or_resample(p, q, drafted, generator) for drafted in (0, 1, 2, 3) * 25
            ],
        )


def rounded(values: torch.Tensor) -> list[float]:
    return [round(float(x), 3) for x in values]


def target_probs(tokens: list[int]) -> torch.Tensor:
    """The target's distributions after each token of `tokens` (temperature 1)."""
    return torch.softmax(oracle_logits(tuple(tokens)).float(), dim=-1)


def _sampled_verify(module: types.ModuleType) -> None:
    generator = torch.Generator().manual_seed(1)
    text = prompt()
    cache = prefilled(ConcatKVCache(), text[:-1])
    for k in (1, 3, 2):
        # q = the target's own p at each place: every draft is kept, then the bonus.
        drafts: list[int] = []  # the target's likeliest tokens, so no p is tiny
        for _ in range(k):
            drafts.append(int(target_probs(text + drafts)[-1].argmax()))
        draft_probs = target_probs(text + drafts)[len(text) - 1 : -1]
        with target_calls() as calls:
            got = seen(
                "verify_sampled",
                module.verify_sampled(
                    oracle_model(), cache, text[-1], drafts, draft_probs, generator
                ),
            )
        where = f"{drafted(k)} drawn from the target's own distribution (q = p)"
        if calls[0] != 1:
            raise Mismatch(
                f"{where}: the step ran the target {calls[0]} times: one pass over the newest "
                f"token and the drafts is the point"
            )
        if not isinstance(got, list) or got[:k] != drafts or len(got) != k + 1:
            raise Mismatch(
                f"{where} must all be kept, then one more token: it returns {got!r} for "
                f"drafts {drafts}"
            )
        check_length(cache, len(text) + k, where)
        text = text + got
    # The bonus is drawn from p after the last draft: its frequencies over many calls.
    drafts = [int(target_probs(text)[-1].argmax())]
    p, q = target_probs(text + drafts)[-2:]
    counts: dict[int, int] = {}
    for _ in range(BONUS_DRAWS):
        got = seen(
            "verify_sampled",
            module.verify_sampled(oracle_model(), cache, text[-1], drafts, p[None], generator),
        )
        check_length(cache, len(text) + 1, f"{drafted(1)} drawn from q = p")
        counts[got[-1]] = counts.get(got[-1], 0) + 1
        cache.truncate(len(text) - 1)
    expect_distributed(counts, q, BONUS_DRAWS, "the bonus token after a kept draft")
    # A one-hot q on the token p gives least: rejected (but once in ~1e9), one token drawn.
    least = int(target_probs(text)[-1].argmin())
    vocab = oracle_model().config.vocab_size
    draft_probs = torch.nn.functional.one_hot(torch.tensor([least, least]), vocab)
    got = seen(
        "verify_sampled",
        module.verify_sampled(
            oracle_model(), cache, text[-1], [least, least], draft_probs.float(), generator
        ),
    )
    where = f"drafts [{least}, {least}] (q one-hot; p gives {least} almost nothing)"
    if not isinstance(got, list) or len(got) != 1 or got[0] == least:
        raise Mismatch(f"{where} are rejected at once, another token drawn: it returns {got!r}")
    check_length(cache, len(text), where)


# A target with a five-token vocabulary, so a verify step's every outcome can be listed.
SMALL_CONFIG = GPTConfig(vocab_size=5, block_size=16, n_layer=1, n_head=1, n_embd=8)
SMALL_TEXT = [0, 1, 2, 3]  # the text: the cache holds all but its newest token
SMALL_DRAFTS = [1, 2]  # k = 2 drafts, and what they were drawn from (neither p nor one-hot)
SMALL_Q = torch.tensor([[0.1, 0.4, 0.2, 0.2, 0.1], [0.1, 0.1, 0.5, 0.2, 0.1]])
SMALL_STEPS = 1500  # sampled verify steps counted


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


def exact_law() -> tuple[dict[tuple[int, ...], float], list[torch.Tensor]]:
    """The sampled verify step's outcome law on the small target: the tokens it returns
    -> their probability, from the rule (draft i kept with min(1, p_i/q_i); in place of
    the first rejected one a token from max(0, p_i - q_i) normalised; after every kept
    draft, the bonus from the target's p). Also the target's p at each place."""
    with torch.no_grad():
        logits = small_target()(torch.tensor([SMALL_TEXT + SMALL_DRAFTS])).logits[0]
    p = list(torch.softmax(logits.double(), dim=-1)[len(SMALL_TEXT) - 1 :])
    law: dict[tuple[int, ...], float] = {}
    reach = 1.0  # the probability that every draft so far was kept
    for i, drafted in enumerate(SMALL_DRAFTS):
        q = SMALL_Q[i].double()
        keep = min(1.0, float(p[i][drafted] / q[drafted]))
        residual = (p[i] - q).clamp(min=0)
        for token, share in enumerate((residual / residual.sum()).tolist()):
            if share > 0:
                law[(*SMALL_DRAFTS[:i], token)] = reach * (1 - keep) * share
        reach *= keep
    for token, share in enumerate(p[-1].tolist()):
        law[(*SMALL_DRAFTS, token)] = reach * share
    return law, p


def small_steps(module: types.ModuleType, generator: torch.Generator, n: int) -> list[tuple]:
    """n sampled verify steps of the learner's on the small target, from one place."""

    def steps() -> tuple[list[tuple], list[int], int]:  # tokens, lengths after, before
        cache = ConcatKVCache()
        with torch.no_grad():
            small_target()(torch.tensor([SMALL_TEXT[:-1]]), cache=cache)
        held = cache.seq_len
        outcomes, lengths = [], []
        for _ in range(n):
            got = module.verify_sampled(
                small_target(),
                cache,
                SMALL_TEXT[-1],
                list(SMALL_DRAFTS),
                SMALL_Q.clone(),
                generator,
            )
            outcomes.append(tuple(int(t) for t in got))
            lengths.append(cache.seq_len)
            if cache.seq_len != held + len(got):
                break  # judged below, before a later call trips over it
            cache.truncate(held)
        return outcomes, lengths, held

    outcomes, lengths, held = made(f"{n} sampled steps on the 5-token target", steps)
    for tokens, length in zip(outcomes, lengths, strict=True):  # (all n, when right)
        if length != held + len(tokens):
            raise Mismatch(
                f"a sampled step on the 5-token target: the cache holds {length} positions "
                f"after the call where {held + len(tokens)} are right (the text but its "
                "newest token)"
            )
    return outcomes


def _sampled_law(module: types.ModuleType) -> None:
    with own_generator("sampled verify steps"):
        expect_reproducible("sampled verify steps", lambda g: small_steps(module, g, 20))
        outcomes = small_steps(module, torch.Generator().manual_seed(2), SMALL_STEPS)
    law, p = exact_law()
    where = (
        f"drafts {SMALL_DRAFTS} drawn from q = {[rounded(row) for row in SMALL_Q]} on a "
        f"5-token target (p = {[rounded(row) for row in p]})"
    )
    impossible = sorted({o for o in outcomes if o not in law})
    if impossible:
        raise Mismatch(f"{where}: {never(impossible[0])}")
    # What a mistake shows first: the first place's token (the draft kept with min(1, p/q),
    # else a token from max(0, p - q) normalised), then the second draft kept given the
    # first was (min(1, p/q) there, its own draw), then the whole law.
    first_law = torch.zeros(SMALL_CONFIG.vocab_size)
    for outcome, share in law.items():
        first_law[outcome[0]] += share
    first = [o[0] for o in outcomes]
    expect_distributed(
        {t: first.count(t) for t in set(first)}, first_law, len(first),
        f"{where}: the first token the step returns, where the rule keeps draft "
        f"{SMALL_DRAFTS[0]} with min(1, p/q) = {float(first_law[SMALL_DRAFTS[0]]):.3f} and "
        "else draws from max(0, p - q) normalised",
        "frequency, probability",
    )  # fmt: skip
    kept_first = [o for o in outcomes if o[0] == SMALL_DRAFTS[0] and len(o) > 1]
    keep_second = min(1.0, float(p[1][SMALL_DRAFTS[1]] / SMALL_Q[1][SMALL_DRAFTS[1]]))
    kept_both = sum(len(o) == 3 for o in kept_first)
    if kept_first and binomial_p_value(kept_both, len(kept_first), keep_second) < P_VALUE:
        raise Mismatch(
            f"{where}: after the first draft is kept, the second is kept in "
            f"{kept_both} of {len(kept_first)} steps where the rule keeps it with probability "
            f"min(1, p/q) = {keep_second:.3f}: each draft gets its own uniform draw"
        )
    counts = {o: outcomes.count(o) for o in law}
    expected = torch.tensor([law[o] for o in law]) * len(outcomes)
    seen = torch.tensor([float(counts[o]) for o in law])
    live = expected >= 5  # the rare outcomes pooled
    expected = torch.cat([expected[live], expected[~live].sum()[None]])
    seen = torch.cat([seen[live], seen[~live].sum()[None]])
    statistic = float(((seen - expected) ** 2 / expected.clamp(min=1e-9)).sum())
    p_value = chi_square_p_value(statistic, len(seen) - 1)
    if p_value < P_VALUE:
        shown = {
            str(list(o)): (round(counts[o] / len(outcomes), 3), round(law[o], 3))
            for o in law
            if law[o] * len(outcomes) >= 5
        }
        raise Mismatch(
            f"{where}: (frequency, probability) per outcome {shown} in {len(outcomes)} steps "
            f"(chi-square p-value {p_value:.2g} < {P_VALUE:g}): each draft in turn through "
            "the rule, the bonus from p after the last"
        )


def never(outcome: tuple[int, ...]) -> str:
    """Why the rule never returns `outcome` on the small target, in words."""
    place = len(outcome) - 1
    if place > len(SMALL_DRAFTS) or list(outcome[:place]) != SMALL_DRAFTS[:place]:
        return (
            f"it returns {list(outcome)}: the kept drafts (a prefix of {SMALL_DRAFTS}), then "
            "one token, is all a step returns"
        )
    return (
        f"it returns {list(outcome)}, draft {SMALL_DRAFTS[place]} rejected and "
        f"{outcome[-1]} drawn in its place, where the token comes from max(0, p - q) "
        f"normalised, which gives {outcome[-1]} nothing (q >= p there)"
    )


def binomial_p_value(successes: int, trials: int, probability: float) -> float:
    """Two-sided, by the normal approximation: how unlikely `successes` in `trials` is."""
    mean = trials * probability
    spread = max((trials * probability * (1 - probability)) ** 0.5, 1e-9)
    z = abs(successes - mean) / spread
    return float(torch.special.erfc(torch.tensor(z / 2**0.5)))


def expect_distributed(
    counts: dict[int, int], p: torch.Tensor, draws: int, what: str, shown: str = "frequency, p"
) -> None:
    """Tokens counted over `draws` draws against p: a chi-square test over p's likeliest
    tokens (those expected at least 5 times) and the rest together."""
    likely = [int(t) for t in torch.nonzero(p * draws >= 5).flatten()]
    expected = torch.tensor([float(p[t]) for t in likely] + [1 - float(p[likely].sum())]) * draws
    seen = torch.tensor(
        [counts.get(t, 0) for t in likely] + [draws - sum(counts.get(t, 0) for t in likely)]
    )
    live = expected > 1e-9
    statistic = float(((seen[live] - expected[live]) ** 2 / expected[live]).sum())
    p_value = chi_square_p_value(statistic, int(live.sum()) - 1)
    if p_value < P_VALUE:
        pairs = {t: (round(counts.get(t, 0) / draws, 3), round(float(p[t]), 3)) for t in likely}
        raise Mismatch(
            f"{what}: ({shown}) per likely token {pairs} (chi-square p-value "
            f"{p_value:.2g} < {P_VALUE:g})"
        )


def chi_square_p_value(statistic: float, dof: int) -> float:
    """P(chi-square with dof degrees of freedom >= statistic)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))


def check_length(cache: object, want: int, where: str) -> None:
    held = seen(f"{where}: seq_len", cache.seq_len)
    if held != want:
        raise Mismatch(
            f"{where}: the cache holds {held} positions after the call where {want} "
            f"are right (the text but its newest token)"
        )


def _probe(module: types.ModuleType) -> list[object]:
    """The learner's cache on a pass after a past, greedy calls with every draft right and
    with one rejected (their tokens and the cache's length), and the sampled rule's first
    draws."""
    text = prompt() + oracle()
    cache = module.RollbackCache()
    with torch.no_grad():
        oracle_model()(torch.tensor([text[:6]]), cache=cache)
        logits = oracle_model()(torch.tensor([text[6:10]]), cache=cache).logits
    calls = []
    cache = prefilled(ConcatKVCache(), prompt()[:-1])
    at = len(prompt())
    for drafts in (oracle()[:2], [oracle()[2], 0, 0]):
        got = module.verify_greedy(oracle_model(), cache, text[at - 1], list(drafts))
        calls.append((got, cache.seq_len))
        at += len(got)
    p, q = RULE_CASES[0]
    return [logits, calls, rule_draws(module, p, q, 100)]


# ---------------------------------------------------------------------------
# Known wrong answers: the reference with one method or function written wrong
# ---------------------------------------------------------------------------
# Each runs as if written in the learner's file (grading.replaced rebinds it to the
# module's globals); the names it reads are imported above from the reference solution.


@torch.no_grad()
def _keys_left_in(
    target: GPT, cache: DenseKVCache | RollbackCache, last_token: int, drafts: list[int]
) -> list[int]:
    choices = score(target, cache, last_token, drafts).argmax(dim=-1).tolist()
    accepted = 0
    for drafted, chosen in zip(drafts, choices, strict=False):
        if drafted != chosen:
            break
        accepted += 1
    tokens = drafts[:accepted] + [choices[accepted]]
    # the mistake: `cache.truncate(held + len(tokens))` left out (held: the cache's seq_len
    # before the pass), so the rejected drafts' keys stay
    return tokens


@torch.no_grad()
def _no_bonus(
    target: GPT, cache: DenseKVCache | RollbackCache, last_token: int, drafts: list[int]
) -> list[int]:
    held = cache.seq_len
    choices = score(target, cache, last_token, drafts).argmax(dim=-1).tolist()
    accepted = 0
    for drafted, chosen in zip(drafts, choices, strict=False):
        if drafted != chosen:
            break
        accepted += 1
    # the mistake: was `tokens = drafts[:accepted] + [choices[accepted]]`
    tokens = drafts[:accepted] + [choices[accepted]] * (accepted < len(drafts) or not drafts)
    cache.truncate(held + len(tokens))
    return tokens


def _positions_not_offset(
    self, batch: int, q_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    kv_len = self.seq_len + q_len
    # the mistake: was `query_pos = torch.arange(past, kv_len, device=device)`, past the cache's
    # seq_len
    query_pos = torch.arange(q_len, device=device)
    key_pos = torch.arange(kv_len, device=device)
    return query_pos[None, :], key_pos[None, :] <= query_pos[:, None]


@torch.no_grad()
def _keeps_first_rejected(
    target: GPT, cache: DenseKVCache | RollbackCache, last_token: int, drafts: list[int]
) -> list[int]:
    held = cache.seq_len
    choices = score(target, cache, last_token, drafts).argmax(dim=-1).tolist()
    accepted = 0
    for drafted, chosen in zip(drafts, choices, strict=False):
        # the mistake: was `if drafted != chosen: break accepted += 1`
        accepted += 1
        if drafted != chosen:
            break
    tokens = drafts[:accepted] + [choices[accepted]]
    cache.truncate(held + len(tokens))
    return tokens


def _accept_when_q_gt_p(
    p: torch.Tensor, q: torch.Tensor, drafted: int, generator: torch.Generator
) -> tuple[int, bool]:
    torch.rand((), generator=generator)  # u, drawn and never read
    # the mistake: was `if u * q[drafted] < p[drafted]:` (u < p / q, without dividing by a zero q)
    if q[drafted] > p[drafted]:
        return drafted, True
    residual = (p - q).clamp(min=0)
    token = torch.multinomial(residual / residual.sum(), 1, generator=generator)
    return int(token), False


def _no_residual(
    p: torch.Tensor, q: torch.Tensor, drafted: int, generator: torch.Generator
) -> tuple[int, bool]:
    u = torch.rand((), generator=generator)
    if u * q[drafted] < p[drafted]:  # u < p / q, without dividing by a zero q
        return drafted, True
    # the mistake: was `residual = (p - q).clamp(min=0)`
    residual = p
    token = torch.multinomial(residual / residual.sum(), 1, generator=generator)
    return int(token), False


VERIFY = Build(
    name="verify",
    chapters="19",
    task="speculative decoding's verify-and-rollback step, greedy and sampled",
    parts=(
        Part("cache, a pass of k + 1 after a past", _cache_pass),
        Part("cache, rollback", _cache_rollback),
        Part("greedy, prompt lookup, k = 1..8", prompt_lookup),
        Part("greedy, self-draft on a static cache, k = 1..8", self_draft),
        Part("greedy, the cache's length after every call", cache_length),
        Part("greedy, the run past a rejection", past_rejection),
        Part("sampled rule", _rule),
        Part("sampled rule, its generator", _rule_generator),
        Part("sampled verify", _sampled_verify),
        Part("sampled verify, the exact law on a 5-token vocabulary", _sampled_law),
    ),
    probe=_probe,
    known_wrong=(
        KnownWrong(
            "keys_left_in",
            {"verify_greedy": _keys_left_in},
            "the rejected drafts' keys and values stay in the cache: every later query "
            "attends to tokens that are not in the text, at positions one further for each",
        ),
        KnownWrong(
            "no_bonus",
            {"verify_greedy": _no_bonus},
            "when every draft is kept, the target's logits after the last draft give one "
            "more token (the bonus): the step makes k + 1 tokens, not k",
        ),
        KnownWrong(
            "positions_not_offset",
            {"RollbackCache.prepare": _positions_not_offset},
            "the new tokens stand at positions 0..q_len - 1 as if nothing came before: "
            "after a past they continue where it ends",
        ),
        KnownWrong(
            "keeps_first_rejected",
            {"verify_greedy": _keeps_first_rejected},
            "the first rejected draft is kept: the target's own token takes its place, "
            "and nothing after it is read",
        ),
        KnownWrong(
            "accept_when_q_gt_p",
            {"accept_or_resample": _accept_when_q_gt_p},
            "a draft is kept when the drafter likes it more than the target does: it must "
            "be kept with probability min(1, p/q), so the tokens come out distributed as p",
        ),
        KnownWrong(
            "no_residual",
            {"accept_or_resample": _no_residual},
            "on a rejection the token is drawn from p itself: it must come from what p "
            "gives beyond q, max(0, p - q) normalised, or the drafts' tokens come out too often",
        ),
    ),
    passed="as rose: the uncached oracle's tokens, the target's distribution",
)
