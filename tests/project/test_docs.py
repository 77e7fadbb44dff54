"""The documentation: README.md as a front page, the site in docs/ built strict, and
every rose command line the docs show parsed by that program's own argument parser.

The command lines are read from README.md, docs/*.md and chapters/*.md: the shell code
blocks (line continuations joined, `&&` / `|` / `;` chains split, environment prefixes
and redirections dropped, `<placeholders>` read as one word) and the inline code spans
that hold a program with its arguments. A line starts a rose program when it runs one
of pyproject's [project.scripts] or `-m` one of rose's modules or benchmarks (`python -m`,
`torchrun ... -m`); its arguments go through the `build_parser()` of the module whose
`main` runs, so a flag the program does not take (misspelt, removed, renamed) fails here.

The site is built once for the module (`mkdocs build --strict` into a temp dir, as a
user would build it; in CI, the one .ci/run has just built: ROSE_DOCS_SITE), then read:
offline (nothing fetched from another host), its search index, the chapters with their
stored outputs, and one chapter page in a real headless Chromium.
"""

from __future__ import annotations

import argparse
import html
import importlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from functools import cache, partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rosetrainer.errors import RoseError

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = REPO_ROOT / "docs"
# rose's programs: its packages', and the benchmark programs beside them (run from a clone)
ROSE_PACKAGES = ("rosetrainer", "roseinfer", "rosecourse", "benchmarks")


def console_scripts() -> dict[str, str]:
    """pyproject's [project.scripts]: "rose-train" -> "rosetrainer.train:main".

    Read as text (`name = "module:function"` lines), as tomllib needs Python 3.11."""
    pyproject = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    table = pyproject.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([\w.]+:\w+)"', table, re.M))


SCRIPTS = console_scripts()
README_MAX_LINES = 200
QUICKSTART = (
    "pip install -e . && python -m rosetrainer.train --preset tiny && "
    'python -m roseinfer.cli_generate --prompt "ROMEO:"'
)
TEST_COMMAND = 'pip install -e ".[dev]" && python -m pytest -q'

# Every section of the README before it became a front page (912 lines, commit
# ce9baf9), and the page that holds it now: the heading there, and a sentence of the
# section's own text, so that a page which kept the title and lost the text fails.
OLD_README_SECTIONS = {
    "Two commands": ("getting-started.md", "Two commands", "the tests look there by themselves"),
    "The course": ("course.md", "The course", "graded against the uncached oracle by one command, no"),
    "Training": ("training.md", "Training", "Flags override a `--config` file (JSON or"),
    "What rose protects": ("protects.md", "What rose protects", "A dash means there is no switch"),
    "Generating": ("generating.md", "Generating", "streams text to stdout and"),
    "Engine": ("engine.md", "The engine", "A server drives `roseinfer.engine.LLMEngine` itself"),
    "Split model": ("split-model.md", "The split model", "Each stage reads only its share of the checkpoint"),
    "Serving": ("serving.md", "Serving", "GPT-2 has no chat format"),
    "The live page": ("serving.md", "The live page", "an unwatched server pays"),
    "Take your model elsewhere": ("leaving-rose.md", "Hugging Face: transformers, vLLM, llama.cpp", "`merges.txt` comes out byte for byte OpenAI's `vocab.bpe`"),
    "ONNX": ("leaving-rose.md", "ONNX", "writes the model as one ONNX"),
    "Quantized KV cache": ("quantized-cache.md", "The quantized KV cache", "int4 packed two a byte"),
    "Rotary positions, a sliding window, attention sinks": ("rotary.md", "Rotary positions, a sliding window, attention sinks", "generates past `block_size` for as long as you ask"),
    "Benchmarks": ("benchmarks.md", "Benchmarks", "the tests only smoke-test them"),
    "Measured here (2-core Xeon @ 2.5 GHz, no GPU)": ("benchmarks.md", "Measured here (2-core Xeon @ 2.5 GHz, no GPU)", "nanoGPT's train.py does about 1,950 tokens/s"),
}  # fmt: skip


# ---------------------------------------------------------------- command lines


@dataclass(frozen=True)
class Invocation:
    where: str  # "docs/serving.md:12"
    program: str  # the module whose `main` runs: "rosetrainer.train"
    args: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: {self.program} {shlex.join(self.args)}"


FENCE = re.compile(r"^(```+|~~~+)[ \t]*([\w+-]*)[^\n]*\n(.*?)^\1[ \t]*$", re.M | re.S)
SHELL = {"", "bash", "sh", "shell", "console"}
INLINE = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+){0,2})`(?!`)")  # a span may wrap twice
PLACEHOLDER = re.compile(r"<[\w.-]+>")  # <hf-dataset>
METAVAR = re.compile(r"[A-Z][A-Z0-9_]*")  # N, DIR: a value the reader fills in
SEPARATORS = {"&&", "||", "|", ";", "&", "(", ")"}
ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")


def command_lines(text: str) -> Iterator[tuple[int, str, bool]]:
    """(line number, command line, whether it stood alone in a shell block) in markdown."""
    for block in FENCE.finditer(text):
        if block.group(2) not in SHELL:
            continue
        first = text.count("\n", 0, block.start(3)) + 1
        lines = block.group(3).split("\n")
        index = 0
        while index < len(lines):
            start, line = index, lines[index]
            while line.endswith("\\") and index + 1 < len(lines):  # a continuation
                index += 1
                line = line[:-1] + " " + lines[index]
            index += 1
            if line.strip():
                yield first + start, line, True
    # Outside the blocks (blanked, so that the line numbers stay), the inline spans.
    prose = FENCE.sub(lambda block: "\n" * block.group(0).count("\n"), text)
    for span in INLINE.finditer(prose):
        yield prose.count("\n", 0, span.start()) + 1, span.group(1).replace("\n", " "), False


def rose_invocations(line: str, where: str, standalone: bool = True) -> list[Invocation]:
    """The rose programs one shell line starts, each with its own arguments.

    An inline span that only names a program (`rose-serve`) is a name, not a command
    line; in a shell block a bare program is run with no arguments and is checked.
    """
    lexer = shlex.shlex(PLACEHOLDER.sub("VALUE", line), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)  # `# comments` are dropped here
    except ValueError:  # an unclosed quote: prose with an apostrophe, read word by word
        tokens = line.split()
    segments: list[list[str]] = [[]]
    skip_next = False
    for token in tokens:
        if skip_next:  # the file of a redirection
            skip_next = False
        elif token in SEPARATORS:
            segments.append([])
        elif set(token) <= set("<>"):  # > out.jsonl, < prompts.txt
            skip_next = True
        else:
            segments[-1].append(token)
    found = []
    for segment in segments:
        while segment and ASSIGNMENT.match(segment[0]):  # FOO=1 rose-train ...
            segment = segment[1:]
        program, args = _program(segment)
        if program and (standalone or args):
            found.append(Invocation(where, program, tuple(args)))
    return found


def _program(segment: list[str]) -> tuple[str | None, list[str]]:
    if segment and segment[0] in SCRIPTS:
        return SCRIPTS[segment[0]].split(":")[0], segment[1:]
    # python -m M, python3 -m M, torchrun --nproc_per_node=2 -m M, flock LOCK python -m M
    for index, token in enumerate(segment[:-1]):
        module = segment[index + 1]
        if token == "-m" and module.split(".")[0] in ROSE_PACKAGES:
            return module, segment[index + 2 :]
    return None, []


def documented_invocations() -> list[Invocation]:
    files = [REPO_ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted((REPO_ROOT / "chapters").glob("*.md"))]  # fmt: skip
    found = []
    for path in files:
        name = path.relative_to(REPO_ROOT).as_posix()
        for number, line, standalone in command_lines(path.read_text(encoding="utf-8")):
            found += rose_invocations(line, f"{name}:{number}", standalone)
    return found


@cache
def parser_for(module_name: str) -> argparse.ArgumentParser:
    """The parser of the program `python -m module_name` runs: its `main`'s module's."""
    module = importlib.import_module(module_name)
    home = sys.modules[module.main.__module__] if hasattr(module, "main") else module
    build_parser = getattr(home, "build_parser", None)
    assert build_parser is not None, (
        f"{home.__name__} has no build_parser(): give it one, so that the command lines "
        f"the docs show for {module_name} can be checked"
    )
    return build_parser()


def filled_in(parser: argparse.ArgumentParser, args: tuple[str, ...]) -> list[str]:
    """A metavar the page shows as a value (`--pipeline-parallel-size N`) becomes a value
    of the flag's type, so that the check is about the flags, not the reader's numbers."""
    filled = list(args)
    for index in range(1, len(filled)):
        action = parser._option_string_actions.get(filled[index - 1])
        if action is None or not METAVAR.fullmatch(filled[index]):
            continue
        if action.choices:
            filled[index] = str(next(iter(action.choices)))
        elif action.type in (int, float):
            filled[index] = "1"
    return filled


def parse_error(invocation: Invocation) -> str | None:
    """None when the program's parser takes these arguments, else its complaint."""
    parser = parser_for(invocation.program)
    said = io.StringIO()
    try:
        with redirect_stdout(io.StringIO()), redirect_stderr(said):
            parser.parse_args(filled_in(parser, invocation.args))
    except RoseError as error:
        return str(error)
    except SystemExit as exit_:  # argparse's own parsers; --help exits 0
        return said.getvalue().strip().splitlines()[-1] if exit_.code else None
    return None


DOCUMENTED = documented_invocations()


def test_the_docs_show_rose_command_lines() -> None:
    """The reading is not vacuous: the README's quickstart and the docs' CLIs are seen."""
    programs = {invocation.program for invocation in DOCUMENTED}
    assert {"rosetrainer.train", "roseinfer.cli_generate", "rosecourse.cli"} <= programs
    assert {
        "roseinfer.cli.serve",
        "roseinfer.cli.export_hf",
        "roseinfer.cli.export_onnx",
    } <= programs
    assert {"benchmarks.train", "benchmarks.decode", "benchmarks.engine"} <= programs
    readme = [i for i in DOCUMENTED if i.where.startswith("README.md:")]
    assert any(i.program == "rosetrainer.train" and i.args == ("--preset", "tiny") for i in readme)
    assert len(DOCUMENTED) > 80, len(DOCUMENTED)


@pytest.mark.parametrize("invocation", DOCUMENTED, ids=str)
def test_documented_command_line_parses(invocation: Invocation) -> None:
    error = parse_error(invocation)
    assert error is None, f"{invocation}\n  the program says: {error}"


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_rose_program_exposes_its_parser(script: str) -> None:
    """So that any line a page shows for it can be checked."""
    assert parser_for(SCRIPTS[script].split(":")[0]).format_usage()


def test_a_flag_the_program_does_not_take_fails() -> None:
    text = """
```bash
python -m roseinfer.cli_generate --prompt "ROMEO:" --no-such-flag 3
rose-train --preset tiny --max-iters 2000    # nanoGPT's name, not rose's
```

Resume with `python -m rosetrainer.train --resume --max-steps 4000`, or serve with
`rose-serve --checkpoint-path runs/a.pt --prot
8000` (a flag cut by a line break in the prose).
"""
    found = [
        invocation
        for number, line, standalone in command_lines(text)
        for invocation in rose_invocations(line, f"test:{number}", standalone)
    ]
    assert [(i.where, i.program) for i in found] == [
        ("test:3", "roseinfer.cli_generate"),
        ("test:4", "rosetrainer.train"),
        ("test:7", "rosetrainer.train"),
        ("test:8", "roseinfer.cli.serve"),
    ]
    errors = [parse_error(invocation) for invocation in found]
    assert "--no-such-flag" in errors[0]
    assert "--max-iters" in errors[1]
    assert errors[2] is None
    assert "--prot" in errors[3]


def test_a_shell_line_is_read_as_the_shell_reads_it() -> None:
    line = (
        "printf 'ROMEO:\\n' | FOO=1 BAR=2 rose-generate --prompt-file - --stop 'a b' "
        "> out.jsonl && torchrun --standalone --nproc_per_node=2 -m rosetrainer.train "
        "--dataset <hf-dataset> --dtype bfloat16; rose-serve; curl -s localhost:8000/health"
        "  # and a comment --not-a-flag"
    )
    assert rose_invocations(line, "here") == [
        Invocation("here", "roseinfer.cli_generate", ("--prompt-file", "-", "--stop", "a b")),
        Invocation("here", "rosetrainer.train", ("--dataset", "VALUE", "--dtype", "bfloat16")),
        Invocation("here", "roseinfer.cli.serve", ()),
    ]  # fmt: skip
    block = "```bash\nrose-train --preset tiny \\\n    --max-steps 10\n```\n"
    assert list(command_lines(block)) == [(2, "rose-train --preset tiny      --max-steps 10", True)]
    assert rose_invocations("rose-serve", "prose", standalone=False) == []


# ---------------------------------------------------------------- README and pages


def test_readme_is_a_front_page_with_the_two_commands() -> None:
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES
    code_lines = {line for _, line, standalone in command_lines(readme) if standalone}
    assert QUICKSTART in code_lines
    assert TEST_COMMAND in code_lines


@pytest.mark.parametrize("section", OLD_README_SECTIONS)
def test_every_old_readme_section_is_on_a_page(section: str) -> None:
    page, heading, sentence = OLD_README_SECTIONS[section]
    text = (DOCS / page).read_text(encoding="utf-8")
    headings = {line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")}
    assert heading in headings, f"docs/{page} has no heading {heading!r}"
    assert sentence in " ".join(text.split()), f"docs/{page} lost {section!r}: {sentence!r}"


def test_every_page_is_in_the_navigation() -> None:
    """A page that exists but is in no menu is found by nobody (mkdocs only logs it)."""
    nav = (REPO_ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\s*-\s*(?:[^:\n]+:\s*)?([\w./-]+\.md)\s*$", nav, re.M))
    assert {page.name for page in DOCS.glob("*.md")} <= listed


def test_links_out_of_docs_are_made_right_for_the_site() -> None:
    """A page written to read on GitHub (links to ../chapters, ../roseinfer) builds."""
    spec = importlib.util.spec_from_file_location("site_hooks", DOCS / "site_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = (
        "[chapter 04](../chapters/04-position-offsets.md#the-check), "
        "[the notebook](../notebooks/11_paged_kv_cache.ipynb), "
        "[`roseinfer/cache/paged.py`](../roseinfer/cache/paged.py), "
        "[the pool](../roseinfer/cache/paged.py), [gone](../roseinfer/gone.py), [a page](engine.md)"
    )
    assert hooks.repository_links(page, "vllm.md") == (
        "[chapter 04](notebooks/04_position_offsets.ipynb#the-check), "
        "[the notebook](notebooks/11_paged_kv_cache.ipynb), "
        "`roseinfer/cache/paged.py`, "
        "the pool (`roseinfer/cache/paged.py`), [gone](../roseinfer/gone.py), [a page](engine.md)"
    )


# ---------------------------------------------------------------- the built site


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`mkdocs build --strict`, once: a broken link or a missing page fails it.

    ROSE_DOCS_SITE names a site already built strict from this checkout, to read instead:
    .ci/run builds it (in a venv holding only the docs extra) just before the tests, and
    a second build of the same pages would cost CI 20-50 s of a core."""
    if os.environ.get("ROSE_DOCS_SITE"):
        built = Path(os.environ["ROSE_DOCS_SITE"])
        assert (built / "index.html").is_file(), f"ROSE_DOCS_SITE={built} holds no built site"
        return built
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO_ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if build.returncode != 0:
        pytest.fail(f"mkdocs build --strict failed:\n{build.stderr[-4000:]}")
    return out


@pytest.mark.slow
def test_the_site_builds_strict_with_every_page(site: Path) -> None:
    pages = {path.relative_to(site).as_posix() for path in site.rglob("*.html")}
    assert {page.with_suffix(".html").name for page in DOCS.glob("*.md")} <= pages
    chapters = sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert {f"notebooks/{chapter.stem}.html" for chapter in chapters} <= pages
    menu = (site / "index.html").read_text(encoding="utf-8")
    unlisted = [c.stem for c in chapters if f'href="notebooks/{c.stem}.html"' not in menu]
    assert not unlisted, f"chapters missing from the site's menu: {unlisted}"


@pytest.mark.slow
def test_the_site_fetches_nothing_from_elsewhere(site: Path) -> None:
    """No font, script, style or image from another host: it reads the same offline."""
    fetched = re.compile(r"""<(?:script|link|img|iframe|source)\b[^>]*\b(?:src|href)=["']((?:https?:)?//[^"']*)""")  # fmt: skip
    imports = re.compile(r"""(?:import\(|url\()\s*["']?((?:https?:)?//[^"')]*)""")
    for page in site.rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        external = fetched.findall(text) + imports.findall(text)
        assert not external, f"{page.relative_to(site)} fetches {external}"


@pytest.mark.slow
def test_search_has_every_page_in_its_index(site: Path) -> None:
    index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    located = {entry["location"].split("#")[0] for entry in index["docs"]}
    assert {"benchmarks.html", "serving.html", "notebooks/04_position_offsets.html"} <= located
    assert any("paged attention kernel" in entry["text"].lower() for entry in index["docs"])


def stored_outputs(notebook: Path) -> tuple[list[str], int]:
    """A notebook's printed text outputs (first line of each) and its number of images."""
    texts, images = [], 0
    for cell in json.loads(notebook.read_text(encoding="utf-8"))["cells"]:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            images += "image/png" in data
            text = "".join(output.get("text", data.get("text/plain", "")))
            if output.get("output_type") == "stream" and text.strip():
                texts.append(text.strip().splitlines()[0])
    return texts, images


@pytest.mark.slow
@pytest.mark.parametrize(
    "notebook", sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")), ids=lambda p: p.stem
)
def test_each_chapter_is_on_the_site_with_its_stored_outputs(site: Path, notebook: Path) -> None:
    page = (site / "notebooks" / f"{notebook.stem}.html").read_text(encoding="utf-8")
    texts, images = stored_outputs(notebook)
    assert texts, f"{notebook.name} has no printed output: was it executed?"
    shown = html.unescape(re.sub(r"<[^>]+>", "", page))
    for text in texts:
        assert text in shown, f"{notebook.name}'s output {text!r} is not on its page"
    assert page.count('src="data:image/png;base64,') == images


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass  # no line per request on the test's stderr


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """The built site over HTTP on a free loopback port, as `mkdocs serve` would give it
    (search runs in a web worker, which a page opened from disk may not start)."""
    handler = partial(QuietHandler, directory=str(site))
    # Port 0: the server binds a free port itself (a port probed, freed and bound again
    # could be taken in between by a test running beside this one).
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.slow
def test_a_chapter_renders_in_a_browser_with_its_output_and_search(served: str) -> None:
    from browser import start_browser
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    notebook = REPO_ROOT / "notebooks" / "04_position_offsets.ipynb"
    first_output = stored_outputs(notebook)[0][0]
    browser = start_browser()
    try:
        browser.get(f"{served}/notebooks/{notebook.stem}.html")
        assert browser.title.startswith("04 · Position offsets"), browser.title
        heading = browser.find_element(By.CSS_SELECTOR, "article h1")
        assert heading.is_displayed() and heading.text.startswith("04 · Position offsets")
        outputs = browser.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output")
        shown = [output for output in outputs if output.is_displayed()]
        assert any(first_output in output.text for output in shown), first_output
        figure = browser.find_element(By.CSS_SELECTOR, ".jp-OutputArea-output img")
        assert browser.execute_script("return arguments[0].naturalWidth", figure) > 0
        urls = browser.execute_script(
            "return performance.getEntriesByType('resource').map((e) => e.name)"
        )
        assert all(url.startswith((served + "/", "data:")) for url in urls), urls

        # Search, in the browser, over the index the build wrote.
        query = browser.find_element(By.CSS_SELECTOR, "input[data-md-component='search-query']")
        query.click()
        query.send_keys("paged attention kernel")
        WebDriverWait(browser, 30).until(
            lambda _: any(
                "engine.html" in (link.get_attribute("href") or "")
                for link in browser.find_elements(By.CSS_SELECTOR, ".md-search-result__link")
            )
        )
    finally:
        browser.quit()
