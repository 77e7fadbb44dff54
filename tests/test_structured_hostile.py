"""Structured output against a hostile client (issue 43, items 8-12): constraints that
crashed the server, stalled every other request, reported invalid output as complete,
or answered a 500 with a traceback. One real server for the module (a subprocess on a
free port, always stopped), talked to with raw httpx as a client would; the engine
in-process where a test must set its bounds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from serving import API_KEY, MODEL_NAME, Server, running_server, write_test_checkpoint

from rosetrainer.model import GPT

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEY = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT]:
    path = tmp_path_factory.mktemp("hostile") / "tiny.pt"
    return path, write_test_checkpoint(path)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Server:
    log = tmp_path_factory.mktemp("hostile-log") / "server.log"
    with running_server(checkpoint[0], log, "--api-key", API_KEY, "--kv-block-size", "8") as s:
        yield s


@pytest.fixture
def http(server: Server) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, headers=KEY, timeout=120) as client:
        yield client


def strict_json(text: str) -> object:
    """JSON as the standard defines it: no NaN, Infinity or -Infinity (Python's json
    module reads them, a browser's JSON.parse and most other clients do not)."""

    def refuse(constant: str) -> object:
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def events(response: httpx.Response) -> list[dict]:
    """A server-sent event stream's data payloads, each parsed strictly."""
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [strict_json(line.removeprefix("data: ")) for line in lines[:-1]]


# ---------------------------------------------------------------------------
# Item 11: logprobs when the grammar allows fewer tokens than asked for
# ---------------------------------------------------------------------------

CHOICE = {"choice": ["ab", "cd"]}  # "a", "ab", "c", "cd": four tokens at the first step


def test_logprobs_under_a_grammar_are_json_and_forbidden_tokens_are_minus_9999(
    http: httpx.Client,
) -> None:
    """logprobs 5 where a step allows fewer tokens: vLLM's answer, every value finite,
    five alternatives a step, the tokens the grammar forbids at -9999.0."""
    body = {"model": MODEL_NAME, "prompt": "Pick:", "max_tokens": 4, "temperature": 0,
            "logprobs": 5, "structured_outputs": CHOICE}  # fmt: skip
    reply = http.post("/completions", json=body)
    assert reply.status_code == 200, reply.text
    choice = strict_json(reply.text)["choices"][0]
    assert choice["text"] in CHOICE["choice"] and choice["finish_reason"] == "stop"
    logprobs = choice["logprobs"]
    assert all(lp > -9999.0 for lp in logprobs["token_logprobs"])
    top = logprobs["top_logprobs"]
    assert all(len(step) == 5 for step in top)
    values = [lp for step in top for lp in step.values()]
    assert min(values) == -9999.0 and max(values) <= 0
    assert all(
        max(step, key=step.get) == t for step, t in zip(top, logprobs["tokens"], strict=True)
    )

    streamed = http.post("/completions", json={**body, "stream": True})
    assert streamed.status_code == 200
    chunks = events(streamed)  # (the old stream sent -Infinity here)
    texts = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert texts == choice["text"]
    sent = [t for c in chunks if c["choices"] for t in c["choices"][0]["logprobs"]["top_logprobs"]]
    assert sent == top

    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Pick one."}],
            "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 5,
            "structured_outputs": CHOICE}  # fmt: skip
    for stream in (False, True):
        reply = http.post("/chat/completions", json={**chat, "stream": stream})
        assert reply.status_code == 200, reply.text
        if stream:
            content = [
                entry
                for c in events(reply)
                if c["choices"] and c["choices"][0].get("logprobs")
                for entry in c["choices"][0]["logprobs"]["content"]
            ]
        else:
            content = strict_json(reply.text)["choices"][0]["logprobs"]["content"]
        assert content and all(len(entry["top_logprobs"]) == 5 for entry in content)
        values = [t["logprob"] for entry in content for t in entry["top_logprobs"]]
        assert -9999.0 in values and min(values) == -9999.0


# ---------------------------------------------------------------------------
# Item 12: what raised past the checks (a 500 with a traceback) is a 400
# ---------------------------------------------------------------------------


def post_raw(http: httpx.Client, body: dict) -> httpx.Response:
    """POST a completion with the body as JSON text escaped to ASCII, so that a lone
    surrogate travels as JSON writes it ("\\ud800") and the server reads it back."""
    raw = json.dumps({"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4, **body})
    return http.post("/completions", content=raw, headers={"content-type": "application/json"})


def assert_400(reply: httpx.Response, *says: str) -> None:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "structured_outputs"
    assert all(s in error["message"] for s in says), error["message"]
    assert "Traceback" not in reply.text


@pytest.mark.parametrize("depth", [5_000, 100_000])
def test_schema_text_nested_too_deep_is_a_400(http: httpx.Client, depth: int) -> None:
    schema = '{"a":' * depth + "1" + "}" * depth  # (100,000 deep: 600 KB)
    assert_400(post_raw(http, {"structured_outputs": {"json": schema}}), "nested too deeply")


def test_schema_with_a_5000_digit_integer_is_a_400(http: httpx.Client) -> None:
    schema = '{"type": "integer", "maximum": ' + "9" * 5_000 + "}"
    reply = post_raw(http, {"structured_outputs": {"json": schema}})
    assert_400(reply, "integer longer than")


@pytest.mark.parametrize("kind", ["regex", "grammar", "choice"])
def test_a_lone_surrogate_in_a_constraint_is_a_400(http: httpx.Client, kind: str) -> None:
    text = {"regex": "a\ud800", "grammar": 'start: "a\ud800"', "choice": ["a", "\ud800"]}[kind]
    assert_400(post_raw(http, {"structured_outputs": {kind: text}}), "'\\ud800'", "not a character")


def test_a_choice_of_10000_strings_is_followed(http: httpx.Client) -> None:
    """Past 2,000 alternatives the library's parser gives up on a rule (a 500 at the first
    token); the choice is one terminal of the lexer instead."""
    choices = [f"option {i}" for i in range(10_000)]
    reply = post_raw(http, {"max_tokens": 8, "temperature": 0,
                            "structured_outputs": {"choice": choices}})  # fmt: skip
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["text"] in choices and choice["finish_reason"] == "stop"


# ---------------------------------------------------------------------------
# Item 10: a grammar that accepts no text is refused, never "stop" with invalid text
# ---------------------------------------------------------------------------

SELF = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
A_B_A = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
ALL_OF_SELF = {"$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}
UNDER = {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "$defs": SELF["$defs"]}


@pytest.mark.parametrize(
    ("constraint", "says"),
    [
        ({"json": SELF}, "refers to itself"),
        ({"json": A_B_A}, "refers to itself"),
        ({"json": ALL_OF_SELF}, "refers to itself"),
        ({"json": {**UNDER, "required": ["x"]}}, "refers to itself"),
        ({"json": UNDER}, "property 'x'"),  # ({} is valid, but {"x": leads nowhere)
        (
            {"json": {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}},
            "refers to itself",
        ),  # fmt: skip
        ({"regex": r"[^\s\S]"}, "accepts no text"),
        ({"grammar": "start: start"}, "accepts no text"),
        ({"grammar": 'start: "{" a "}"\na: a'}, "accepts no text"),  # (after the forced "{")
    ],
    ids=[
        "self",
        "a-b-a",
        "allOf-self",
        "required-property",
        "optional-property",
        "root-required",
        "empty-regex",
        "lark-self",
        "lark-after-forced",
    ],  # fmt: skip
)
def test_a_grammar_that_accepts_no_text_is_a_400(
    http: httpx.Client, constraint: dict, says: str
) -> None:
    reply = post_raw(http, {"temperature": 0, "structured_outputs": constraint})
    assert_400(reply, says)


def test_a_dead_end_past_the_first_choice_fails_the_request_not_stop(http: httpx.Client) -> None:
    """Both ways on lead into a rule that derives nothing, after a choice the compile-time
    check cannot make for the model: the request fails with the reason (a 500 in
    OpenAI's shape, an error event on a stream), never 200 with finish_reason "stop"."""
    grammar = 'start: "a" d | "b" d\nd: d'
    reply = post_raw(http, {"temperature": 0, "structured_outputs": {"grammar": grammar}})
    assert reply.status_code == 500, reply.text
    assert "accepts no text" in reply.json()["error"]["message"]
    streamed = post_raw(http, {"stream": True, "structured_outputs": {"grammar": grammar}})
    errors = [e for e in events(streamed) if "error" in e]
    assert errors and "accepts no text" in errors[0]["error"]["message"]


# ---------------------------------------------------------------------------
# Item 8: a constraint that crashes the grammar library crashes only its worker
# ---------------------------------------------------------------------------


def object_ref_chain(length: int) -> dict:
    """$defs chaining `length` objects, each with a property that is a $ref to the next
    (1,500 of them: 113 KB, the hostile pass's schema)."""
    defs = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(length)
    }
    defs[f"d{length}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def rule_chain(length: int) -> str:
    """A Lark grammar of `length` rules, each deriving the next."""
    rules = [f"rule{i}: rule{i + 1}" for i in range(length)]
    return "\n".join(["start: rule0", *rules, f'rule{length}: "x"'])


@pytest.mark.parametrize(
    "constraint",
    [{"json": object_ref_chain(1_500)}, {"grammar": rule_chain(4_000)}],
    ids=["ref-chain", "rule-chain"],
)
def test_a_constraint_that_crashes_the_library_is_a_400_and_the_server_lives(
    http: httpx.Client, server: Server, constraint: dict
) -> None:
    """Each overflowed the library's compiler's stack: a segmentation fault that ended
    the server. Now it ends a worker process, and the request is refused; the server,
    and the next constraint's compile, go on."""
    reply = post_raw(http, {"structured_outputs": constraint})
    assert_400(reply, "crashed the grammar compiler", "SIGSEGV")
    again = post_raw(http, {"structured_outputs": constraint})  # remembered: no new worker
    assert again.json() == reply.json()
    assert server.process.poll() is None
    assert httpx.get(server.url + "/health").status_code == 200
    fine = post_raw(http, {"temperature": 0, "structured_outputs": {"regex": "[0-9]{2}"}})
    assert fine.status_code == 200 and len(fine.json()["choices"][0]["text"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--json-schema", "--grammar"])
def test_rose_generate_with_a_constraint_that_crashed_the_library_is_one_line(
    checkpoint: tuple[Path, GPT], tmp_path: Path, flag: str
) -> None:
    """The same files to rose-generate: exit 139 (a segmentation fault) before, one line
    and exit 2 now. A subprocess: the crash, if it came back, must not take the test
    run with it."""
    constraint = tmp_path / "chain"
    chain = json.dumps(object_ref_chain(1_500)) if flag == "--json-schema" else rule_chain(4_000)
    constraint.write_text(chain)
    command = [sys.executable, "-m", "roseinfer.cli.generate", "--checkpoint-path",
               str(checkpoint[0]), "--prompt", "Hi", flag, str(constraint)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "crashed the grammar compiler" in done.stderr, done.stderr
