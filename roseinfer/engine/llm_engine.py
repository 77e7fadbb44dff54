"""The serving engine: requests in (`add_request`), one model step at a time
(`step`), outputs out; `abort` cancels. A server drives it from one thread.

Reading order for the whole engine: `Sequence` (roseinfer/request/sequence.py, one request's
state) -> `BlockManager` (which blocks hold whose tokens, the prefix cache) ->
`KVPool` / `PagedKVCache` (the memory, and the model's view of it) -> `Scheduler`
(who runs in the next step) -> `ModelRunner` (the step through the model) -> this
file, which ties them together and samples each request's next token with its own
parameters and random stream.

Whatever the schedule, a request's tokens are those of its solo run
(`roseinfer.loops.generate.generate`): its keys and values are exactly the ones it would
compute alone, its logits depend on nothing else in the batch, and it draws from its
own generator.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict

import torch

from roseinfer.cache.paged import make_pool
from roseinfer.engine.block_manager import BlockManager, blocks_for
from roseinfer.engine.config import EngineConfig
from roseinfer.engine.model_runner import ModelRunner
from roseinfer.engine.outputs import (
    EngineStats,
    RequestOutput,
    TokenLogprob,
    request_output,
    token_logprob,
)
from roseinfer.engine.scheduler import ScheduledBatch, Scheduler
from roseinfer.loops.generate import sample_rows
from roseinfer.request.sampling import SamplingParams
from roseinfer.request.sequence import Sequence
from rosetrainer.errors import RoseError
from rosetrainer.model import GPT
from rosetrainer.tokenizer import Tokenizer

__all__ = ["EngineStats", "LLMEngine", "RequestOutput", "TokenLogprob"]


class LLMEngine:
    def __init__(
        self, model: GPT, tokenizer: Tokenizer, config: EngineConfig | None = None
    ) -> None:
        config = EngineConfig() if config is None else config  # (frozen: safe to share)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config
        # A request holds at most the context window of tokens: the model's learned
        # positions end there (see add_request).
        self.max_model_len = model.config.block_size
        weight = model.lm_head.weight  # the pool lives where the weights do, in their dtype
        config.check_model(model.config)
        num_blocks = config.pool_blocks(model.config, weight.element_size())
        self.pool = make_pool(model.config, num_blocks, config, weight.dtype, weight.device)
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.shuffle_blocks_seed,
            model.config.sliding_window,
            model.config.attention_sinks,
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.runner = ModelRunner(model, self.pool, config.attention)
        self.requests: dict[str, Sequence] = {}  # unfinished, by id
        self.aborted: list[Sequence] = []  # aborted since the last step (reported by it)
        self.last_batch = ScheduledBatch()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.step_seconds: dict[str, float] = defaultdict(float)  # where the time went
        self._ids = itertools.count()

    # -- admission --

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        """Admit a request and return its id; a bad one raises RoseError and changes nothing."""
        if not isinstance(params, SamplingParams):
            raise RoseError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt_ids = self._prompt_ids(prompt)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RoseError(f"request id {request_id!r} is already running: pick another")
        # The most tokens it will ever hold in the pool: it stops at max_tokens, or when
        # its next token could not be fed (the context window is full).
        longest = min(len(prompt_ids) + params.max_tokens - 1, self.max_model_len)
        needed = blocks_for(longest, self.config.block_size)
        if needed > self.block_manager.num_blocks:
            raise RoseError(
                f"request needs {needed} KV blocks ({longest} tokens) but the pool holds "
                f"{self.block_manager.num_blocks}: lower max_tokens or give the pool more memory"
            )
        seq = Sequence(
            prompt_ids,
            params,
            request_id=request_id,
            eos_id=self.tokenizer.eot_id,
            decode=self.tokenizer.decode,
            device=self.pool.device,
        )
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        self.prompt_tokens += len(prompt_ids)
        return request_id

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
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
        self.scheduler.finish(seq)
        self.aborted.append(seq)

    # -- one step --

    def step(self) -> list[RequestOutput]:
        """Schedule and run one model step; one output per request that made a token or
        finished (aborted ones included) in it."""
        started = time.perf_counter()
        if self.pool.quantized:
            # Blocks out of every running sequence's window go to their codes. Done first,
            # once finished and aborted sequences are gone, so that the exact blocks are
            # at most those of max_num_seqs windows plus what this step writes.
            running = self.scheduler.running
            self.pool.settle(
                [seq.block_table for seq in running], [seq.num_computed_tokens for seq in running]
            )
        outputs = [request_output(seq, self.tokenizer) for seq in self.aborted]
        self.aborted = []
        batch = self.scheduler.schedule()
        self.last_batch = batch
        scheduled = time.perf_counter()
        self.step_seconds["schedule"] += scheduled - started
        if not batch.seqs:
            return outputs
        sampling, logits = self.runner.run(batch.seqs, batch.num_new_tokens)
        for phase, seconds in self.runner.seconds.items():
            self.step_seconds[phase] += seconds
        ran = time.perf_counter()
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += num_new
            self.block_manager.register_full_blocks(seq)
        if sampling:
            tokens = sample_rows(logits, sampling)
            now = time.perf_counter()
            for row, (seq, token) in enumerate(zip(sampling, tokens, strict=True)):
                self._append(seq, token, logits[row], now)
                outputs.append(request_output(seq, self.tokenizer))
        self.step_seconds["sample"] += time.perf_counter() - ran
        return outputs

    def _append(self, seq: Sequence, token: int, logits: torch.Tensor, now: float) -> None:
        kept = len(seq.output_ids)
        seq.append_token(token, now)
        self.generation_tokens += 1
        if seq.params.logprobs is not None and len(seq.output_ids) > kept:
            seq.logprobs.append(token_logprob(logits, token, seq.params.logprobs))
        if (
            not seq.is_finished
            and seq.num_tokens > self.max_model_len
            and not self.model.config.unbounded  # (rotary + window: no position runs out)
        ):
            # Its newest token would stand at position block_size: no learned position left.
            seq.finish("length")
        if seq.is_finished:
            self.scheduler.finish(seq)
            del self.requests[seq.request_id]

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
        )
