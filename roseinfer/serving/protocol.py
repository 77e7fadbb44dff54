"""What a request may hold, as pydantic models.

The models are strict: an unknown field or a value of the wrong type (a string where a
number belongs, a bool where an integer belongs) is a 400, never silently coerced or
ignored. Ranges are checked here too, so the error names the field (`param`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from roseinfer.request.sampling_params import MAX_LOGPROBS, MAX_SEED


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class JsonSchemaFormat(Strict):
    """OpenAI's response_format.json_schema."""

    name: str
    # (`schema` is a BaseModel attribute: the field takes the name through its alias)
    schema_: dict = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None  # the output is held to the schema either way


class ResponseFormat(Strict):
    """OpenAI's response_format: plain text, any JSON object, or JSON for a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(Strict):
    """vLLM's `structured_outputs` body field: one of json (a schema), json_object,
    regex, choice, grammar (a Lark grammar)."""

    json_: dict | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingFields(Strict):
    """The fields both endpoints share; the names and defaults are OpenAI's."""

    model: str | None = None  # None: the one model this server serves
    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0  # 0 or -1: off (vLLM's spelling is -1)
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=16)] = 1
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    user: str | None = None  # accepted and ignored, as the API allows
    # Not applied by rose; accepted at their neutral values, which OpenAI's client
    # wrappers send on every call (a penalty of 0, no bias), refused otherwise.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def no_penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError(f"rose applies no penalty: only 0 (no penalty) is taken, got {value}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def no_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("rose applies no logit_bias: only {} or null is taken")
        return value


class CompletionRequest(SamplingFields):
    # OpenAI's default for completions; null means it too
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    # A string, a batch of strings, one list of token ids, or a batch of them.
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = (
        None  # top-k alternatives per token
    )
    echo: bool = False  # put the prompt's text in front of the completion


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def as_text(cls, content: object) -> object:
        """OpenAI's list form of a content (its SDKs' typed messages send it), text parts
        only, as one string: the parts' texts joined by newlines, as vLLM joins them."""
        if not isinstance(content, list):
            return content
        for part in content:
            if not (
                isinstance(part, dict)
                and part.keys() == {"type", "text"}
                and part["type"] == "text"
                and isinstance(part["text"], str)
            ):
                raise ValueError(
                    "a content part is {'type': 'text', 'text': ...} (this model reads text "
                    f"only), got {str(part)[:80]}"
                )
        return "\n".join(part["text"] for part in content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    # Neither given: the rest of the context, as vLLM's chat endpoint does (a chat reply
    # runs until it ends, not 16 tokens in).
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # the newer name
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
