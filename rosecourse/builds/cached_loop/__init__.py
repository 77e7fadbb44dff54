"""Build (chapters 02-06): the cached loop and a static KV cache, graded against the oracle.

Contract: rosecourse/builds/cached_loop/reference.py. The learner's cache runs inside
rose's GPT (the chapters' random strong-oracle model): the prompts go in, then the
oracle's own tokens one at a time, and at every step each row's logits are held to the
uncached oracle's by rose's one tolerance rule (rosetrainer/numerics.py), for one row, a
ragged batch of three (left padding, as rose batches), a prefill in chunks of CHUNK and
one a token a call (where a padding slot's query may see no slot at all); then the same
in bfloat16, where the keys and values it hands back must be in the model's dtype. The
chunked prefill runs with the model moved to another device (`contract.Elsewhere`: CPU
tensors that say meta and raise when they meet a CPU tensor, as a GPU's do), where every
tensor the cache makes or hands back, and every id the loop feeds, must stand on the
model's device. Its memory must stay flat while it decodes: the bytes of every tensor it
holds, and the storage each layer's keys and values come back in.

The learner's loop runs on rose's own StaticKVCache, swapped in for the learner's class,
and on rose's GPT watched: every call is recorded (the rows and tokens fed, the cache
passed), and the vocabulary is relabelled so that end-of-text comes up mid-run (the loop
must go on). Each row's tokens must be the uncached greedy run of its prompt, token for
token, and the calls must be a cached loop's: one StaticCache for every prompt, every
call on it with every row, the prefill in `prefill_chunk` pieces, then one token a row
per decode step.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import types
from collections.abc import Callable, Iterator
from unittest import mock

import torch

from rosecourse.builds import grading
from rosecourse.builds.cached_loop.mistakes import KNOWN_WRONG
from rosecourse.builds.grading import Build, Mismatch, Part, expect_close, first_gap, made
from rosecourse.demo import PROMPT
from rosecourse.exercises import BATCH_TEXTS, encoded, oracle_model, reference_tokens
from rosecourse.exercises.contract import ToElsewhere, elsewhere, moved
from roseinfer.cache.dense import StaticKVCache
from rosetrainer.errors import one_line
from rosetrainer.model import GPT
from rosetrainer.numerics import logit_tolerance

NEW = 12  # tokens decoded per run
CHUNK = 3  # a prefill in chunks of this many tokens: every chunk after the first has a past
END_OF_TEXT = 50256  # GPT-2's <|endoftext|>, the oracle model's last token
EOT_STEP = 3  # the loop's runs meet end-of-text at this step of row 0
# bfloat16 keeps 8 bits of a number: a cached run's logits leave the uncached bfloat16
# run's by up to 2**-7 of the largest (rounding measured on the reference: 0.8%), so
# the bfloat16 part holds them to 2**-5 of it, a sanity bound (float32 is the strict one).
BF16_RTOL = 2**-5
# What the buffers must be, said wherever a dtype or a device is wrong.
BUFFERS = "the buffers are zeros in the dtype (and on the device) of the model's weights"
# The run on another device, and what it asks, said wherever a tensor stands elsewhere.
MOVED = "with the model moved to another device (meta, as to a GPU)"
ON_ITS_DEVICE = (
    "make every tensor the cache and the loop make on the model's device "
    "(device=model.lm_head.weight.device, or the device prepare is given), or they fail "
    "on a GPU"
)


def prompts(batch: int) -> list[tuple[int, ...]]:
    """One prompt, or BATCH_TEXTS' three of different lengths."""
    return [encoded(PROMPT)] if batch == 1 else [encoded(text) for text in BATCH_TEXTS]


@functools.cache
def model_in(dtype: torch.dtype, there: bool = False) -> GPT:
    """The oracle model, or a copy of it in bfloat16, or one moved to another device
    (`there`: contract.Elsewhere, whose tensors compute on the CPU)."""
    if there:
        return moved(oracle_model(), elsewhere)
    return oracle_model() if dtype == torch.float32 else copy.deepcopy(oracle_model()).to(dtype)


@contextlib.contextmanager
def placed(module: types.ModuleType, there: bool) -> Iterator[None]:
    """Where a run happens: with the model on another device (`there`), a tensor asked for
    on its device is made there (contract.ToElsewhere), and a device error met in the
    learner's code is a Mismatch that names the clause and where it was raised."""
    if not there:
        yield
        return
    try:
        with ToElsewhere():
            yield
    except RuntimeError as error:
        if "device" not in str(error):
            raise
        raise Mismatch(
            f"{MOVED}, {raised_in(error, module)} raises {one_line(error)}: {ON_ITS_DEVICE}"
        ) from None


def raised_in(error: BaseException, module: types.ModuleType) -> str:
    """The learner's function the innermost frame of `error` in `module` runs, in words."""
    where, frame = "rose's GPT, on what the cache hands it,", error.__traceback__
    while frame is not None:
        if frame.tb_frame.f_globals is module.__dict__:
            where = frame.tb_frame.f_code.co_qualname
        frame = frame.tb_next
    return where


@functools.cache
def oracle_logits(prompt: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """(NEW, vocab): the uncached logits of each greedy step after `prompt` (the model is
    causal, so one pass over the prompt and the float32 oracle's tokens gives every step's)."""
    tokens = list(prompt) + list(reference_tokens(prompt, NEW))
    with torch.no_grad():
        return model_in(dtype)(torch.tensor([tokens[:-1]])).logits[0, len(prompt) - 1 :]


def left_padded(rows: list[tuple[int, ...]]) -> tuple[torch.Tensor, list[int]]:
    longest = max(map(len, rows))
    pads = [longest - len(row) for row in rows]
    return torch.tensor([[0] * pad + list(row) for pad, row in zip(pads, rows, strict=True)]), pads


def new_cache(module: types.ModuleType, rows: list, model: GPT | None = None) -> object:
    ids, pads = left_padded(rows)
    return module.StaticCache(model or oracle_model(), len(rows), ids.size(1) + NEW, pads)


def cached_steps(
    cache: object, rows: list, chunk: int | None, model: GPT | None = None
) -> Iterator:
    """rose's GPT on `cache`: each row's prompt, then the oracle's tokens one at a time;
    yields the logits of every row's newest token, step by step."""
    model = model or oracle_model()
    device = model.lm_head.weight.device
    ids = left_padded(rows)[0].to(device)
    chunk = chunk or ids.size(1)
    with torch.no_grad():
        for start in range(0, ids.size(1), chunk):
            logits = model(ids[:, start : start + chunk], cache=cache).logits[:, -1]
        yield logits.cpu()
        for step in range(1, NEW):
            fed = torch.tensor([[reference_tokens(row, NEW)[step - 1]] for row in rows])
            yield model(fed.to(device), cache=cache).logits[:, -1].cpu()


def held_tensors(obj: object) -> dict[int, torch.Tensor]:
    """Every tensor `obj` holds (through its attributes, lists, tuples and dicts), by storage."""
    found: dict[int, torch.Tensor] = {}
    visited: set[int] = set()
    todo = [obj]
    while todo:
        item = todo.pop()
        if id(item) in visited or isinstance(item, (torch.nn.Module, type, types.ModuleType)):
            continue
        visited.add(id(item))
        if isinstance(item, torch.Tensor):
            found[item.untyped_storage().data_ptr()] = item
        elif isinstance(item, (list, tuple)):
            todo += item
        elif isinstance(item, dict):
            todo += item.values()
        elif hasattr(item, "__dict__"):
            todo += vars(item).values()
    return found


def watched_updates(cache: object, rows: int, dtype: torch.dtype, device: torch.device) -> None:
    """Hold what `cache.prepare` and `cache.update` hand the model to the contract before
    the model reads it: on the model's device; every row, in the model's dtype (the
    buffers too, not a cast on the way out), no NaN (a NaN there reaches every query: a
    weight of 0 times NaN is NaN)."""
    prepare, update, calls = cache.prepare, cache.update, [0]

    def on_device(method: str, names: tuple[str, str], out: object) -> None:
        for name, got in zip(names, out, strict=False):
            if isinstance(got, torch.Tensor) and got.device != device:
                raise Mismatch(
                    f"{MOVED}, {method} returns the {name} on the {got.device.type}: "
                    f"{ON_ITS_DEVICE}"
                )

    def prepared(batch: int, q_len: int, on: torch.device) -> object:
        out = prepare(batch, q_len, on)
        on_device("prepare", ("positions", "mask"), out)
        return out

    def checked(layer: int, k: torch.Tensor, v: torch.Tensor) -> object:
        calls[0] += layer == 0
        try:
            out = update(layer, k, v)
        except RuntimeError as error:
            held = {str(t.dtype) for t in held_tensors(cache).values() if t.is_floating_point()}
            if held <= {str(dtype)}:
                raise
            raise Mismatch(
                f"writing layer {layer}'s {dtype} keys and values raised {one_line(error)} with "
                f"the cache holding {', '.join(sorted(held))} tensors: {BUFFERS}, as the "
                "contract says"
            ) from None
        on_device("update", ("keys", "values"), out)
        for name, got in zip(("keys", "values"), out, strict=False):
            if not isinstance(got, torch.Tensor):
                raise Mismatch(f"update returns a {type(got).__name__} for the {name}")
            if got.size(0) != rows:
                raise Mismatch(
                    f"layer {layer}'s {name} come back with {got.size(0)} rows of {rows}"
                )
            other = sorted(
                str(t.dtype)
                for t in held_tensors(cache).values()
                if t.is_floating_point() and t.dtype != dtype and t.shape == got.shape
            )
            if got.dtype != dtype or other:
                raise Mismatch(
                    f"in a {dtype} model layer {layer}'s {name} come back as {got.dtype}, from "
                    f"{(other or [str(got.dtype)])[0]} buffers: {BUFFERS}, as the contract says"
                )
            if got.isnan().any():
                raise Mismatch(
                    f"layer {layer}'s {name} hold NaN after call {calls[0]}: a query that may "
                    "see no slot (a padding slot's, before any real token) takes a softmax "
                    "over nothing, NaN, and its values carry it into the next layer, where "
                    "a weight of 0 times NaN is NaN for every query: let such a query see "
                    "some slot (rose lets it see every slot)"
                )
        return out

    cache.prepare, cache.update = prepared, checked


def cache_in_model(
    batch: int, chunk: int | None, dtype: torch.dtype = torch.float32, there: bool = False
) -> Callable:
    """A part: rose's GPT on the learner's cache, every step's logits against the oracle's
    (`there`: the model on another device)."""

    def run(module: types.ModuleType) -> None:
        rows, model = prompts(batch), model_in(dtype, there)

        def steps() -> list[torch.Tensor]:
            with placed(module, there):
                cache = new_cache(module, rows, model)
                watched_updates(cache, len(rows), dtype, model.lm_head.weight.device)
                return list(cached_steps(cache, rows, chunk, model))

        every_step = made("every step's logits", steps)
        if (
            not grading.judging()
        ):  # the oracle's logits are the grader's to make, for its comparisons
            return
        for step, logits in enumerate(every_step):
            for row, prompt in enumerate(rows):
                want = oracle_logits(prompt, dtype)[step]
                where = "the prefill's logits" if step == 0 else f"decode step {step}"
                where += f", row {row}" if batch > 1 else ""
                if dtype != torch.float32:
                    where += f" ({dtype})"
                tolerance = (
                    logit_tolerance(want)
                    if dtype == torch.float32
                    else BF16_RTOL * float(want.abs().max())
                )
                gap = first_gap(logits[row], want, tolerance)
                if gap is not None:
                    raise Mismatch(f"{where}: {gap}")

    return run


def memory(module: types.ModuleType) -> tuple[set[str], list[int], dict[int, int]]:
    """Where the learner's cache of a model moved to another device (as to a GPU) keeps
    its tensors; then, on a ragged batch of three: the bytes the cache holds at each step,
    and in how many different tensors each layer's keys come back."""
    with placed(module, True):
        cache = module.StaticCache(model_in(torch.float32, True), 2, 8, [0, 1])
    devices = {t.device.type for t in held_tensors(cache).values()}
    rows = prompts(3)
    cache = new_cache(module, rows)
    update = cache.update
    returned: dict[int, set[int]] = {}  # layer -> the storages its keys came back in

    def recorded(layer: int, k: torch.Tensor, v: torch.Tensor) -> object:
        out = update(layer, k, v)
        returned.setdefault(layer, set()).add(out[0].untyped_storage().data_ptr())
        return out

    cache.update = recorded
    held = [
        sum(t.untyped_storage().nbytes() for t in held_tensors(cache).values())
        for _ in cached_steps(cache, rows, None)
    ]
    return devices, held, {layer: len(storages) for layer, storages in returned.items()}


def _memory(module: types.ModuleType) -> None:
    devices, held, storages = made("the cache's devices and memory", lambda: memory(module))
    strays = sorted(set(devices) - {"meta"})
    if strays:
        raise Mismatch(
            f"on a model moved to another device (meta, as to a GPU) the cache keeps "
            f"tensors on the {strays[0]}: make every tensor it keeps (buffers, padding, "
            "slots) on the device of the model's weights, or it fails on a GPU"
        )
    if len(set(held[1:])) > 1:
        raise Mismatch(
            f"the cache holds {held[1]:,} bytes at decode step 1 and {held[-1]:,} at "
            f"decode step {NEW - 1}: a static cache allocates its buffers once"
        )
    for layer, different in storages.items():
        if different > 1:
            raise Mismatch(
                f"layer {layer}'s keys come back in {different} different tensors over "
                f"{NEW} calls: write into the buffers in place"
            )


def _layer_update(module: types.ModuleType) -> None:
    generator = torch.Generator().manual_seed(3)
    start = [torch.randn(3, 2, 9, 4, generator=generator) for _ in range(2)]  # three rows
    new = [torch.randn(3, 2, 4, 4, generator=generator) for _ in range(2)]
    input_pos = torch.tensor([2, 3, 4, 5])
    mine = [t.clone() for t in start]
    returned = module.StaticLayer(*mine).update(input_pos, *new)
    for buffer, values in zip(start, new, strict=True):
        buffer[:, :, input_pos] = values
    for name, got, back, want in zip(("keys", "values"), mine, returned, start, strict=True):
        expect_close(f"the {name} buffer after writing slots 2..5", got, want, 0.0)
        expect_close(f"the {name} update returns", back, want, 0.0)


def roses_static_cache(
    model: GPT, batch_size: int, max_len: int, pad_lengths: list[int] | None = None
) -> StaticKVCache:
    """rose's static cache, built as the learner's loop builds its own: the loop is graded
    on its own."""
    cache = StaticKVCache(model, batch_size, max_len)
    if pad_lengths is not None and max(pad_lengths) > 0:
        cache.reset(torch.tensor(pad_lengths, device=model.lm_head.weight.device))
    return cache


class Watched:
    """rose's GPT as a learner's loop sees it: every call recorded (rows, tokens a row, the
    cache passed, the positions that cache holds after it; the ids' device apart, in
    `devices`), and its vocabulary relabelled
    by swapping two token ids (`swap`), in the ids it is fed and in the logits it returns.
    The relabelled model is a model like any other: its greedy run of a relabelled prompt
    is the oracle's run relabelled, so end-of-text can be made to come up mid-run.
    Everything else is the model's own (config, weights, eval, ...)."""

    def __init__(self, model: GPT, swap: tuple[int, int]) -> None:
        self.model = model
        self.calls: list[tuple[int, int, object, int | None]] = []
        self.devices: set[str] = set()
        self.relabel = relabelling(swap).to(model.lm_head.weight.device)

    def __getattr__(self, name: str) -> object:
        return getattr(self.model, name)

    def __call__(self, idx: torch.Tensor, targets=None, cache=None, **options):
        self.devices.add(idx.device.type)
        out = self.model(self.relabel[idx], targets, cache, **options)
        # rose's cache says how much it holds
        self.calls.append(
            (int(idx.size(0)), int(idx.size(-1)), cache, getattr(cache, "seq_len", None))
        )
        return out._replace(logits=out.logits[..., self.relabel])

    forward = __call__


def relabelling(swap: tuple[int, int]) -> torch.Tensor:
    relabel = torch.arange(oracle_model().config.vocab_size)
    relabel[list(swap)] = torch.tensor(swap[::-1])
    return relabel


def loop_run(
    module: types.ModuleType, rows: list, chunk: int | None, swap: tuple[int, int], there: bool
) -> tuple:
    """The learner's loop on the relabelled prompts, on rose's static cache and the watched
    model (`there`: moved to another device): the tokens it returns, the prompt lists after
    the call, the rows of each StaticCache it built, its model calls as (rows, tokens a
    row, the cache passed: the number of the one it built, None, or -1 for another, the
    positions held after), and the devices of the ids it fed."""
    with placed(module, there):
        return watched_loop(module, rows, chunk, Watched(model_in(torch.float32, there), swap))


def watched_loop(module: types.ModuleType, rows: list, chunk: int | None, model: Watched) -> tuple:
    built = []

    def static_cache(*args, **kwargs) -> StaticKVCache:
        built.append(roses_static_cache(*args, **kwargs))
        return built[-1]

    fed = [model.relabel[torch.tensor(row)].tolist() for row in rows]
    with mock.patch.object(module, "StaticCache", static_cache):
        tokens = module.generate_cached(model, fed, NEW, chunk)
    number = {id(cache): i for i, cache in enumerate(built)}
    calls = [
        (n, q, None if c is None else number.get(id(c), -1), held) for n, q, c, held in model.calls
    ]
    return tokens, fed, [cache.batch_size for cache in built], calls, sorted(model.devices)


def expect_cached_calls(
    calls: list, built: list[int], rows: int, longest: int, chunk: int | None
) -> None:
    """The calls of a cached loop: one StaticCache, every call on it with every row, the
    prefill in prefill_chunk pieces, then one token a row per decode step."""
    if built != [rows]:
        raise Mismatch(
            f"StaticCache is built {len(built)} times in one run, for {built} rows: the loop "
            f"builds one StaticCache, for every prompt at once ({rows} rows), and feeds each "
            "token through it once"
        )
    fed = 0
    for number, (call_rows, q_len, cache, held_after) in enumerate(calls, 1):
        fed += q_len
        if cache != 0:
            what = "without a cache" if cache is None else "on another cache"
            raise Mismatch(
                f"model call {number} runs {what}: every call goes through the one "
                "StaticCache (model(ids, cache=cache)), so no token is run twice"
            )
        if (call_rows, held_after) != (rows, fed):
            raise Mismatch(
                f"model call {number} feeds {call_rows} row(s) of {rows}, and leaves the cache "
                f"holding {held_after} positions where {fed} tokens were fed: every prompt goes "
                "through every call at once, a row each"
            )
    sizes, size = [q_len for _, q_len, _, _ in calls], chunk or longest
    want = [min(size, longest - start) for start in range(0, longest, size)]
    prefill, total = [], 0  # the pieces up to the prompts' end (in any order: as good)
    for q_len in sizes:
        if total >= longest:
            break
        prefill.append(q_len)
        total += q_len
    if total != longest or max(prefill, default=0) > size or len(prefill) != len(want):
        how = "at once" if chunk is None else "prefill_chunk tokens a call"
        raise Mismatch(
            f"the prefill feeds the {longest} padded prompt tokens as {prefill} with "
            f"prefill_chunk={chunk}: the padded prompts go through the model {how} ({want})"
        )
    decode = sizes[len(want) :]
    if any(size != 1 for size in decode):
        raise Mismatch(
            f"after the prefill the model is fed {decode} tokens a call: every decode step "
            "feeds each row's newest token alone"
        )
    if len(decode) not in (NEW - 1, NEW):
        raise Mismatch(
            f"{len(decode)} decode calls for {NEW} new tokens: one call a token after the "
            f"first ({NEW - 1}; the last token need not be fed)"
        )


def loop(batch: int, chunk: int | None, there: bool = False) -> Callable:
    """A part: the learner's loop on rose's static cache, each row against its oracle run,
    and its calls against a cached loop's (`there`: the model on another device)."""

    def run(module: types.ModuleType) -> None:
        rows = prompts(batch)
        # Relabelled so that row 0's greedy token at EOT_STEP is end-of-text.
        swap = (reference_tokens(rows[0], NEW)[EOT_STEP], END_OF_TEXT)
        got, fed, built, calls, devices = made(
            "the run", lambda: loop_run(module, rows, chunk, swap, there)
        )
        strays = [device for device in devices if device != ("meta" if there else "cpu")]
        if strays:
            raise Mismatch(
                f"{MOVED}, generate_cached feeds it ids on the {strays[0]}: make them on the "
                "model's device (torch.tensor(rows, device=model.lm_head.weight.device)), "
                "or the loop fails on a GPU"
            )
        relabel = relabelling(swap)
        for row, (after, prompt) in enumerate(zip(fed, rows, strict=True)):
            if after != relabel[torch.tensor(prompt)].tolist():
                raise Mismatch(
                    f"generate_cached changed the prompt lists it was given (row {row} was "
                    f"{relabel[torch.tensor(prompt)].tolist()}, is {after}): they are the "
                    "caller's; pad a copy"
                )
        if not isinstance(got, list) or len(got) != len(rows):
            raise Mismatch(f"it returns {type(got).__name__} where {len(rows)} lists are right")
        for row, prompt in enumerate(rows):
            want = relabel[torch.tensor(reference_tokens(prompt, NEW))].tolist()
            tokens = [int(t) for t in got[row]]
            if tokens != want:
                raise Mismatch((f"row {row}: " if batch > 1 else "") + token_gap(tokens, want))
        expect_cached_calls(calls, built, len(rows), max(map(len, rows)), chunk)

    return run


def token_gap(tokens: list[int], want: list[int]) -> str:
    """Where a row's tokens leave the oracle's, in words (end-of-text named)."""
    step = next((i for i, (a, b) in enumerate(zip(tokens, want, strict=False)) if a != b), None)
    if step is not None:
        return (
            f"step {step} (token {step + 1} of {NEW}) is {tokens[step]} where the uncached "
            f"oracle gives {want[step]}"
        )
    said = f"{len(tokens)} new tokens where {NEW} are right"
    if len(tokens) < NEW and END_OF_TEXT in tokens:
        said += (
            f": it stops after end-of-text ({END_OF_TEXT}, step {tokens.index(END_OF_TEXT)}), "
            "where the contract decodes max_new_tokens tokens whatever they are (no "
            "stopping early)"
        )
    return said


def _probe(module: types.ModuleType) -> list[object]:
    """Layer writes on three rows, every step's logits of a ragged batch of two in chunks
    of 2 on the learner's cache, and the learner's loop on that batch."""
    generator = torch.Generator().manual_seed(5)
    buffers = [torch.zeros(3, 1, 6, 2) for _ in range(2)]
    new = [torch.randn(3, 1, 2, 2, generator=generator) for _ in range(2)]
    module.StaticLayer(*buffers).update(torch.tensor([1, 2]), *new)
    rows = [encoded(PROMPT), encoded("Good night")]
    steps = list(cached_steps(new_cache(module, rows), rows, 2))
    with mock.patch.object(module, "StaticCache", roses_static_cache):
        tokens = module.generate_cached(oracle_model(), [list(r) for r in rows], 4, 2)
    return [buffers, steps, tokens]


# The runs the cache and the loop are each graded on: (rows, prefill_chunk, on another
# device).
CASES = {
    "one row": (1, None, False),
    "ragged batch of 3": (3, None, False),
    f"prefill in chunks of {CHUNK}, on another device": (3, CHUNK, True),
    "prefill a token a call": (3, 1, False),
}

CACHED_LOOP = Build(
    name="cached_loop",
    chapters="02-06",
    task="a static KV cache that plugs into rose's GPT, and the cached greedy loop",
    parts=(
        Part("layer update", _layer_update),
        *(
            Part(f"cache, {case}", cache_in_model(rows, chunk, torch.float32, there))
            for case, (rows, chunk, there) in CASES.items()
        ),
        Part("cache, bfloat16 model", cache_in_model(3, CHUNK, torch.bfloat16)),
        Part("cache memory", _memory),
        *(Part(f"loop, {case}", loop(*run)) for case, run in CASES.items()),
        Part("loop, prefill_chunk past the prompts", loop(3, 40)),
    ),
    probe=_probe,
    known_wrong=KNOWN_WRONG,
    passed="equal to the uncached oracle",
)
