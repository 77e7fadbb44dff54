"""The live page at `/` in a real headless Chromium (Debian's `chromium` and
`chromium-driver`, driven by selenium) against a real server on loopback.

The page is checked as a user sees it: the server's own 401 message until the key is
given; a prompt typed and sent streams the API's greedy text; a long request shows up
running with its blocks used, and the used blocks go back to zero when it ends; nothing
is asked of any origin but the server's; without JavaScript one line says why the page
is empty. A screenshot taken during a burst goes to artifacts/ (gitignored).

No browser is a failure, not a skip: `.ci/run` installs one.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from browser import start_browser
from fastapi.testclient import TestClient
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from servers import API_KEY, WINDOW, Server, running_server, write_test_checkpoint

from benchmarks import live_page as bench_live_page
from roseinfer.engine.block_manager import blocks_for
from roseinfer.engine.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.loading import load_model_and_tokenizer
from roseinfer.serving.app import ServerSettings, build_app

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
NUM_KV_BLOCKS = 96
KV_BLOCK_SIZE = 16  # the server's default
WAIT_S = 30  # generous: the CI machine is small and shared

# One script reads the running rows and every cell in one go, so both come from the
# same drawing of one snapshot.
READ_POOL = """
const rows = [...document.querySelectorAll('[data-testid="running-request"]')];
const cells = [...document.querySelectorAll('[data-testid="kv-block"]')];
return {
  running: rows.map((r) => ({id: r.dataset.requestId, blocks: r.dataset.blocks})),
  states: cells.map((c) => c.dataset.state),
  outlined: cells.filter((c) => c.classList.contains("outlined")).map((c) => +c.dataset.block),
};
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("live") / "tiny.pt"
    write_test_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("live-log") / "server.log"
    flags = ("--api-key", API_KEY, "--num-kv-blocks", str(NUM_KV_BLOCKS))
    with running_server(checkpoint, log, *flags) as server:
        yield server


@pytest.fixture(scope="module")
def browser(server: Server) -> Iterator[webdriver.Chrome]:  # closed before the server stops
    driver = start_browser()
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(browser: webdriver.Chrome, condition, what: str):  # noqa: ANN001, ANN201
    try:
        return WebDriverWait(browser, WAIT_S, poll_frequency=0.05).until(lambda _: condition())
    except TimeoutException:
        raise AssertionError(f"the page did not show {what} within {WAIT_S} s") from None


def by_testid(browser: webdriver.Chrome, name: str, more: str = ""):  # noqa: ANN201
    return browser.find_elements(By.CSS_SELECTOR, f'[data-testid="{name}"]{more}')


def open_page(browser: webdriver.Chrome, server: Server, key: str | None) -> None:
    """Load the page with no key remembered; give it `key` and wait for the live pool."""
    browser.get(server.url + "/")
    browser.execute_script("sessionStorage.clear()")
    browser.get(server.url + "/")
    if key is None:
        return
    by_testid(browser, "api-key")[0].send_keys(key)
    by_testid(browser, "use-key")[0].click()
    wait_for(browser, lambda: by_testid(browser, "connection")[0].text == "live", "'live'")
    wait_for(browser, lambda: len(by_testid(browser, "kv-block")) == NUM_KV_BLOCKS, "the pool")


def fill(browser: webdriver.Chrome, **fields: str) -> None:
    for name, value in fields.items():
        box = by_testid(browser, name.replace("_", "-"))[0]
        box.clear()
        box.send_keys(value)


def api(server: Server, key: str | None = API_KEY) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=60)


@pytest.mark.slow
def test_without_the_key_the_page_shows_the_servers_401_and_works_with_it(
    browser: webdriver.Chrome, server: Server
) -> None:
    with api(server, key=None) as http:
        refused = http.get("/live/snapshot")
    assert refused.status_code == 401
    message = refused.json()["error"]["message"]

    open_page(browser, server, key=None)
    error = by_testid(browser, "error")[0]
    wait_for(browser, lambda: error.is_displayed() and error.text == message, "the 401 message")
    assert not by_testid(browser, "kv-block"), "the pool was drawn without the key"
    # The playground's requests are refused the same way, in their own card.
    by_testid(browser, "send")[0].click()
    wait_for(browser, lambda: message in by_testid(browser, "request")[0].text, "a refused request")

    by_testid(browser, "api-key")[0].send_keys(API_KEY)
    by_testid(browser, "use-key")[0].click()
    wait_for(browser, lambda: len(by_testid(browser, "kv-block")) == NUM_KV_BLOCKS, "the pool")
    assert not error.is_displayed()
    states = {cell.get_attribute("data-state") for cell in by_testid(browser, "kv-block")}
    assert states <= {"free", "cached"}, "an idle server has no used block"


@pytest.mark.slow
def test_a_prompt_typed_and_sent_streams_the_apis_greedy_text(
    browser: webdriver.Chrome, server: Server
) -> None:
    prompt, max_tokens = "ROMEO: Is the day so young?", 24
    with api(server) as http:
        answer = http.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        )
    answer.raise_for_status()
    expected = answer.json()["choices"][0]["text"]
    assert expected.strip(), "the greedy text is empty: nothing to compare"

    open_page(browser, server, API_KEY)
    fill(browser, prompt=prompt, max_tokens=str(max_tokens), temperature="0", copies="1")
    by_testid(browser, "send")[0].click()
    card = wait_for(
        browser, lambda: by_testid(browser, "request", '[data-state="done"]'), "a reply"
    )[0]
    streamed = card.find_element(By.CSS_SELECTOR, '[data-testid="output"]')
    assert streamed.get_attribute("textContent") == expected
    assert "TTFT" in card.text and "tokens/s" in card.text


@pytest.mark.slow
def test_a_long_request_shows_running_with_its_blocks_used_then_frees_them(
    browser: webdriver.Chrome, server: Server
) -> None:
    open_page(browser, server, API_KEY)
    prompt_ids = list(range(1000, 1040))  # 40 tokens: three blocks before any output
    max_tokens = WINDOW - len(prompt_ids)  # as long as the model's window allows
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    started, request_id, failures = threading.Event(), [], []

    def long_request() -> None:
        try:
            with (
                api(server) as http,
                http.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply,
            ):
                reply.raise_for_status()
                for line in reply.iter_lines():
                    if line.startswith("data: {") and not request_id:
                        request_id.append(json.loads(line[6:])["id"] + "-0")  # choice 0
                        started.set()
        except Exception as err:  # reported by the test below
            failures.append(err)
            started.set()

    thread = threading.Thread(target=long_request)
    thread.start()
    try:
        assert started.wait(WAIT_S) and not failures, f"the long request failed: {failures}"
        # A burst from the page beside it, for the screenshot.
        fill(browser, prompt="To be, or not to be", max_tokens="200", temperature="0.8", copies="3")
        by_testid(browser, "send")[0].click()

        def shown() -> dict | None:
            pool = browser.execute_script(READ_POOL)
            mine = [row for row in pool["running"] if row["id"] == request_id[0]]
            return {"blocks": [int(b) for b in mine[0]["blocks"].split()], **pool} if mine else None

        pool = wait_for(browser, shown, "the long request running")
        assert len(pool["blocks"]) >= blocks_for(len(prompt_ids) + 1, KV_BLOCK_SIZE)
        assert all(pool["states"][b] == "used" for b in pool["blocks"]), pool
        # Hovering its row outlines exactly its blocks.
        row = f'[data-request-id="{request_id[0]}"]'
        ActionChains(browser).move_to_element(
            by_testid(browser, "running-request", row)[0]
        ).perform()
        wait_for(browser, lambda: (p := shown()) and p["outlined"] == p["blocks"], "its outline")

        def burst() -> bool:
            return len(browser.execute_script(READ_POOL)["running"]) >= 3

        wait_for(browser, burst, "the burst running beside the long request")
        ARTIFACTS.mkdir(exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "live-page.png"))
    finally:
        thread.join(120)
    assert not failures, failures

    def idle() -> bool:
        pool = browser.execute_script(READ_POOL)
        return not pool["running"] and "used" not in pool["states"]

    wait_for(browser, idle, "no request running and no used block")
    # The memory line: the pool stays when no request runs.
    summary = browser.execute_script('return document.getElementById("pool-summary").textContent')
    assert "pool " in summary and "MiB" in summary, summary

    def replied() -> bool:
        return len(by_testid(browser, "request", '[data-state="done"]')) == 3

    wait_for(browser, replied, "the burst's three replies")


@pytest.mark.slow
def test_the_page_asks_nothing_of_any_other_origin(
    browser: webdriver.Chrome, server: Server
) -> None:
    open_page(browser, server, API_KEY)
    fill(browser, prompt="Hello", max_tokens="8", copies="1")
    by_testid(browser, "send")[0].click()
    wait_for(browser, lambda: by_testid(browser, "request", '[data-state="done"]'), "a reply")
    # The DevTools log holds every request since the browser started (earlier tests too),
    # the browser's own chrome:// pages among them: what went over the network, and
    # whatever our page asked for.
    urls = []
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            url, document = message["params"]["request"]["url"], message["params"]["documentURL"]
            if not url.startswith("chrome") or document.startswith(server.url):
                urls.append(url)
    urls += browser.execute_script(
        "return performance.getEntriesByType('resource').map((e) => e.name)"
    )
    own = [url for url in urls if url.startswith(server.url + "/") or url.startswith("data:")]
    assert {"/", "/page/app.js", "/live/events", "/v1/completions"} <= {
        url.removeprefix(server.url) for url in own
    }
    assert own == urls, sorted(set(urls) - set(own))


@pytest.mark.slow
def test_without_javascript_one_line_says_why(server: Server) -> None:
    browser = start_browser(javascript=False)
    try:
        browser.get(server.url + "/")
        line = by_testid(browser, "noscript")
        assert line and line[0].is_displayed(), "no <noscript> line shown"
        assert "JavaScript" in line[0].text and "\n" not in line[0].text
        assert not by_testid(browser, "kv-block")
    finally:
        browser.quit()


@pytest.mark.slow
def test_bench_live_page_runs_the_load_with_the_page_closed_and_open(
    server: Server, checkpoint: Path, capsys: pytest.CaptureFixture
) -> None:
    argv = ["--base-url", server.base_url, "--api-key", API_KEY, "--rounds", "1",
            "--num-prompts", "4", "--input-len", "8", "--output-len", "24", "--random",
            "--ignore-eos"]  # fmt: skip
    assert bench_live_page.main(argv) == 0
    out = capsys.readouterr().out
    closed, opened = (
        re.search(rf"page {mode}\s.*\s([\d.]+) snapshots/s", out) for mode in ("closed", "open")
    )
    assert closed and float(closed.group(1)) == 0, out
    assert opened and float(opened.group(1)) > 0, out  # the open page was sent snapshots
    assert "open/closed = " in out

    # Without a server: the hook's share of the steps' CPU time, in an in-process engine.
    argv = ["--checkpoint-path", str(checkpoint), *argv[4:]]
    assert bench_live_page.main(argv) == 0
    shares = re.findall(r"page (\w+) .* hook +([\d.]+)% of step CPU time", capsys.readouterr().out)
    assert [mode for mode, _ in shares] == ["closed", "open"], shares


def test_no_live_page_turns_the_page_and_its_endpoints_off(checkpoint: Path) -> None:
    model, tokenizer, _ = load_model_and_tokenizer(str(checkpoint))
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=8))
    for live_page, status in ((True, 200), (False, 404)):
        app = build_app(engine, tokenizer, ServerSettings("tiny", live_page=live_page))
        with TestClient(app) as client:
            assert client.get("/").status_code == status
            assert client.get("/live/snapshot").status_code == status
            if live_page:  # after a request: nothing runs, its blocks are cached or free
                body = {"prompt": list(range(40)), "max_tokens": 4, "temperature": 0}
                assert client.post("/v1/completions", json=body).status_code == 200
                snapshot = client.get("/live/snapshot").json()
                assert len(snapshot["blocks"]) == 8 and set(snapshot["blocks"]) == {"f", "c"}
                assert snapshot["running"] == snapshot["waiting"] == []
                assert snapshot["generation_tokens"] == 4
                assert snapshot["pool_bytes"] == engine.pool.nbytes
