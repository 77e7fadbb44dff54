"""Constraints compiled for the request handlers, without one client holding up another.

A new constraint is compiled first in a worker process (roseinfer/request/
grammar_process.py), for up to COMPILE_TIMEOUT_S, and a handler waits for it on a
thread. Those threads are a pool of their own here, bounded, never asyncio's default
executor: a plain request needs threads too (its chat template renders on one, its
prompt is tokenized on one), and when compiles waited on the default executor, ten
slow regexes from one client held every thread of it and a plain chat request took 30 s.

Each client (its address, as `connections.client_of` names it) has at most `per_client`
new constraints compiling at once; one more is answered 429 at once. A budget, not a
sharper memory of refusals: the workers remember a refused constraint by its text, and
a client that changes one digit of a slow regex sends a new text; nothing short of
compiling it says a text will compile slowly. A budget bounds what any stream of new
texts can cost: one worker per client, whatever it sends. What a well-behaved client
sends costs it nothing: a constraint already compiled comes from the cache, and one
already compiling (another request's) is waited for, compiled once.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

from roseinfer.request.grammar_process import WORKERS
from roseinfer.request.sampling_params import StructuredOutputs
from roseinfer.request.structured import Grammar, cached_grammar, grammar_for, grammar_text
from rosetrainer.tokenizer import Tokenizer

DEFAULT_PER_CLIENT = 1  # new constraints compiling at once, from one client
# Threads that wait for a worker, or find a constraint in the cache: more than the
# workers, so that cached constraints and refusals are answered while every worker runs.
THREADS = 4 * WORKERS


class TooManyCompiles(Exception):
    """The client has its share of new constraints compiling already (-> 429)."""


class Compiles:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, per_client: int) -> None:
        self.tokenizer, self.vocab_size, self.per_client = tokenizer, vocab_size, per_client
        self.executor = ThreadPoolExecutor(THREADS, thread_name_prefix="rose-compile")
        self.lock = threading.Lock()
        self.compiling: dict[str, Future[Grammar]] = {}  # by grammar text
        self.held: Counter[str] = Counter()  # new constraints compiling, by client

    async def grammar(self, spec: StructuredOutputs, client: str | None) -> Grammar:
        """`spec` compiled (InvalidParam: refused); TooManyCompiles when `client` already
        has `per_client` new constraints compiling. client None: not bounded (a proxy's)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self._grammar, spec, client)

    def close(self) -> None:
        """Let the threads go (the server has stopped: no handler waits any more)."""
        self.executor.shutdown(wait=False, cancel_futures=True)

    def _grammar(self, spec: StructuredOutputs, client: str | None) -> Grammar:
        text = grammar_text(spec)
        grammar = cached_grammar(self.tokenizer.name, text)
        if grammar is not None:
            return grammar
        with self.lock:
            running = self.compiling.get(text)
            if running is not None:  # another request's: compiled once, for both
                mine = False
            elif client is not None and self.held[client] >= self.per_client:
                raise TooManyCompiles(
                    f"this client has {self.held[client]} new constraint(s) compiling already "
                    f"(at most {self.per_client}, --max-compiles-per-client): wait for them "
                    "(a compiled constraint is cached: sending it again costs nothing)"
                )
            else:
                mine, running = True, Future()
                self.compiling[text] = running
                if client is not None:
                    self.held[client] += 1
        if not mine:
            return running.result()
        try:
            grammar = grammar_for(spec, self.tokenizer, self.vocab_size)
        except BaseException as err:
            running.set_exception(err)
            raise
        else:
            running.set_result(grammar)
            return grammar
        finally:
            with self.lock:
                del self.compiling[text]
                if client is not None:
                    self.held[client] -= 1
                    if not self.held[client]:
                        del self.held[client]
