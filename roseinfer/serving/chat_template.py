"""Chat messages -> one prompt string, through a Jinja2 template.

GPT-2 was never taught a chat format, so the default is the plainest one a reader can
predict: each message on its own paragraph, prefixed by its role, and "Assistant:" at
the end for the model to continue. A model trained on another format brings its own
template file (`--chat-template FILE`): it sees `messages` (each with `role` and
`content`) and `add_generation_prompt`, as Hugging Face's chat templates do.
"""

from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rosetrainer.errors import RoseError

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message.role | capitalize }}: {{ message.content }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


class ChatTemplate:
    def __init__(self, source: str = DEFAULT_CHAT_TEMPLATE) -> None:
        # Sandboxed: a template is data; it may not reach Python objects' internals.
        env = ImmutableSandboxedEnvironment(keep_trailing_newline=True)
        try:
            self.template = env.from_string(source)
        except TemplateError as err:
            raise RoseError(f"the chat template does not parse: {err}") from None

    @classmethod
    def from_file(cls, path: str | None) -> ChatTemplate:
        if path is None:
            return cls()
        try:
            return cls(Path(path).read_text(encoding="utf-8"))
        except OSError as err:
            raise RoseError(f"cannot read the chat template {path}: {err.strerror}") from None

    def render(self, messages: list[dict[str, str]]) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=True)
        except TemplateError as err:
            raise RoseError(f"the chat template failed on these messages: {err}") from None
