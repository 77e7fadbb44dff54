"""Constraints compiled for the request handlers, without one client holding up another.

A new constraint is compiled first in a worker process (roseinfer/request/
grammar_process.py), for up to COMPILE_TIMEOUT_S, and the compile waits for it on a
thread. Those threads are a pool of their own here, bounded, never asyncio's default
executor: a plain request needs threads too (its chat template renders on one, its
prompt is tokenized on one), and when compiles waited on the default executor, ten
slow regexes from one client held every thread of it and stalled every plain chat request.
Only a compile takes a thread of the pool: a constraint in the cache is answered without
one, and a request whose constraint another request is compiling already waits for that
compile on the event loop (when the duplicates each held a thread, one client sending
one slow regex twelve times made every other client's constraint wait for it).

Each client (its address, as `connections.client_of` names it) has at most `per_client`
new constraints compiling or waiting for a thread at once; one more is answered 429 at
once. A budget, not a sharper memory of refusals: the workers remember a refused
constraint by its text, and a client that changes one digit of a slow regex sends a new
text; nothing short of compiling it says a text will compile slowly. A budget bounds
what any stream of new texts can cost: one worker per client, whatever it sends. The
budget is taken while the client's requests for the text wait: the last of them that
goes (its client left, its handler was cancelled) gives it back at once, and a compile
nobody waits for any more is dropped if it has no worker yet, queued for a thread or
waiting for a worker (sixteen abandoned slow regexes from sixteen addresses held up a
newcomer's compile until they had all run); one that has a worker runs to its end, for the cache, as
nothing can stop it midway. What a well-behaved client sends costs it nothing: a constraint already compiled comes from the
cache, and one already compiling (another request's) is waited for, compiled once.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from roseinfer.request.grammar_process import WORKERS
from roseinfer.request.sampling_params import StructuredOutputs
from roseinfer.request.structured import Grammar, cached_grammar, grammar_for, grammar_text
from rosetrainer.tokenizer import Tokenizer

DEFAULT_PER_CLIENT = 1  # new constraints compiling (or waiting to) at once, from one client
# Threads that wait for a worker: more than the workers, so that a compile refused by
# the workers' memory of refusals is answered while every worker runs.
THREADS = 4 * WORKERS


class TooManyCompiles(Exception):
    """The client has its share of new constraints compiling already (-> 429)."""


@dataclass
class Compile:
    """One constraint's compile, shared by every request that waits for it."""

    job: Future[Grammar]  # on the pool (cancelled while no thread has taken it)
    result: asyncio.Future[Grammar]  # the same, awaited on the event loop
    abandoned: threading.Event  # set when nobody waits for it any more
    payer: str | None  # the client whose budget it takes, while its requests wait
    waiting: Counter[str | None] = field(default_factory=Counter)  # requests, by client


class Compiles:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, per_client: int) -> None:
        self.tokenizer, self.vocab_size, self.per_client = tokenizer, vocab_size, per_client
        self.executor = ThreadPoolExecutor(THREADS, thread_name_prefix="rose-compile")
        # A constraint's text takes milliseconds, a huge one tens of them: off the event
        # loop, on a thread that never waits for a compile.
        self.texts = ThreadPoolExecutor(1, thread_name_prefix="rose-constraint-text")
        # Touched on the event loop only: no lock.
        self.compiling: dict[str, Compile] = {}  # by grammar text
        self.held: Counter[str] = Counter()  # new constraints compiling, by client

    async def grammar(self, spec: StructuredOutputs, client: str | None) -> Grammar:
        """`spec` compiled (InvalidParam: refused); TooManyCompiles when `client` already
        has `per_client` new constraints compiling. client None: not bounded (a proxy's)."""
        text = await asyncio.get_running_loop().run_in_executor(self.texts, grammar_text, spec)
        grammar = cached_grammar(self.tokenizer.name, text)
        if grammar is not None:
            return grammar
        compile = self.compiling.get(text)
        if compile is None:  # a new constraint: this client's budget pays for it
            self.take(client)
            compile = self.start(spec, text, client)
        compile.waiting[client] += 1
        try:
            return await asyncio.shield(compile.result)
        finally:
            compile.waiting[client] -= 1
            if client == compile.payer and not compile.waiting[client]:
                # (while one of its requests waits, sending a text twice and leaving
                # once would compile it on no budget)
                self.give_back(client)
                compile.payer = None
            if not compile.waiting.total():  # dropped, unless it has a worker already
                compile.job.cancel()
                compile.abandoned.set()
                self.forget(text, compile)  # (a later request compiles it anew)

    def close(self) -> None:
        """Let the threads go (the server has stopped: no handler waits any more)."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.texts.shutdown(wait=False, cancel_futures=True)

    def take(self, client: str | None) -> None:
        if client is None:
            return
        if self.held[client] >= self.per_client:
            raise TooManyCompiles(
                f"this client has {self.held[client]} new constraint(s) compiling already "
                f"(at most {self.per_client}, --max-compiles-per-client): wait for them "
                "(a compiled constraint is cached: sending it again costs nothing)"
            )
        self.held[client] += 1

    def give_back(self, client: str | None) -> None:
        if client is None:
            return
        self.held[client] -= 1
        if not self.held[client]:
            del self.held[client]

    def start(self, spec: StructuredOutputs, text: str, client: str | None) -> Compile:
        abandoned = threading.Event()
        job = self.executor.submit(grammar_for, spec, self.tokenizer, self.vocab_size, abandoned)
        compile = Compile(job, asyncio.wrap_future(job), abandoned, client)
        self.compiling[text] = compile
        compile.result.add_done_callback(lambda _: self.finished(text, compile))
        return compile

    def finished(self, text: str, compile: Compile) -> None:
        # A refusal or an Abandoned nobody waits for (its requests left): nothing to log.
        if not compile.result.cancelled():
            compile.result.exception()
        self.forget(text, compile)

    def forget(self, text: str, compile: Compile) -> None:
        if self.compiling.get(text) is compile:  # (not a later compile of the same text)
            del self.compiling[text]
