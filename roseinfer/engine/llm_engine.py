"""The serving engine: requests in (`add_request`), one model step at a time
(`step`), outputs out; `abort` cancels. A server drives it from one thread.

Reading order for the whole engine: `Sequence` (roseinfer/request/sequence.py, one
request's state) and `EngineSequence` (engine/sequence.py, the engine's bookkeeping of
it) -> `BlockManager` (which blocks hold whose tokens, the prefix cache) ->
`KVPool` / `PagedKVCache` (the memory, and the model's view of it) -> `Scheduler`
(who runs in the next step) -> `ModelRunner` (the step through the model) -> this
file, which ties them together and samples each request's next token with its own
parameters and random stream.

Whatever the schedule, a request's tokens are those of its solo run
(`roseinfer.loops.generate.generate`): its keys and values are exactly the ones it would
compute alone, its logits depend on nothing else in the batch, and it draws from its
own generator.

Speculative decoding (a `drafter` and num_speculative_tokens): after a step's forward
and postprocess, `propose_drafts` asks the drafter once for the greedy requests that
decode next and have no drafts, and keeps each one's drafts on it (`draft_ids`); the
next step's scheduler takes as many of them as fit (it never calls the drafter), and
that request's step feeds its newest token and its drafts as one chunk. `postprocess`
verifies them (`verify_drafts`, the teaching loop's rule), counts only the accepted
tokens as computed, and gives back the blocks that held only rejected ones
(`BlockManager.trim`). A request with structured output is verified under its grammar's
mask, position by position, and its drafts are cut where the grammar forbids one as
they are proposed (`within_grammar`).
A sampled request decodes one token a step: how many drafts a step can carry depends
on the batch (budget, free blocks), and a seeded request must draw the same tokens
alone or in any batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

from roseinfer.cache.paged import KVPool, make_pool
from roseinfer.cache.quantized import kv_bytes_per_token
from roseinfer.engine.block_manager import (
    BlockManager,
    BlockManagerProtocol,
    blocks_for,
    blocks_short,
)
from roseinfer.engine.config import EngineConfig
from roseinfer.engine.drafting import PoolDrafter
from roseinfer.engine.model_runner import ModelRunner
from roseinfer.engine.outputs import (
    EngineStats,
    RequestOutput,
    RequestOutputKind,
    TokenLogprob,
    token_logprob,
)
from roseinfer.engine.scheduler import ScheduledBatch, Scheduler
from roseinfer.engine.sequence import EngineSequence
from roseinfer.request.sampling import SamplingParams, sample_rows
from roseinfer.request.structured import grammar_for
from roseinfer.request.token_step import ErrorCallback, take_tokens
from roseinfer.speculative.drafters import (
    Drafter,
    ModelDrafter,
    SpeculativeConfig,
    check_speculative_tokens,
    first_layers,
    is_first_layers,
    load_drafter,
)
from roseinfer.speculative.verify import Draft, SpeculativeStats, verify_drafts, within_grammar
from rosetrainer.errors import RoseError, one_line
from rosetrainer.model import GPT
from rosetrainer.tokenizer import Tokenizer

__all__ = ["EngineStats", "LLMEngine", "RequestOutput", "RequestOutputKind", "TokenLogprob"]


class LLMEngine:
    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        drafter: Drafter | None = None,
        num_speculative_tokens: int | None = None,
        block_manager_class: Callable[..., BlockManagerProtocol] = BlockManager,
        scheduler_class: Callable[..., Scheduler] = Scheduler,
    ) -> None:
        """drafter, num_speculative_tokens: speculative decoding (both, or neither).
        block_manager_class: what makes the pool's bookkeeping, called as BlockManager is
        (another implementation of BlockManagerProtocol: a learner's, say);
        scheduler_class: what makes the scheduler, called as Scheduler is (a subclass with
        another policy)."""
        config = EngineConfig() if config is None else config  # (frozen: safe to share)
        if (drafter is None) != (num_speculative_tokens is None):
            raise RoseError("speculative decoding takes a drafter and num_speculative_tokens")
        if drafter is not None:
            check_speculative_tokens(num_speculative_tokens, model, "the model's")
        self.num_speculative_tokens = num_speculative_tokens
        self.speculative_stats = SpeculativeStats() if drafter is not None else None
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config
        # A request holds at most the context window of tokens: the model's learned
        # positions end there (see add_request).
        self.max_model_len = model.config.block_size
        # A sequence stops when its next token would have no position left; a rotary model
        # with a sliding window never runs out of positions.
        self.length_limit = None if model.config.unbounded else self.max_model_len
        weight = model.lm_head.weight  # the pool lives where the weights do, in their dtype
        config.check_model(model.config)
        # A draft model keeps its keys in the pool's blocks (roseinfer.engine.drafting): in
        # a pool of its own, sized with the target's, unless it is the target's first
        # layers over a plain pool, whose keys the target's pool holds already.
        draft = drafter.model if isinstance(drafter, ModelDrafter) else None
        self_draft = draft is not None and is_first_layers(draft, model)
        own_pool = draft is not None and not (self_draft and config.kv_cache_dtype == "auto")
        if draft is not None:
            check_engine_draft(draft, model)
        draft_bytes = draft_block_bytes(draft, config.kv_block_size) if own_pool else 0
        num_blocks = config.pool_blocks(
            model.config, weight.element_size(), draft_bytes, weight.device
        )
        attention = config.attention_on(weight.device)
        # Decode steps in CUDA graphs (roseinfer.engine.cuda_graphs): FlexAttention over a
        # plain pool, a bounded context; the pool has one spare block for padding rows.
        graphs = not config.enforce_eager and attention == "flex"
        graphs = graphs and config.kv_cache_dtype == "auto" and self.length_limit is not None
        graphs = graphs and model.config.sliding_window is None
        pool_blocks = num_blocks + 1 if graphs else num_blocks
        try:
            self.pool = make_pool(model.config, pool_blocks, config, weight.dtype, weight.device)
        except RuntimeError as err:  # (out of memory) what the free memory did not tell
            raise RoseError(
                f"the KV pool of {pool_blocks} blocks does not fit on {weight.device} "
                f"({one_line(err)}): give a smaller kv_cache_memory"
            ) from None
        self.block_manager = block_manager_class(
            num_blocks,
            config.kv_block_size,
            config.enable_prefix_caching,
            config.shuffle_blocks_seed,
            model.config.sliding_window,
            model.config.attention_sinks,
        )
        self.scheduler = scheduler_class(config, self.block_manager)
        self.runner = ModelRunner(
            model,
            self.pool,
            attention,
            config.record_writes,
            config.max_num_seqs,
            config.pack_weights,
            graphs,
        )
        self.draft_pool: KVPool | None = None  # a draft model's own pool
        self.drafter: Drafter | PoolDrafter | None = drafter
        if draft is not None:
            if own_pool:  # in the draft's dtype, on its device (they may differ from the target's)
                own = draft.lm_head.weight
                flex = config.attention_on(own.device) == "flex"
                self.draft_pool = KVPool(
                    draft.config, num_blocks, config.kv_block_size, own.dtype, own.device, flex
                )
            if self_draft:  # (the target's packed weights, shared)
                draft = first_layers(self.runner.model, draft.config.n_layer)
            runner = ModelRunner(
                draft,
                self.draft_pool if own_pool else self.pool,
                config.attention_on((self.draft_pool or self.pool).device),
                max_num_seqs=config.max_num_seqs,
                pack_weights=config.pack_weights and not self_draft,
            )
            self.drafter = PoolDrafter(runner, own_pool)
        self.requests: dict[str, EngineSequence] = {}  # unfinished, by id
        self.aborted: list[EngineSequence] = []  # aborted since the last step (reported by it)
        self.last_batch = ScheduledBatch()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.step_seconds: dict[str, float] = defaultdict(float)  # where the time went
        self._ids = itertools.count()

    # -- admission --

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> str:
        """Admit a request and return its id; a bad one raises RoseError and changes nothing.
        output_kind: what its outputs carry (CUMULATIVE: the whole request in every step's
        output, for looking at it step by step; a server streams DELTA, a caller that
        wants the finished requests only asks for FINAL_ONLY)."""
        if not isinstance(params, SamplingParams):
            raise RoseError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(output_kind, RequestOutputKind):
            raise RoseError(f"output_kind must be a RequestOutputKind, got {output_kind!r}")
        if params.n != 1:
            raise RoseError(
                f"add_request runs one completion, got n={params.n}: LLM.generate and "
                f"rose-serve run each of n completions as a request of its own"
            )
        prompt_ids = self._prompt_ids(prompt)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RoseError(f"request id {request_id!r} is already running: pick another")
        # The most tokens it will ever hold in the pool: it stops at max_tokens, or when
        # its next token could not be fed (the context window is full).
        longest = min(len(prompt_ids) + params.max_tokens - 1, self.max_model_len)
        needed = blocks_for(longest, self.config.kv_block_size)
        if needed > self.block_manager.num_blocks:
            raise RoseError(
                f"request needs {needed} KV blocks ({longest} tokens) but the pool holds "
                f"{self.block_manager.num_blocks}: lower max_tokens or give the pool more memory"
            )
        seq = EngineSequence(
            prompt_ids,
            params,
            request_id=request_id,
            eos_id=self.tokenizer.eot_id,
            decode=self.tokenizer.decode,
            device=self.pool.device,
            # Compiled here only when the caller did not already (the server compiles in
            # its request handler; the cache then hands this the same grammar).
            grammar=grammar_for(
                params.structured_outputs, self.tokenizer, self.model.config.vocab_size
            ),
            output_kind=output_kind,
        )
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        self.prompt_tokens += len(prompt_ids)
        return request_id

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif not isinstance(prompt, (list, tuple)):
            raise RoseError(
                f"a prompt is a string or a list of token ids, got {type(prompt).__name__}"
            )
        else:
            ids = list(prompt)
            vocab = self.model.config.vocab_size
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)]
            bad = bad or [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RoseError(
                    f"prompt token {bad[0]!r} is not an id in the vocabulary [0, {vocab})"
                )
        if not ids:  # an empty prompt starts from end-of-text, as in training
            ids = [self.tokenizer.eot_id]
        if len(ids) > self.max_model_len:
            raise RoseError(
                f"prompt has {len(ids)} tokens but the model's context (block_size) is "
                f"{self.max_model_len}: shorten it"
            )
        return ids

    def abort(self, request_id: str) -> None:
        """Cancel a request: its blocks go back now; the next step reports it finished."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return
        seq.finish("abort")
        self._finish(seq)
        self.aborted.append(seq)

    # -- one step: schedule -> run -> postprocess (-> propose drafts) --

    def step(self) -> list[RequestOutput]:
        """Schedule and run one model step; one output per request that made a token or
        finished (aborted and failed ones included) in it, a FINAL_ONLY one's only when
        it finished. With a drafter, the drafts for the next step are proposed last."""
        outputs = reports(self.aborted)
        self.aborted = []
        batch = self.schedule()
        if not batch.seqs:
            return outputs
        sampling, logits = self.run(batch)
        outputs += self.postprocess(sampling, logits)
        if self.drafter is not None:
            self.propose_drafts()
        return outputs

    def schedule(self) -> ScheduledBatch:
        """Who runs in this step, and how many tokens each feeds."""
        with self._timed("schedule"):
            if self.pool.quantized:
                # Blocks out of every running sequence's window go to their codes. Done
                # first, once finished and aborted sequences are gone, so that the exact
                # blocks are at most those of max_num_seqs windows plus this step's.
                running = self.scheduler.running
                tables = [seq.block_table for seq in running]
                self.pool.settle(tables, [seq.num_computed_tokens for seq in running])
            self.last_batch = self.scheduler.schedule()
        return self.last_batch

    def run(self, batch: ScheduledBatch) -> tuple[list[EngineSequence], torch.Tensor]:
        """The model step: the sequences that sample now, and their next-token logits."""
        sampling, logits = self.runner.run(batch.seqs, batch.num_new_tokens)
        for phase, seconds in self.runner.seconds.items():
            self.step_seconds[phase] += seconds
        if isinstance(self.drafter, PoolDrafter) and self.drafter.mirrors:
            with self._timed("draft"):  # the step's tokens into the draft model's pool
                self.drafter.mirror(batch.seqs, batch.num_new_tokens)
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            # Drafts count as computed only once accepted (postprocess): a block is
            # registered in the prefix cache only when every token in it is the request's.
            self.block_manager.advance(seq, num_new - len(seq.draft_ids))
        return sampling, logits

    def postprocess(
        self, sampling: list[EngineSequence], logits: torch.Tensor
    ) -> list[RequestOutput]:
        """Each sampling sequence takes its token; the finished ones leave (their blocks
        go back). A request whose handling raises fails alone: it finishes as "abort"
        with its `error`, and every other request keeps its token."""
        with self._timed("sample"):
            errors: dict[int, str] = {}

            def failed(row: int, error: Exception) -> None:
                errors.setdefault(row, one_line(error))

            # Each sequence's logits rows: one, or one more than its drafts.
            firsts = list(itertools.accumulate((1 + len(s.draft_ids) for s in sampling), initial=0))
            plain = [i for i, seq in enumerate(sampling) if not seq.draft_ids]

            def failed_plain(row: int, error: Exception) -> None:
                failed(plain[row], error)

            plain_seqs = [sampling[i] for i in plain]
            # Their rows; in the usual decode step that is every row, in order, and
            # indexing would copy all of them (rows x vocab floats) for nothing.
            plain_rows = [firsts[i] for i in plain]
            every_row = plain_rows == list(range(len(logits)))
            plain_logits = logits if every_row else logits[plain_rows]
            tokens = self._sample(plain_logits, plain_seqs, failed_plain)
            took = take_tokens(plain_seqs, tokens, max_len=self.length_limit, on_error=failed_plain)
            self.generation_tokens += len(took)
            self._add_logprobs(plain_seqs, took, plain_logits, failed_plain)
            for i, seq in enumerate(sampling):
                if seq.draft_ids:
                    self._verify(seq, logits[firsts[i] : firsts[i + 1]], i, failed)
            for row, error in errors.items():
                sampling[row].fail(error)
            for seq in sampling:
                if seq.is_finished:
                    self._finish(seq)
                    del self.requests[seq.request_id]
            return reports(sampling)

    def _finish(self, seq: EngineSequence) -> None:
        """seq is done: out of the scheduler (its blocks back) and the drafter."""
        self.scheduler.finish(seq)
        if self.drafter is not None:
            self.drafter.release(seq)

    # -- speculative decoding --

    def propose_drafts(self) -> None:
        """After the step: drafts for the next one. Every running greedy sequence that
        decodes next and has none is asked for up to its `_draft_limit` (one drafter call
        for all), its drafts cut where its grammar forbids one, and keeps them in
        draft_ids until a step feeds them (the scheduler takes as many as fit then)."""
        with self._timed("draft"):
            seqs, limits = [], []
            for seq in self.scheduler.running:
                if seq.draft_ids or seq.num_computed_tokens + 1 != seq.num_tokens:
                    continue  # (drafts already, or a prompt still to read)
                limit = self._draft_limit(seq)
                if limit > 0:
                    seqs.append(seq)
                    limits.append(limit)
            if isinstance(self.drafter, PoolDrafter):
                seqs, limits = self._reserve_draft_slots(seqs, limits)
            if not seqs:
                return
            drafts = self.drafter.propose(seqs, limits)
            for seq, limit, draft in zip(seqs, limits, drafts, strict=True):
                seq.draft_ids = self._allowed_drafts(seq, draft)[:limit]

    def _reserve_draft_slots(
        self, seqs: list[EngineSequence], limits: list[int]
    ) -> tuple[list[EngineSequence], list[int]]:
        """A draft model writes its drafts' keys into the sequence's blocks: each asking
        sequence takes the blocks for its newest token and its drafts now (the verify
        step feeds those positions next), from the spare ones, those no running
        sequence needs for its own next token, so a draft never costs anyone a step.
        Where too few are spare, fewer drafts; those left with none are not asked."""
        manager, size = self.block_manager, self.config.kv_block_size
        spare = manager.num_available - sum(
            blocks_short(seq, size) for seq in self.scheduler.running
        )
        kept, kept_limits = [], []
        for seq, limit in zip(seqs, limits, strict=True):
            held = max(len(seq.block_table), blocks_for(seq.num_tokens, size))
            limit = min(limit, (held + spare) * size - seq.num_tokens)
            if limit > 0:
                spare -= blocks_for(seq.num_tokens + limit, size) - held
                manager.grow(seq, seq.num_tokens + limit)
                kept.append(seq)
                kept_limits.append(limit)
        return kept, kept_limits

    @staticmethod
    def _allowed_drafts(seq: EngineSequence, draft: Draft) -> list[int]:
        """A constrained request's drafts stop where its grammar forbids one (they never
        take room in a step). A look-ahead the library fails costs the request its
        drafts only: its matcher is then in error, and its own sampling step fails it
        alone, as any broken matcher does."""
        try:
            return within_grammar(seq, draft).tokens
        except RoseError:
            return []

    def _draft_limit(self, seq: EngineSequence) -> int:
        """How many drafts seq may carry: k, what it may still make (its last token is
        never fed), the context's positions; 0 for a sampled request (see the module's
        docstring). How many of them fit in a step is the scheduler's to say."""
        if not seq.params.greedy:
            return 0
        limit = min(self.num_speculative_tokens, seq.params.max_tokens - len(seq.output_ids) - 1)
        if self.length_limit is not None:
            limit = min(limit, self.length_limit - seq.num_tokens)
        return limit

    def _verify(
        self, seq: EngineSequence, logits: torch.Tensor, row: int, failed: ErrorCallback
    ) -> None:
        """seq's verify chunk ran: it takes the tokens the target chose over its drafts
        (logits: 1 + len(drafts) rows); the accepted drafts count as computed, and blocks
        that held only rejected ones go back."""
        drafted, before, taken = len(seq.draft_ids), len(seq.output_ids), len(seq.token_times)
        accepted = 0
        try:
            accepted = verify_drafts(seq, logits, Draft(seq.draft_ids), max_len=self.length_limit)
            if seq.params.logprobs is not None:
                for i, token in enumerate(seq.output_ids[before:]):
                    seq.logprobs.append(token_logprob(logits[i], token, seq.params.logprobs))
        except Exception as error:
            failed(row, error)
        self.generation_tokens += len(seq.token_times) - taken
        self.speculative_stats.record(drafted, accepted)
        seq.draft_ids = []
        if not seq.is_finished:
            self.block_manager.advance(seq, accepted)
            self.block_manager.trim(seq)

    def _sample(
        self, logits: torch.Tensor, seqs: list[EngineSequence], failed: ErrorCallback
    ) -> list[int | None]:
        """One token per row; a row whose sampling raises gets None (and `failed`).

        The rows sample together; if that raises, each random stream goes back to where
        it was and each row samples alone, so a row draws the same token either way.
        """
        streams = [seq.generator for seq in seqs if seq.generator is not None]
        states = [stream.get_state() for stream in streams]
        try:
            return sample_rows(logits, seqs)
        except Exception:
            for stream, state in zip(streams, states, strict=True):
                stream.set_state(state)
        tokens: list[int | None] = []
        for row, seq in enumerate(seqs):
            try:
                tokens += sample_rows(logits[row : row + 1], [seq])
            except Exception as error:
                failed(row, error)
                tokens.append(None)
        return tokens

    def _add_logprobs(
        self,
        seqs: list[EngineSequence],
        rows: list[int],
        logits: torch.Tensor,
        failed: ErrorCallback,
    ) -> None:
        """A TokenLogprob for each token that joined an output, where asked for."""
        for row in rows:
            seq = seqs[row]
            if seq.params.logprobs is None or len(seq.logprobs) == len(seq.output_ids):
                continue  # not asked for, or the token was end-of-text (not kept)
            try:
                token = seq.output_ids[-1]
                seq.logprobs.append(token_logprob(logits[row], token, seq.params.logprobs))
            except Exception as error:
                failed(row, error)

    @contextlib.contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        yield
        self.step_seconds[phase] += time.perf_counter() - started

    def drain(self, after_step: Callable[[], None] | None = None) -> Iterator[RequestOutput]:
        """Step until no request is left, yielding each request's last output as it finishes
        (in the order they finish); `after_step` runs after every step, and may add requests,
        which the loop then runs too. The one loop that runs the engine to its end: `LLM`,
        `rose-generate` and the benchmarks drain through it (the server steps in its thread)."""
        while self.has_unfinished():
            outputs = self.step()
            if after_step is not None:
                after_step()
            yield from (output for output in outputs if output.finished)

    # -- state --

    def has_unfinished(self) -> bool:
        return bool(self.requests or self.aborted)

    def stats(self) -> EngineStats:
        manager = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks=manager.num_blocks,
            num_kv_blocks_used=manager.num_used,
            prefix_cache_queries=manager.prefix_cache_queries,
            prefix_cache_hits=manager.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            kv_pool_bytes=self.pool.nbytes + (self.draft_pool.nbytes if self.draft_pool else 0),
            speculative=dataclasses.replace(self.speculative_stats)
            if self.speculative_stats is not None
            else None,
        )


def reports(seqs: list[EngineSequence]) -> list[RequestOutput]:
    """The sequences' outputs, from those whose output kind reports now."""
    outputs = (seq.report() for seq in seqs)
    return [output for output in outputs if output is not None]


def draft_block_bytes(draft: GPT, kv_block_size: int) -> int:
    """What a block of a draft model's own pool takes: its keys and values of
    kv_block_size tokens, in its dtype."""
    itemsize = draft.lm_head.weight.element_size()
    return kv_block_size * kv_bytes_per_token(draft.config, "auto", itemsize=itemsize)


def check_engine_draft(draft: GPT, target: GPT) -> None:
    """A draft model in the engine reads its keys at the target's positions, in the blocks
    the target's window keeps: it needs the target's context (or none) and its window."""
    mine, theirs = draft.config, target.config
    if not mine.unbounded and (theirs.unbounded or mine.block_size < theirs.block_size):
        raise RoseError(
            f"the engine's draft model must reach every position of the target's context "
            f"({'unbounded' if theirs.unbounded else theirs.block_size}), but its context is "
            f"{mine.block_size} tokens: use a draft model trained at the target's context"
        )
    if (mine.sliding_window, mine.attention_sinks) != (
        theirs.sliding_window,
        theirs.attention_sinks,
    ):
        raise RoseError(
            "the engine's draft model must have the target's sliding window and sinks "
            f"(it has {mine.sliding_window} and {mine.attention_sinks}, the target "
            f"{theirs.sliding_window} and {theirs.attention_sinks}): it reads the target's blocks"
        )


def speculative_engine(
    model: GPT,
    tokenizer: Tokenizer,
    config: EngineConfig,
    spec: SpeculativeConfig | None,
    draft_model: GPT | None = None,
) -> LLMEngine:
    """The engine, with the drafter `spec` asks for (none without one)."""
    if spec is None:
        return LLMEngine(model, tokenizer, config)
    drafter = load_drafter(spec, model, tokenizer, draft_model)
    return LLMEngine(model, tokenizer, config, drafter, spec.num_speculative_tokens)
