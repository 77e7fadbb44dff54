"""The documentation site's hooks (docs/site_hooks.py) need only what `.[docs]` installs.

`pip install -e ".[docs]" && mkdocs build --strict` is how the README builds the site. Its
hooks once imported rosecourse.course for the exercise list, which imports every check
and build (hypothesis, llguidance, the tokenizer's files): the build failed in a venv
holding only the docs extra. The list is now read from the course's source; these tests
hold that reading to the module it reads, and run it where the course cannot be imported.
(.ci/run builds the whole site in such a venv: .ci/docs-venv.)
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
HOOKS = REPO_ROOT / "docs" / "site_hooks.py"


def site_hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("site_hooks", HOOKS)
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks


def test_the_exercise_list_is_the_lessons_rose_course_grades() -> None:
    from rosecourse.course import LESSONS

    hooks = site_hooks()
    assert hooks.lessons() == [(lesson.chapter, lesson.name, lesson.task) for lesson in LESSONS]
    table = hooks.exercise_table().splitlines()
    assert len(table) == 2 + len(LESSONS)
    assert all(
        f"`{lesson.file_name}`" in row for lesson, row in zip(LESSONS, table[2:], strict=True)
    )


def test_the_exercise_list_is_made_without_the_course_or_the_tokenizer() -> None:
    """Neither rosecourse, the course's test dependencies nor tiktoken can be imported."""
    script = textwrap.dedent(
        f"""
        import importlib.util, sys
        for name in ("rosecourse", "hypothesis", "llguidance", "tiktoken", "rosetrainer"):
            sys.modules[name] = None  # any import of it raises ImportError
        spec = importlib.util.spec_from_file_location("site_hooks", {str(HOOKS)!r})
        hooks = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(hooks)
        markdown = "# The course\\n\\n" + hooks.EXERCISES_MARKER + "\\n"
        page = type("Page", (), {{"file": type("File", (), {{"src_uri": "course.md"}})()}})()
        print(hooks.on_page_markdown(markdown, page, None))
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| 20 | `ch20_choice_mask.py` |" in run.stdout


def test_a_lessons_table_the_site_cannot_read_is_named(tmp_path: Path) -> None:
    source = tmp_path / "course.py"
    source.write_text('LESSONS = [Lesson("02", NAME, "task", check)]\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"course\.py:1: .*three string literals"):
        site_hooks().lessons(source)
    source.write_text("BUILDS = []\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no LESSONS table"):
        site_hooks().lessons(source)


def test_every_link_of_the_built_site_is_followed_anchors_and_notebooks_too(
    tmp_path: Path,
) -> None:
    """MkDocs checks a Markdown page's links, but not an anchor on a link to a notebook's
    page, nor a link inside a notebook: the hook's own check follows every link of every
    built page."""
    hooks = site_hooks()
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "04_x.html").write_text(
        '<h2 id="the-check">The check</h2>'
        '<a href="#the-check">ok</a> <a href="../engine.html#gone">a bad anchor elsewhere</a>'
        '<a href="05_y.html">no such page</a> <a href="https://example.org/#x">elsewhere</a>'
    )
    (tmp_path / "engine.html").write_text(
        '<p id="kept"></p><a href="notebooks/04_x.html#the-check">ok</a>'
        '<a href="notebooks/04_x.html#nope">a bad anchor on a chapter</a>'
        '<a href="#kept">ok</a> <a href="assets/x.css">no such file</a>'
    )
    (tmp_path / "404.html").write_text('<a href="/anything.html">absolute, for any depth</a>')
    assert hooks.broken_links(tmp_path) == [
        "engine.html: notebooks/04_x.html#nope",
        "engine.html: assets/x.css",
        "notebooks/04_x.html: ../engine.html#gone",
        "notebooks/04_x.html: 05_y.html",
    ]
