"""The OpenAI-compatible server end to end: a real uvicorn server in a subprocess, the
official `openai` client, and the uncached oracle as the answer every output must equal."""

from __future__ import annotations

import asyncio
import functools
import json
import math
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
import torch
from models import assert_clear_margins, assert_varied
from servers import (
    API_KEY,
    MODEL_NAME,
    WINDOW,
    Server,
    leave_a_non_streamed_request,
    metrics,
    running_server,
    solo_text,
    wait_idle,
    write_test_checkpoint,
)

from benchmarks import serving as bench_serving
from roseinfer.engine.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.request.sampling_params import SamplingParams
from roseinfer.serving.app import ServerSettings, build_app
from roseinfer.serving.background import BackgroundServer
from roseinfer.serving.chat_template import ChatTemplate
from rosetrainer.model import GPT
from rosetrainer.threads import Threads
from rosetrainer.tokenizer import Tokenizer

if TYPE_CHECKING:  # openai and the server (FastAPI) are imported where used: slow imports
    import openai

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_WAITING = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT]:
    path = tmp_path_factory.mktemp("serve") / "tiny.pt"
    return path, write_test_checkpoint(path)


@pytest.fixture(scope="module")
def model(checkpoint: tuple[Path, GPT]) -> GPT:
    return checkpoint[1]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer("gpt2")


@pytest.fixture(scope="module")
def server(checkpoint: tuple[Path, GPT], tmp_path_factory: pytest.TempPathFactory) -> Server:
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    flags = ["--api-key", API_KEY, "--max-waiting", str(MAX_WAITING), "--kv-block-size", "8"]
    with running_server(checkpoint[0], log, *flags) as running:
        yield running


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    import openai

    with openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0) as c:
        yield c


def greedy(max_tokens: int = 12, **fields: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **fields)


PROMPT = "ROMEO:\nWhat light is that"


@pytest.mark.slow
def test_greedy_completion_stream_and_not_equal_the_oracle(
    client: openai.OpenAI, model: GPT, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode(PROMPT)
    want_text, want_ids, want_reason = solo_text(model, tokenizer, ids, greedy(20))
    with torch.no_grad():  # a strong oracle: varied tokens, no near-ties
        logits = model(torch.tensor([ids + want_ids])).logits[0, len(ids) - 1 : -1]
    assert_clear_margins(list(logits))
    assert_varied(want_ids)

    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0)
    assert whole.choices[0].text == want_text
    assert whole.choices[0].finish_reason == want_reason == "length"
    assert whole.usage.prompt_tokens == len(ids)
    assert whole.usage.completion_tokens == 20

    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=ids, max_tokens=20, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices


@pytest.mark.slow
def test_sixteen_concurrent_streams_with_ragged_prompts_each_equal_their_solo_run(
    server: Server, model: GPT, tokenizer: Tokenizer
) -> None:
    import openai

    rng = random.Random(0)
    prompts = [[rng.randrange(50257) for _ in range(rng.randint(1, 60))] for _ in range(16)]
    lengths = [rng.randint(4, 24) for _ in prompts]

    async def one(client: openai.AsyncOpenAI, ids: list[int], max_tokens: int) -> str:
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=ids, max_tokens=max_tokens, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=server.base_url, api_key=API_KEY, max_retries=0
        ) as client:
            return await asyncio.gather(*map(functools.partial(one, client), prompts, lengths))

    texts = asyncio.run(all_of_them())
    for ids, max_tokens, text in zip(prompts, lengths, texts, strict=True):
        assert text == solo_text(model, tokenizer, ids, greedy(max_tokens))[0]


@pytest.mark.slow
def test_seeded_sampling_is_the_same_streamed_or_not_and_equals_its_solo_run(
    client: openai.OpenAI, model: GPT, tokenizer: Tokenizer
) -> None:
    fields = dict(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    extra = {"top_k": 200}
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, extra_body=extra, **fields)
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, stream=True, extra_body=extra, **fields
    )
    streamed = "".join(chunk.choices[0].text for chunk in stream)
    assert streamed == whole.choices[0].text
    params = SamplingParams(**fields, top_k=200)
    assert whole.choices[0].text == solo_text(model, tokenizer, tokenizer.encode(PROMPT), params)[0]
    other = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, extra_body=extra, **{**fields, "seed": 99}
    )
    assert other.choices[0].text != whole.choices[0].text


@pytest.mark.slow
def test_n_choices_echo_and_stop(client: openai.OpenAI, model: GPT, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(PROMPT)
    fields = dict(max_tokens=10, temperature=1.0, seed=5)
    both = client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=2, **fields)
    texts = [c.text for c in sorted(both.choices, key=lambda c: c.index)]
    for j, text in enumerate(texts):  # choice j samples with seed + j
        assert (
            text == solo_text(model, tokenizer, ids, SamplingParams(**{**fields, "seed": 5 + j}))[0]
        )
    assert both.usage.prompt_tokens == len(ids) and both.usage.completion_tokens == 20

    echoed = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, echo=True, max_tokens=6, temperature=0
    )
    assert echoed.choices[0].text == PROMPT + solo_text(model, tokenizer, ids, greedy(6))[0]

    full = solo_text(model, tokenizer, ids, greedy(20))[0]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    stopped = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == full[: full.index(stop)]


@pytest.mark.slow
def test_logprobs_are_the_models_log_softmax(
    client: openai.OpenAI, model: GPT, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode(PROMPT)
    response = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0, logprobs=3
    )
    logprobs = response.choices[0].logprobs
    _, want_ids, _ = solo_text(model, tokenizer, ids, greedy(4))
    with torch.no_grad():
        all_logits = model(torch.tensor([ids + want_ids])).logits[0, len(ids) - 1 : -1]
    expected = torch.log_softmax(all_logits.float(), dim=-1)
    for step, token in enumerate(want_ids):
        assert logprobs.token_logprobs[step] == pytest.approx(
            float(expected[step, token]), abs=1e-4
        )
        assert len(logprobs.top_logprobs[step]) == 3
        # greedy: the chosen token is the most likely one
        assert max(logprobs.top_logprobs[step].values()) == pytest.approx(
            logprobs.token_logprobs[step], abs=1e-6
        )
    assert "".join(logprobs.tokens) == response.choices[0].text


@pytest.mark.slow
def test_chat_uses_the_documented_template(
    client: openai.OpenAI, model: GPT, tokenizer: Tokenizer
) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Who is Romeo?"},
    ]
    prompt = ChatTemplate().render(messages)
    assert prompt == "System: You are terse.\n\nUser: Who is Romeo?\n\nAssistant:"
    want = solo_text(model, tokenizer, tokenizer.encode(prompt), greedy(8))[0]
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content == want
    assert reply.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want


@pytest.mark.slow
def test_a_content_given_as_text_parts_is_their_text(
    client: openai.OpenAI, model: GPT, tokenizer: Tokenizer
) -> None:
    """OpenAI's list form of a message's content (its SDKs' typed messages send it) is the
    parts' texts joined by newlines, as vLLM reads it (it was a 400); an image part is a
    400 saying so."""
    import openai

    parts = [{"type": "text", "text": "Who is"}, {"type": "text", "text": "Romeo?"}]
    prompt = ChatTemplate().render([{"role": "user", "content": "Who is\nRomeo?"}])
    want = solo_text(model, tokenizer, tokenizer.encode(prompt), greedy(8))[0]
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": parts}], max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content == want
    image = {"type": "image_url", "image_url": {"url": "http://127.0.0.1/a.png"}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": [image]}], max_tokens=2
        )
    assert refused.value.body["param"] == "messages.0.content"
    assert "(this model reads text only), got {'type': 'image_url'" in refused.value.message


@pytest.mark.slow
def test_without_max_tokens_chat_runs_to_the_context_and_completions_make_16(
    client: openai.OpenAI,
) -> None:
    """OpenAI's default of 16 tokens is the completions endpoint's; a chat request that
    gives neither max_tokens nor max_completion_tokens may use the rest of the context,
    as vLLM's chat endpoint allows (it used to stop at 16 here)."""
    messages = [{"role": "user", "content": "Who is Romeo?"}]
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == WINDOW
    completion = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 16


@pytest.mark.slow
def test_top_logprobs_without_logprobs_is_a_400_as_openai_answers_it(
    client: openai.OpenAI,
) -> None:
    """Asked for alternatives without logprobs: OpenAI and vLLM refuse it (it was ignored)."""
    import openai

    messages = [{"role": "user", "content": "Hi"}]
    for logprobs in ({}, {"logprobs": False}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model=MODEL_NAME, messages=messages, max_tokens=2, top_logprobs=3, **logprobs
            )
        assert refused.value.body["param"] == "top_logprobs"
        assert "logprobs: true" in refused.value.body["message"]
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=2, logprobs=True, top_logprobs=3
    )
    assert len(reply.choices[0].logprobs.content[0].top_logprobs) == 3


@pytest.mark.slow
def test_length_fields_left_out_or_null_and_stream_options_without_a_stream(
    server: Server, tokenizer: Tokenizer
) -> None:
    """A completion's max_tokens given as null is OpenAI's default (16); a chat request
    without a length whose messages fill the context is refused naming the messages (not a
    field it never sent); stream_options without stream is a 400, as OpenAI and vLLM say."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as http:
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": None, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        answer = http.post("/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 16
        empty = len(tokenizer.encode(ChatTemplate().render([{"role": "user", "content": ""}])))
        content = " a" * (WINDOW - empty)
        rendered = ChatTemplate().render([{"role": "user", "content": content}])
        assert len(tokenizer.encode(rendered)) == WINDOW  # the messages fill the context
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}]}
        refused = http.post("/chat/completions", json=body)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "messages" and error["code"] == "context_length_exceeded"
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2,
                "stream_options": {"include_usage": True}}  # fmt: skip
        refused = http.post("/completions", json=body)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "stream_options"


def test_a_chat_template_file_replaces_the_default(tmp_path: Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    rendered = ChatTemplate.from_file(str(path)).render([{"role": "user", "content": "hi"}])
    assert rendered == "<user>hi<assistant>"


@pytest.mark.slow
def test_models_health_tokenize_detokenize(server: Server, tokenizer: Tokenizer) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = httpx.get(server.base_url + "/models", headers=headers).json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, headers=headers).json()
    assert tokens["tokens"] == tokenizer.encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
    text = httpx.post(
        server.url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=headers
    ).json()
    assert text == {"prompt": PROMPT}


@pytest.mark.slow
def test_the_served_model_is_named_as_given(
    checkpoint: tuple[Path, GPT], tmp_path: Path, tokenizer: Tokenizer
) -> None:
    """Without --served-model-name the id is the --checkpoint-path the user gave (a run
    directory), as vLLM names a model by its --model, not the best.pt it resolved to."""
    import openai

    run = tmp_path / "tiny"
    run.mkdir()
    shutil.copyfile(checkpoint[0], run / "best.pt")
    with running_server(run, tmp_path / "server.log", name=None) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        assert [model.id for model in client.models.list().data] == [str(run)]
        answer = client.completions.create(model=str(run), prompt=PROMPT, max_tokens=2)
        assert answer.model == str(run)
        with pytest.raises(openai.NotFoundError, match="best.pt"):
            client.completions.create(model=str(run / "best.pt"), prompt=PROMPT, max_tokens=2)


@pytest.mark.slow
def test_a_client_that_disconnects_mid_stream_aborts_and_frees_its_blocks(server: Server) -> None:
    before = wait_idle(server)
    long = WINDOW - 24  # seconds of work: still running when the client leaves
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": long, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers) as http:
        with http.stream("POST", "/completions", json=body) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert json.loads(first[5:])["choices"][0]["finish_reason"] is None
            during = metrics(server)
            assert during["rose_kv_blocks_used"] > 0, during
            assert during["rose_num_requests_running"] == 1
        # leaving the block closed the connection mid-stream
    after = wait_idle(server)
    assert after["rose_kv_blocks_used"] == 0
    aborted = 'rose_requests_finished_total{finish_reason="abort"}'
    assert after.get(aborted, 0) == before.get(aborted, 0) + 1
    generated = after["rose_generation_tokens_total"] - before["rose_generation_tokens_total"]
    assert 1 <= generated < long


@pytest.mark.slow
def test_a_non_streamed_client_that_leaves_is_aborted_behind_the_api_key(server: Server) -> None:
    leave_a_non_streamed_request(server, {"Authorization": f"Bearer {API_KEY}"})


ERROR_CASES = [
    # (what is wrong, request body changes, status, param)
    ("prompt over the window", {"prompt": [1] * (WINDOW + 1)}, 400, "prompt"),
    ("max_tokens < 1", {"max_tokens": 0}, 400, "max_tokens"),
    ("temperature < 0", {"temperature": -0.5}, 400, "temperature"),
    ("top_p = 0", {"top_p": 0.0}, 400, "top_p"),
    ("top_p > 1", {"top_p": 1.5}, 400, "top_p"),
    ("a string for an integer", {"max_tokens": "8"}, 400, "max_tokens"),
    ("a bool for an integer", {"max_tokens": True}, 400, "max_tokens"),
    ("an unknown field", {"best_of_three": 1}, 400, "best_of_three"),
    ("token ids outside the vocabulary", {"prompt": [50257]}, 400, "prompt"),
    ("a negative token id", {"prompt": [[11, -5]]}, 400, "prompt"),
    ("unknown model", {"model": "gpt-4"}, 404, "model"),
    ("a presence penalty", {"presence_penalty": 0.5}, 400, "presence_penalty"),
    ("a frequency penalty", {"frequency_penalty": -1.0}, 400, "frequency_penalty"),
    ("a logit bias", {"logit_bias": {"11": 5.0}}, 400, "logit_bias"),
    # issue 21: what could never be admitted is the client's to fix (a 503 would be retried
    # forever), and values the sampler cannot compute or the stop check must not carry
    ("more choices than the queue ever holds", {"prompt": ["a", "b"], "n": 16}, 400, "n"),
    ("more prompts than the queue ever holds", {"prompt": ["a"] * 17}, 400, "prompt"),
    ("a temperature that underflows float32", {"temperature": 1e-50}, 400, "temperature"),
    ("a top_p that underflows float32", {"top_p": 1e-300}, 400, "top_p"),
    ("five stop strings", {"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("a stop string of 4,000 characters", {"stop": "x" * 4000}, 400, "stop"),
]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("case", "change", "status", "param"), ERROR_CASES)
def test_each_bad_request_gets_its_code_and_body_and_the_next_one_succeeds(
    server: Server, case: str, change: dict, status: int, param: str | None, stream: bool
) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "stream": stream, **change}
    response = httpx.post(server.base_url + "/completions", json=body, headers=headers)
    assert response.status_code == status, case
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    if status == 503:
        assert response.headers["Retry-After"] == "1"
    ok = httpx.post(
        server.base_url + "/completions",
        json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2},
        headers=headers,
    )
    assert ok.status_code == 200


@pytest.mark.slow
def test_neutral_penalties_and_no_logit_bias_are_taken_as_client_wrappers_send_them(
    server: Server,
) -> None:
    """Client libraries built on OpenAI's send presence_penalty=0, frequency_penalty=0 and
    logit_bias={} on every call: rose applies none of them, and takes their neutral values."""
    import openai

    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY)
    fields = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    plain = client.completions.create(**fields)
    neutral = client.completions.create(
        **fields, presence_penalty=0, frequency_penalty=0.0, logit_bias={}
    )
    assert neutral.choices[0].text == plain.choices[0].text
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=2, presence_penalty=0, logit_bias=None
    )
    assert chat.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_a_body_that_is_not_json_is_a_400_that_says_so(server: Server) -> None:
    """A cut-off body: FastAPI names the character where JSON broke as the error's "loc",
    which came out as `param: "37"` and "37: JSON decode error"."""
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    body = b'{"model": "tiny", "prompt": '
    response = httpx.post(server.base_url + "/completions", content=body, headers=headers)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] is None
    assert error["message"].startswith("the body is not JSON (Expecting value at character 28)")


@pytest.mark.slow
def test_without_the_api_key_every_api_request_gets_401(server: Server) -> None:
    import openai

    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(
            server.base_url + "/completions", json={"prompt": "Hi"}, headers=headers
        )
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.base_url + "/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/metrics").status_code == 200  # open for scrapers


@pytest.mark.slow
def test_metrics_counters_move_with_a_request(client: openai.OpenAI, server: Server) -> None:
    before = wait_idle(server)
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=7, temperature=0
    )
    after = wait_idle(server)
    moved = {name: after[name] - before.get(name, 0) for name in after}
    assert moved["rose_prompt_tokens_total"] == response.usage.prompt_tokens
    assert moved["rose_generation_tokens_total"] == 7
    assert moved['rose_requests_finished_total{finish_reason="length"}'] == 1
    for histogram in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert moved[f"rose_{histogram}_seconds_count"] == 1
        assert moved[f"rose_{histogram}_seconds_sum"] > 0
    assert after["rose_kv_blocks_used"] == 0 and after["rose_kv_blocks_total"] > 0
    # idle: the pool stays allocated (the only copy of the keys and values)
    assert after["rose_kv_pool_bytes"] > 0
    assert moved["rose_prefix_cache_queries_total"] >= moved["rose_prefix_cache_hits_total"] >= 0


@pytest.mark.slow
def test_max_tokens_past_the_context_is_a_400_naming_the_numbers(
    client: openai.OpenAI, server: Server
) -> None:
    """vLLM's answer, not a silent cap: prompt tokens + max_tokens over the window is a
    400 (OpenAI's context_length_exceeded); exactly the window is served in full."""
    import openai

    prompt = [11] * (WINDOW - 4)  # token ids: the count is exact
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=200)
    error = refused.value
    assert (error.status_code, error.param, error.code) == (
        400, "max_tokens", "context_length_exceeded"
    )  # fmt: skip
    assert f"{WINDOW - 4} + 200 = {WINDOW + 196} > {WINDOW}" in error.message
    assert "lower max_tokens to 4 or less" in error.message
    with pytest.raises(openai.BadRequestError, match=f"{WINDOW - 4} \\+ 5 = {WINDOW + 1}"):
        stream = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=5, stream=True
        )
        list(stream)
    # The chat endpoint counts the rendered messages, and names the field it was given.
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Who art thou?"}],
            max_completion_tokens=WINDOW,
        )
    assert refused.value.param == "max_completion_tokens"
    assert "the messages take" in refused.value.message
    fits = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert fits.usage.completion_tokens == 4 and fits.choices[0].finish_reason == "length"
    assert wait_idle(server)["rose_kv_blocks_used"] == 0


@pytest.mark.slow
def test_bench_serving_reports_every_rate_against_the_server(
    server: Server, tmp_path: Path, tinyshakespeare_path: Path
) -> None:
    out, picture = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["--base-url", server.base_url, "--api-key", API_KEY, "--num-prompts", "6",
            "--input-len", "16", "--output-len", "5", "--ignore-eos", "--request-rate", "20,inf",
            "--dataset-path", str(tinyshakespeare_path), "--json", str(out),
            "--plot", str(picture), "--quiet"]  # fmt: skip
    assert bench_serving.main(argv) == 0
    results = json.loads(out.read_text())["results"]["server"]
    assert [r["request_rate"] for r in results] == [20, float("inf")]
    for r in results:
        assert r["completed"] == 6 and r["failed"] == 0
        assert r["total_output_tokens"] == 6 * 5  # ignore_eos: every request runs to max_tokens
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"] <= r["e2e_ms"]["p99"]
        assert r["tpot_ms"]["p50"] > 0 and r["itl_ms"]["p50"] > 0
    assert picture.stat().st_size > 0


def test_bench_serving_latency_definitions() -> None:
    result = bench_serving.RequestResult(ok=True, prompt_tokens=3, output_tokens=5,
                                         ttft_s=0.2, e2e_s=1.0)  # fmt: skip
    assert result.tpot_s == pytest.approx((1.0 - 0.2) / 4)
    stats = bench_serving.summarize([0.001 * v for v in range(1, 101)])
    assert stats["mean"] == pytest.approx(50.5)
    assert stats["p50"] == pytest.approx(50.5) and stats["p99"] == pytest.approx(99.01)
    gaps = bench_serving.arrival_gaps(4000, rate=8.0, seed=0)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 8, rel=0.05)
    assert bench_serving.arrival_gaps(3, math.inf, 0) == [0, 0, 0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--checkpoint-path", "no/such.pt"], "checkpoint not found"),
        (["--max-waiting", "0"], "--max-waiting must be >= 1"),
        (["--chat-template", "no/such.jinja"], "cannot read the chat template"),
        (["--bogus"], "unrecognized arguments"),
    ],
)
def test_serve_mistakes_are_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from roseinfer.cli import serve

    assert serve.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("[rose-serve] error: ") and message in err and "\n" not in err


@pytest.mark.slow
def test_a_busy_port_is_one_clear_line(
    server: Server, checkpoint: tuple[Path, GPT], capsys: pytest.CaptureFixture[str]
) -> None:
    from roseinfer.cli import serve

    port = server.url.rsplit(":", 1)[1]
    assert serve.main(["--checkpoint-path", str(checkpoint[0]), "--port", port]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_the_engine_thread_runs_the_model_with_the_threads_it_was_given(
    model: GPT, tokenizer: Tokenizer
) -> None:
    """The server's threads keep to one torch thread (this module's fixture, the CLI's
    main thread) and its engine thread takes the count it is given: every step runs with
    it, and the other threads keep theirs (OpenMP's thread count is per thread)."""
    assert torch.get_num_threads() == 1
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    threads_in_steps: list[int] = []
    step = engine.step

    def counting_step() -> list:
        threads_in_steps.append(torch.get_num_threads())
        return step()

    engine.step = counting_step
    settings = ServerSettings(model_name="tiny", threads=Threads(2))  # (fixed: --num-threads 2)
    app = build_app(engine, tokenizer, settings)
    try:
        with BackgroundServer(app) as server:
            body = {"prompt": [15496, 11], "max_tokens": 4, "temperature": 0}
            response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    finally:
        torch.set_num_threads(1)  # the count new threads start with, as the fixture left it
    assert response.status_code == 200
    assert threads_in_steps and set(threads_in_steps) == {2}
    assert torch.get_num_threads() == 1
