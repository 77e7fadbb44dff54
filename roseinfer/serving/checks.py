"""A request's fields, checked against this server, as the engine's jobs.

pydantic (protocol.py) checks each field's type and range; what depends on the served
model and the sampler (the model's name, token ids, the context window, what
`SamplingParams` accepts, what --max-waiting can ever admit) is checked here, each
failure a BadRequest naming the field.

Tokenizing is work for a thread, not the event loop: a 1 MiB prompt takes a second or
more, during which no other client (nor /health) would be answered. A prompt is
tokenized on a pool of threads of its own (TOKENIZING), and one certainly too long for
the context is refused before: every token covers at least one byte and at most the
vocabulary's longest token, so a text of more than context x that many bytes has more
tokens than the context holds, whatever they are.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from roseinfer.request.grammar_process import CompilerStopped
from roseinfer.request.sampling_params import (
    InvalidParam,
    SamplingParams,
    StructuredOutputs,
)
from roseinfer.request.structured import Grammar
from roseinfer.serving.compiles import Compiles, TooManyCompiles
from roseinfer.serving.errors import BadRequest
from roseinfer.serving.protocol import ChatMessage, SamplingFields
from roseinfer.speculative.drafters import SAMPLED_NOT_DRAFTED
from rosetrainer.errors import RoseError
from rosetrainer.tokenizer import Tokenizer

Job = tuple[list[int], SamplingParams]  # one engine request: prompt ids and its params
log = logging.getLogger("roseinfer.cli.serve")
TOKENIZING = ThreadPoolExecutor(2, thread_name_prefix="rose-tokenize")  # prompts at once


class RequestChecks:
    """The checks that need this server's model, tokenizer and limits."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        model_name: str,
        block_size: int,
        vocab_size: int,
        max_waiting: int,
        *,
        speculative: bool,
        length_limit: int | None,
        max_waiting_per_client: int,
        compiles: Compiles,
    ) -> None:
        self.tokenizer, self.model_name = tokenizer, model_name
        self.block_size, self.vocab_size, self.max_waiting = block_size, vocab_size, max_waiting
        self.max_waiting_per_client, self.compiles = max_waiting_per_client, compiles
        # The most bytes one token stands for (GPT-2's: 128): the byte bound above.
        self.max_token_bytes = tokenizer.max_token_bytes
        # The most tokens a request may hold, prompt and completion (the engine's
        # length_limit: None for a model whose positions never run out).
        self.length_limit = length_limit
        # Speculative decoding drafts for greedy requests only: the log says so at the
        # first sampled request (once: every request of a default client samples).
        self.speculative, self.told_sampled = speculative, False

    def model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise BadRequest(
                f"model {name!r} does not exist here; this server serves {self.model_name!r}",
                param="model",
                status=404,
            )

    def token_ids(self, ids: list[int], param: str) -> None:
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise BadRequest(
                f"token ids must be in [0, {self.vocab_size}), the vocabulary's ids", param
            )

    async def prompt_ids(
        self, prompt: str | list[str] | list[int] | list[list[int]]
    ) -> list[list[int]]:
        """The prompt (a string, strings, token ids or lists of them) as lists of ids."""
        if isinstance(prompt, str):
            return [await self.encode(prompt)]
        if not prompt:
            raise BadRequest("prompt is an empty list: give a string or token ids", "prompt")
        if isinstance(prompt[0], str):
            # A batch of texts just under the byte bound is seconds of tokenizing: every
            # text's bytes are checked before any is tokenized, and each one's tokens as
            # soon as it is, so the first too long ends the work.
            for text in prompt:
                self.bytes_fit(text, "prompt")
            return [self.tokens_fit(await self.encode(text)) for text in prompt]
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return [list(ids) for ids in prompt]

    async def encode(self, text: str, param: str = "prompt") -> list[int]:
        """`text`'s tokens, counted on a tokenizing thread; refused at once when it is
        certainly longer than the context (see the module's doc)."""
        self.bytes_fit(text, param)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(TOKENIZING, self.tokenizer.encode, text)

    def bytes_fit(self, text: str, param: str, what: str = "the prompt has") -> None:
        """Refuse a text with more bytes than the context's tokens can cover."""
        size = len(text.encode("utf-8", errors="surrogatepass"))
        if size > self.block_size * self.max_token_bytes:
            raise BadRequest(
                f"{what} {size} bytes, so more than {self.block_size} tokens (no "
                f"token holds more than {self.max_token_bytes} bytes), but the model's "
                f"context window is {self.block_size}: shorten the prompt",
                param=param,
            )

    def conversation_fits(self, messages: list[ChatMessage]) -> None:
        """Refuse, before its template runs, a conversation that cannot fit the context.
        A render costs time in proportion to the messages, on a thread that shares the
        GIL with the event loop: 16,000 short messages (under the body limit) held every
        other client for seconds. Every message a template shows takes at least one
        token, and its content at least its bytes' share (the bound of `bytes_fit`)."""
        if len(messages) > self.block_size:
            raise BadRequest(
                f"the conversation has {len(messages)} messages, more than the model's "
                f"context window of {self.block_size} tokens (each message takes at least "
                f"one): send fewer",
                param="messages",
            )
        contents = "".join(message.content for message in messages)
        self.bytes_fit(contents, "messages", what="the messages' contents have")

    def prompt(self, ids: list[int]) -> list[int]:
        """The ids the engine runs: an empty prompt starts from end-of-text (one token, so
        usage counts it), as the engine and training do."""
        self.token_ids(ids, "prompt")
        return self.tokens_fit(ids) or [self.tokenizer.eot_id]

    def tokens_fit(self, ids: list[int]) -> list[int]:
        """`ids`, refused when the context cannot hold them."""
        if len(ids) > self.block_size:
            raise BadRequest(
                f"the prompt has {len(ids)} tokens but the model's context window is "
                f"{self.block_size}: shorten the prompt",
                param="prompt",
            )
        return ids

    async def constraint(
        self, body: SamplingFields, client: str | None
    ) -> tuple[StructuredOutputs | None, Grammar | None]:
        """The constraint a request asks for (OpenAI's response_format or vLLM's
        structured_outputs, not both), and its grammar, compiled here in the handler (off
        the event loop, within the compile's time bound, within `client`'s share of the
        compiles: compiles.py): an invalid or pathological one is this request's 400 and
        never reaches the engine thread. (None, None) for text.
        """
        fmt, vllm = body.response_format, body.structured_outputs
        param = "structured_outputs" if vllm is not None else "response_format"
        if fmt is not None and fmt.type != "text" and vllm is not None:
            raise BadRequest("give response_format or structured_outputs, not both", param)
        if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
            raise BadRequest(
                'response_format of type "json_schema" needs its json_schema: '
                '{"name": ..., "schema": {...}}',
                param,
            )
        try:
            if vllm is not None:
                fields = vllm.model_dump(exclude_none=True)
                fields["json"] = fields.pop("json_", None)
                spec = StructuredOutputs(**fields)
            elif fmt is None or fmt.type == "text":
                return None, None
            elif fmt.type == "json_object":
                spec = StructuredOutputs(json_object=True)
            else:
                spec = StructuredOutputs(json=fmt.json_schema.schema_)
            grammar = await self.compiles.grammar(spec, client)
        except TooManyCompiles as err:
            raise BadRequest(str(err), param, status=429, code="too_many_compiles") from None
        except CompilerStopped as err:  # the server is stopping
            raise BadRequest(str(err), param, status=503, code="shutting_down") from None
        except RoseError as err:  # (InvalidParam is one)
            raise BadRequest(str(err), param) from None
        return spec, grammar

    def room_left(self, ids: list[int]) -> int:
        """What a chat request without max_tokens may make: the context left after its
        prompt, at least 1 (so that a full context is refused by `fits`, with its numbers);
        16, OpenAI's completions default, for a model whose positions never run out."""
        return 16 if self.length_limit is None else max(1, self.length_limit - len(ids))

    def fits(self, ids: list[int], max_tokens: int, body: SamplingFields) -> None:
        """A completion that cannot fit beside its prompt in the context is refused, as
        vLLM's server refuses it (400), never cut short with finish_reason "length"."""
        limit = self.length_limit
        if limit is None or len(ids) + max_tokens <= limit:
            return
        prompt = "the messages" if hasattr(body, "messages") else "the prompt"
        verb = "take" if hasattr(body, "messages") else "takes"
        if getattr(body, "max_completion_tokens", None) is None and body.max_tokens is None:
            # a chat request that asked for no length: its messages leave no room at all
            raise BadRequest(
                f"this model's context window is {limit} tokens, and {prompt} take "
                f"{len(ids)} of them: shorten them, so that a reply has room",
                param="messages",
                code="context_length_exceeded",
            )
        name = (
            "max_completion_tokens"
            if getattr(body, "max_completion_tokens", None)
            else "max_tokens"
        )
        fix = (
            f"lower {name} to {limit - len(ids)} or less, or shorten {prompt}"
            if len(ids) < limit
            else f"shorten {prompt}: it leaves no room for a token"
        )
        raise BadRequest(
            f"this model's context window is {limit} tokens, but {prompt} {verb} {len(ids)} "
            f"and {name} asks for {max_tokens}: {len(ids)} + {max_tokens} = "
            f"{len(ids) + max_tokens} > {limit}; {fix}",
            param=name,
            code="context_length_exceeded",
        )

    def jobs(
        self,
        body: SamplingFields,
        prompts: list[list[int]],
        logprobs: int | None,
        structured_outputs: StructuredOutputs | None = None,
        client: str | None = None,
    ) -> list[Job]:
        """One job per prompt and choice. Choice j of n > 1 with a seed samples with seed + j
        (wrapping past 2**64 - 1), so the choices differ yet repeat under one seed.
        client: who sends it (None: not bounded per client, see connections.client_of)."""
        count = len(prompts) * body.n
        limit, flag = self.max_waiting, "--max-waiting"
        if client is not None and self.max_waiting_per_client < limit:
            limit, flag = self.max_waiting_per_client, "--max-waiting-per-client"
        if count > limit:
            what = f"{len(prompts)} prompt(s) x n={body.n}"
            raise BadRequest(
                f"{what} = {count} choices, but this server admits at most {limit} "
                f"at once ({flag}): send fewer",
                param="n" if body.n > 1 else "prompt",
            )
        if body.stream_options is not None and not body.stream:
            raise BadRequest(
                "stream_options is only for a streamed answer: add stream: true or drop it",
                param="stream_options",
            )
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        if max_tokens is None and not hasattr(body, "messages"):
            max_tokens = 16  # a completion's max_tokens given as null: OpenAI's default
        if max_tokens is None:  # a chat request that gave neither: the rest of the context
            (ids,) = prompts  # (a chat request is one prompt)
            max_tokens = self.room_left(ids)
        for ids in prompts:
            self.fits(ids, max_tokens, body)
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_k=max(body.top_k, 0),
                top_p=body.top_p,
                seed=body.seed,
                stop=body.stop,
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                structured_outputs=structured_outputs,
                n=body.n,
            )
        except InvalidParam as err:
            raise BadRequest(str(err), err.param) from None
        per_choice = params.choices()
        if self.speculative and not per_choice[0].greedy and not self.told_sampled:
            self.told_sampled = True
            log.warning(
                "speculative decoding: a request with temperature %s gets no drafts: %s "
                "(said for the first sampled request only)",
                body.temperature,
                SAMPLED_NOT_DRAFTED,
            )
        return [(ids, params) for ids in prompts for params in per_choice]
