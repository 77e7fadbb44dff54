"""Chat messages -> one prompt string, through a Jinja2 template.

GPT-2 was never taught a chat format, so the default is the plainest one a reader can
predict: each message on its own paragraph, prefixed by its role, and "Assistant:" at
the end for the model to continue. A model trained on another format brings its own
template file (`--chat-template FILE`): it sees `messages` (each with `role` and
`content`) and `add_generation_prompt`, as Hugging Face's chat templates do.

A template is the operator's code running on every chat request, so it is held to
three rules: it runs sandboxed (no reaching into Python objects, bounded ranges and
repetitions), it is rendered once on a sample conversation at startup (a template that
cannot render fails the server's start, in one line, not each request), and a render
runs off the event loop under a time limit (a template that loops fails its request,
never stalls the others).
"""

from __future__ import annotations

import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from rosetrainer.errors import RoseError

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message.role | capitalize }}: {{ message.content }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
SAMPLE_CONVERSATION = [{"role": "user", "content": "Hello!"}]
RENDER_TIMEOUT_S = 2.0
MAX_REPEAT = 100_000  # items a `*` may make (a string or list times a number)
# Renders run here, on threads of their own: never behind other work waiting on a thread
# (a constraint's compile waits seconds: roseinfer/serving/compiles.py).
RENDERING = ThreadPoolExecutor(2, thread_name_prefix="rose-template")


class ChatTemplateFailed(Exception):
    """The template itself broke on a request (its bug, not the client's): a 500."""


class TemplateTookTooLong(Exception):
    pass


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, also refusing a `*` or `**` that would make a huge value."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator: str, left, right):  # noqa: ANN001, ANN201 (jinja's)
        if operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise SecurityError(f"an exponent of {right} is too large")
        if operator == "*":
            sized = left if hasattr(left, "__len__") else right
            count = right if sized is left else left
            if hasattr(sized, "__len__") and isinstance(count, int):
                if len(sized) * count > MAX_REPEAT:
                    raise SecurityError(f"a repetition makes more than {MAX_REPEAT} items")
        return super().call_binop(context, operator, left, right)


class ChatTemplate:
    def __init__(self, source: str = DEFAULT_CHAT_TEMPLATE) -> None:
        # Sandboxed: a template is data; it may not reach Python objects' internals.
        env = BoundedSandbox(keep_trailing_newline=True)
        try:
            self.template = env.from_string(source)
        except TemplateError as err:
            raise RoseError(f"the chat template does not parse: {err}") from None
        try:
            self.render(SAMPLE_CONVERSATION)
        except (RoseError, ChatTemplateFailed) as err:
            raise RoseError(f"the chat template cannot render a one-message chat: {err}") from None

    @classmethod
    def from_file(cls, path: str | None) -> ChatTemplate:
        if path is None:
            return cls()
        try:
            return cls(Path(path).read_text(encoding="utf-8"))
        except OSError as err:
            raise RoseError(f"cannot read the chat template {path}: {err.strerror}") from None
        except UnicodeDecodeError:
            raise RoseError(f"the chat template {path} is not UTF-8 text") from None

    def render(self, messages: list[dict[str, str]], timeout: float = RENDER_TIMEOUT_S) -> str:
        """The prompt; RoseError when the template refuses these messages (the client's
        400), ChatTemplateFailed when the template breaks or runs past `timeout`."""
        deadline = time.monotonic() + timeout

        def check_time(frame, event, arg):  # noqa: ANN001, ANN202 (sys.settrace's protocol)
            if time.monotonic() > deadline:
                raise TemplateTookTooLong
            return check_time

        previous = sys.gettrace()
        sys.settrace(check_time)  # this thread only: every line the template runs
        try:
            return self.template.render(messages=messages, add_generation_prompt=True)
        except TemplateTookTooLong:
            raise ChatTemplateFailed(f"the chat template ran longer than {timeout} s") from None
        except TemplateError as err:
            raise RoseError(f"the chat template failed on these messages: {err}") from None
        except Exception as err:  # the template's own bug: {% include %}, endless recursion
            raise ChatTemplateFailed(
                f"the chat template broke: {type(err).__name__}: {err}"
            ) from None
        finally:
            sys.settrace(previous)

    async def render_off_loop(self, messages: list[dict[str, str]]) -> str:
        """`render` on a worker thread, so a slow template stalls no other client."""
        return await asyncio.get_running_loop().run_in_executor(RENDERING, self.render, messages)
