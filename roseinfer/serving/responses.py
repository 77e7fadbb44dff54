"""Engine outputs -> OpenAI's response and stream-chunk dicts (completions and chat)."""

from __future__ import annotations

import time

from roseinfer.engine.outputs import RequestOutput, TokenLogprob
from rosetrainer.tokenizer import Tokenizer

# A token the grammar forbids has log-probability -inf, which JSON cannot carry: it is
# sent as this, the finite stand-in OpenAI uses and vLLM sends too (its serving layer
# clamps every logprob at -9999.0).
MIN_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    """A log-probability as JSON can carry it (-inf: MIN_LOGPROB)."""
    return max(logprob, MIN_LOGPROB)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """A token's own text; a token holding part of a UTF-8 character shows U+FFFD."""
    return tokenizer.token_bytes(token_id).decode("utf-8", "replace")


def completion_logprobs(
    tokenizer: Tokenizer, logprobs: list[TokenLogprob], text_offset: int
) -> dict[str, list]:
    """The legacy completions shape: parallel lists, one entry per token."""
    tokens, offsets = [], []
    for entry in logprobs:
        tokens.append(token_text(tokenizer, entry.token_id))
        offsets.append(text_offset)
        text_offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [finite(entry.logprob) for entry in logprobs],
        "top_logprobs": [
            {token_text(tokenizer, t): finite(lp) for t, lp in entry.top} for entry in logprobs
        ],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob]) -> dict[str, list]:
    """The chat shape: one object per token, with its bytes and its top alternatives."""

    def one(token_id: int, logprob: float) -> dict:
        raw = tokenizer.token_bytes(token_id)
        text = raw.decode("utf-8", "replace")
        return {"token": text, "logprob": finite(logprob), "bytes": list(raw)}

    return {
        "content": [
            {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in logprobs
        ]
    }


class ResponseBuilder:
    """Shapes one request's outputs; `chat` picks the chat shapes over the completion ones."""

    def __init__(
        self, request_id: str, model: str, tokenizer: Tokenizer, *, chat: bool, echo: list[str]
    ) -> None:
        self.request_id, self.model, self.tokenizer, self.chat = request_id, model, tokenizer, chat
        self.echo = echo  # per choice: the prompt text to put in front ("" without echo)
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _logprobs(self, entries: list[TokenLogprob] | None, text_offset: int) -> dict | None:
        if entries is None:
            return None
        if self.chat:
            return chat_logprobs(self.tokenizer, entries)
        return completion_logprobs(self.tokenizer, entries, text_offset)

    def response(self, finals: list[RequestOutput], prompt_tokens: int) -> dict:
        choices = []
        for index, out in enumerate(finals):
            text = self.echo[index] + out.text
            choice: dict = {"index": index, "finish_reason": out.finish_reason}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice["logprobs"] = self._logprobs(out.logprobs, len(self.echo[index]))
            choices.append(choice)
        completion_tokens = sum(len(out.token_ids) for out in finals)
        return {
            "id": self.request_id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
        }

    def chunk(self, choices: list[dict], usage_: dict | None = None) -> dict:
        return {
            "id": self.request_id,
            "object": self.object + ".chunk" if self.chat else self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage_,
        }

    def role_choice(self, index: int) -> dict:
        """Chat streams open each choice with the speaker's role."""
        return {
            "index": index,
            "delta": {"role": "assistant", "content": self.echo[index]},
            "logprobs": None,
            "finish_reason": None,
        }

    def delta_choice(
        self,
        index: int,
        text: str,
        logprobs: list[TokenLogprob] | None,
        text_offset: int,
        finish_reason: str | None,
    ) -> dict:
        choice: dict = {"index": index}
        if self.chat:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(logprobs, text_offset)
        choice["finish_reason"] = finish_reason
        return choice
