"""Structured output through the front doors: the official `openai` client against a
real rose server (response_format as OpenAI defines it, vLLM's structured_outputs),
and rose-generate's flags. The served model is random: without the grammar it never
writes JSON, so every valid output below is the mask's doing.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import jsonschema
import pytest
import torch
from servers import API_KEY, MODEL_NAME, Server, running_server, write_test_checkpoint

from roseinfer.cli import generate as cli_generate
from roseinfer.loops.generate import generate
from roseinfer.request.sampling_params import SamplingParams, StructuredOutputs
from roseinfer.serving.chat_template import ChatTemplate
from rosetrainer.model import GPT
from rosetrainer.tokenizer import Tokenizer

if TYPE_CHECKING:
    import openai

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# What OpenAI's strict mode asks of a schema: every property required, no others.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}  # fmt: skip
JSON_OBJECT = {"type": "json_object"}
MESSAGES = [{"role": "user", "content": "Describe a user as JSON."}]
PROMPT = "A user, as JSON:"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT]:
    path = tmp_path_factory.mktemp("structured") / "tiny.pt"
    return path, write_test_checkpoint(path)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer("gpt2")


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Server:
    log = tmp_path_factory.mktemp("structured-log") / "server.log"
    with running_server(checkpoint[0], log, "--api-key", API_KEY, "--kv-block-size", "8") as s:
        yield s


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    import openai

    with openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0) as c:
        yield c


def solo(model: GPT, tokenizer: Tokenizer, prompt: str, params: SamplingParams) -> str:
    """The oracle: the request alone, uncached, under the same mask."""
    with torch.no_grad():
        result = generate(
            model,
            tokenizer.encode(prompt),
            params,
            use_cache=False,
            eot_id=tokenizer.eot_id,
            tokenizer=tokenizer,
        )
    return tokenizer.decode(result.token_ids)


def spec_of(response_format: dict) -> StructuredOutputs:
    if response_format["type"] == "json_object":
        return StructuredOutputs(json_object=True)
    return StructuredOutputs(json=response_format["json_schema"]["schema"])


def check_valid(text: str, response_format: dict) -> None:
    value = json.loads(text)
    if response_format["type"] == "json_schema":
        jsonschema.validate(value, PERSON)
    else:
        assert isinstance(value, dict)


@pytest.mark.slow
@pytest.mark.parametrize("response_format", [JSON_SCHEMA, JSON_OBJECT], ids=["schema", "object"])
def test_response_format_on_chat_and_completions_every_output_valid(
    client: openai.OpenAI, checkpoint, tokenizer: Tokenizer, response_format: dict
) -> None:
    """Greedy (equal to its solo run, streamed and not) and three seeded sampled choices,
    on both endpoints: each output valid, ended because its JSON was complete."""
    model = checkpoint[1]
    chat_prompt = ChatTemplate().render(MESSAGES)
    want = {
        "chat": solo(
            model,
            tokenizer,
            chat_prompt,
            SamplingParams(max_tokens=48, structured_outputs=spec_of(response_format)),
        ),  # fmt: skip
        "completions": solo(
            model,
            tokenizer,
            PROMPT,
            SamplingParams(max_tokens=48, structured_outputs=spec_of(response_format)),
        ),  # fmt: skip
    }

    def chat(**fields: object):
        return client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=48, response_format=response_format,
            **fields,
        )  # fmt: skip

    def completions(**fields: object):
        # The client's completions take response_format as an extra field of the body.
        return client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=48,
            extra_body={"response_format": response_format}, **fields,
        )  # fmt: skip

    greedy = chat(temperature=0).choices[0]
    assert greedy.message.content == want["chat"] and greedy.finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(temperature=0, stream=True))
    assert streamed == want["chat"]
    greedy = completions(temperature=0).choices[0]
    assert greedy.text == want["completions"] and greedy.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in completions(temperature=0, stream=True))
    assert streamed == want["completions"]

    sampled = chat(temperature=1.0, seed=7, n=3).choices
    sampled += completions(temperature=1.0, seed=7, n=3).choices
    for choice in sampled:
        assert choice.finish_reason == "stop"
        text = choice.message.content if hasattr(choice, "message") else choice.text
        check_valid(text, response_format)
    for text in want.values():
        check_valid(text, response_format)


@pytest.mark.slow
def test_vllms_structured_outputs_field(client: openai.OpenAI) -> None:
    regex = r"[A-Z]{3}-[0-9]{2,4}"
    choices = ["red", "green", "blue"]
    for fields, check in [
        ({"regex": regex}, lambda text: re.fullmatch(regex, text)),
        ({"choice": choices}, lambda text: text in choices),
        ({"json": PERSON}, lambda text: jsonschema.validate(json.loads(text), PERSON) or True),
        (
            {"grammar": 'start: "<" /[a-z]{1,4}/ ">"'},
            lambda text: re.fullmatch("<[a-z]{1,4}>", text),
        ),  # fmt: skip
    ]:
        reply = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=48, temperature=1.0, seed=1, n=2,
            extra_body={"structured_outputs": fields},
        )  # fmt: skip
        for choice in reply.choices:
            assert check(choice.text), (fields, choice.text)


@pytest.mark.slow
def test_an_invalid_constraint_is_a_400_with_the_librarys_reason_while_others_finish(
    server: Server, checkpoint, tokenizer: Tokenizer
) -> None:
    """Bad constraints sent among good requests, all at once: each bad one is a 400 in
    OpenAI's shape naming the library's reason and the field; every good one (free or
    constrained) finishes with its solo tokens."""
    import openai

    model = checkpoint[1]
    good = [
        ({}, SamplingParams(max_tokens=16)),
        (
            {"response_format": JSON_SCHEMA},
            SamplingParams(max_tokens=40, structured_outputs=spec_of(JSON_SCHEMA)),
        ),  # fmt: skip
        (
            {"structured_outputs": {"regex": "[0-9]{4}"}},
            SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(regex="[0-9]{4}")),
        ),  # fmt: skip
    ]
    bad = [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frobnicate"}},
                }
            },
            "response_format",
            "frobnicate",
        ),  # fmt: skip
        (
            {"structured_outputs": {"regex": "[0-9"}},
            "structured_outputs",
            "unclosed character class",
        ),  # fmt: skip
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty strings"),
        (
            {"response_format": JSON_OBJECT, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "not both",
        ),  # fmt: skip
        (
            {"response_format": {"type": "json_schema"}},
            "response_format",
            "needs its json_schema",
        ),  # fmt: skip
    ]

    async def one(client: openai.AsyncOpenAI, extra: dict, max_tokens: int):
        try:
            reply = await client.completions.create(
                model=MODEL_NAME, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                extra_body=extra,
            )  # fmt: skip
        except openai.BadRequestError as err:
            return err
        return reply.choices[0].text

    async def all_at_once() -> list:
        async with openai.AsyncOpenAI(
            base_url=server.base_url, api_key=API_KEY, max_retries=0
        ) as client:
            calls = [one(client, extra, params.max_tokens) for extra, params in good]
            calls += [one(client, extra, 16) for extra, _, _ in bad]
            calls += [one(client, extra, params.max_tokens) for extra, params in good]
            return await asyncio.gather(*calls)

    results = asyncio.run(all_at_once())
    answers = results[: len(good)] + results[len(good) + len(bad) :]
    for (_, params), text in zip(good + good, answers, strict=True):
        assert text == solo(model, tokenizer, PROMPT, params)
    for (_, param, reason), err in zip(bad, results[len(good) : len(good) + len(bad)], strict=True):
        assert isinstance(err, openai.BadRequestError) and err.status_code == 400, err
        error = err.response.json()["error"]
        assert error["param"] == param and reason in error["message"], error
        assert error["type"] == "invalid_request_error"
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200  # the engine thread never saw them


# ---------------------------------------------------------------------------
# rose-generate
# ---------------------------------------------------------------------------


def main(capsys: pytest.CaptureFixture, *args: str | Path) -> tuple[int, str, str]:
    code = cli_generate.main([str(arg) for arg in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_the_cli_holds_each_output_to_its_constraint(
    capsys: pytest.CaptureFixture, checkpoint, tmp_path: Path
) -> None:
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    grammar = tmp_path / "pair.lark"
    grammar.write_text('start: "(" /[a-z]{1,3}/ "," /[0-9]{1,2}/ ")"')
    common = ["--checkpoint-path", checkpoint[0], "--prompt", PROMPT, "--prompt", "Hi",
              "--max-new-tokens", "48", "--seed", "0", "--json"]  # fmt: skip
    for flags, check in [
        (
            ["--json-schema", schema],
            lambda text: jsonschema.validate(json.loads(text), PERSON) or True,
        ),  # fmt: skip
        (["--json-object"], lambda text: isinstance(json.loads(text), dict)),
        (["--regex", "[a-c]{2}[0-9]"], lambda text: re.fullmatch("[a-c]{2}[0-9]", text)),
        (["--choice", "yes", "--choice", "no"], lambda text: text in ("yes", "no")),
        (["--grammar", grammar], lambda text: re.fullmatch(r"\([a-z]{1,3},[0-9]{1,2}\)", text)),
    ]:
        for path in ([], ["--no-kv-cache"]):  # the engine (two prompts), the oracle
            code, out, err = main(capsys, *common, *flags, *path)
            assert code == 0, err
            for line in out.splitlines():
                result = json.loads(line)
                assert result["finish_reason"] == "stop" and check(result["text"]), result


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["{checkpoint}", "--regex", "[0-9"], "unclosed character class"),
        (["{checkpoint}", "--json-schema", "{missing}"], "cannot read"),
        (["{checkpoint}", "--choice", "a", "--regex", "b"], "not allowed with"),
        (["--onnx", "nowhere", "--json-object"], "drop --onnx"),
    ],
)
def test_a_bad_constraint_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture, checkpoint, tmp_path: Path, flags: list[str], says: str
) -> None:
    where = {"{checkpoint}": f"--checkpoint-path={checkpoint[0]}", "{missing}": tmp_path / "x"}
    code, out, err = main(capsys, *(where.get(flag, flag) for flag in flags))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert says in err, err
