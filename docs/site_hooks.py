"""MkDocs hooks for rose's site (mkdocs.yml names this file).

The course's pages come from the project itself, so that the site cannot fall behind
it: one page per chapter notebook in notebooks/ (rendered by mkdocs-jupyter with the
outputs stored in it), and the exercise list from the lessons `rose-course` grades.

A page may link to a file of the repository outside docs/ (`../chapters/04-...md`,
`../roseinfer/cache/paged.py`), as it would read on GitHub: a chapter or notebook
becomes a link to the chapter's page on the site, any other file that exists its path
in the text. A link to a file that does not exist is left alone, for the strict build
to fail on.

The hooks need what `pip install -e ".[docs]"` installs and nothing more: the exercise
list is read from rosecourse/course.py's source, never imported (the course's checks
need its own dependencies and the tokenizer's files).

After the build every link of every page is followed (`broken_links`): a page or an
anchor that is not there is a warning, which the strict build fails on. MkDocs checks
the links of Markdown pages, but not those inside a notebook, nor an anchor on a link
to a notebook's page. A notebook page's table of contents takes its headings' ids
from the rendered page (mkdocs-jupyter's own drop a heading's code, `position_ids`).

A notebook page is also kept offline: nbconvert's template loads MathJax, Mermaid and
the widgets' renderer from CDNs (none of which a chapter needs: no maths, no diagrams,
and the only widgets are progress bars), so those scripts are dropped.
"""

from __future__ import annotations

import ast
import json
import logging
import posixpath
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page
from mkdocs.structure.toc import AnchorLink, TableOfContents

# A warning on a logger under "mkdocs." fails `mkdocs build --strict`.
log = logging.getLogger("mkdocs.plugins.rose_site")

ROOT = Path(__file__).resolve().parent.parent
COURSE = ROOT / "rosecourse" / "course.py"  # the lessons' table, read (see `lessons`)
COURSE_SECTION = "The course"
EXERCISES_MARKER = "<!-- exercises -->"
SCRIPT = re.compile(r"<script\b[^>]*>.*?</script>", re.DOTALL)
HEADING_ID = re.compile(r'<h[1-6]\b[^>]*\bid="([^"]+)"')
ELEMENT_ID = re.compile(r'\bid="([^"]+)"')
HREF = re.compile(r'\bhref="([^"]+)"')
REPOSITORY_LINK = re.compile(r"\[([^\]\n]+)\]\((\.\./[^)\s#]+)(#[^)\s]*)?\)")  # leaves docs/


def offline(script: str) -> str:
    """A script that fetches from elsewhere (a URL, or MathJax's empty src) becomes nothing."""
    return "" if "://" in script or 'src=""' in script else script


def chapter_notebooks() -> list[Path]:
    return sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def notebook_title(path: Path) -> str:
    """The notebook's first heading, as its nav entry: "04 · Position offsets: ..."."""
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        for line in "".join(cell["source"]).splitlines():
            if cell["cell_type"] == "markdown" and line.startswith("# "):
                return line[2:].strip()
    return path.stem.replace("_", " ")


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    for entry in config.nav or []:
        if isinstance(entry, dict) and COURSE_SECTION in entry:
            entry[COURSE_SECTION] += [
                {notebook_title(path): f"notebooks/{path.name}"} for path in chapter_notebooks()
            ]
    return config


@event_priority(100)  # before mkdocs-jupyter looks for .ipynb files to render
def on_files(files: Files, config: MkDocsConfig) -> Files:
    for path in chapter_notebooks():
        # A page of the site at notebooks/NN_*.html, read from the repository's notebooks/.
        files.append(
            File(
                f"notebooks/{path.name}",
                src_dir=str(ROOT),
                dest_dir=config.site_dir,
                use_directory_urls=config.use_directory_urls,
            )
        )
    return files


def lessons(source: Path = COURSE) -> list[tuple[str, str, str]]:
    """(chapter, name, task) of each lesson `rose-course` grades, read from its source.

    Read, not imported: the site's venv (`pip install -e ".[docs]"`) need not hold what
    rose's packages import, and the checks need the course's own dependencies
    (hypothesis, llguidance, ...) and tiktoken's files. The table is the literal
    `LESSONS = [Lesson("02", "concat_kv", "keep the past ..."), ...]`;
    tests/project/test_site_hooks.py holds what is read here to what the module holds.
    """
    tree = ast.parse(source.read_text(encoding="utf-8"), str(source))
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and target.id == "LESSONS":
            break
    else:
        raise ValueError(f"{source}: no LESSONS table for the site's exercise list")
    table = []
    for entry in getattr(node.value, "elts", None) or [node.value]:
        fields = entry.args[:3] if isinstance(entry, ast.Call) else []
        if len(fields) < 3 or not all(
            isinstance(f, ast.Constant) and isinstance(f.value, str) for f in fields
        ):
            raise ValueError(
                f"{source}:{entry.lineno}: the site reads each lesson as "
                'Lesson("NN", "name", "task") with three string literals first'
            )
        table.append(tuple(field.value for field in fields))
    return table


def exercise_table() -> str:
    rows = [
        f"| {chapter} | `ch{chapter}_{name}.py` | {task} |" for chapter, name, task in lessons()
    ]
    return "\n".join(["| chapter | your file | what you write |", "|---|---|---|", *rows])


def chapter_page(path: Path) -> str | None:
    """The site's page of a chapter (chapters/04-*.md or notebooks/04_*.ipynb)."""
    if path.parent.name in ("chapters", "notebooks") and path.name[:2].isdigit():
        for notebook in chapter_notebooks():
            if notebook.name[:2] == path.name[:2]:
                return f"notebooks/{notebook.name}"
    return None


def repository_links(markdown: str, src_uri: str) -> str:
    """Links out of docs/ to the repository's files, made right for the site."""
    page_dir = posixpath.dirname(src_uri)

    def relink(link: re.Match[str]) -> str:
        text, target, anchor = link.group(1), link.group(2), link.group(3) or ""
        path = (ROOT / "docs" / page_dir / target).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            return link.group(0)  # the strict build says what is wrong with it
        chapter = chapter_page(path)
        if chapter:
            return f"[{text}]({posixpath.relpath(chapter, page_dir or '.')}{anchor})"
        where = path.relative_to(ROOT).as_posix()
        return text if where in text else f"{text} (`{where}`)"

    return REPOSITORY_LINK.sub(relink, markdown)


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, **_: Any) -> str:
    if EXERCISES_MARKER in markdown:
        markdown = markdown.replace(EXERCISES_MARKER, exercise_table())
    return repository_links(markdown, page.file.src_uri)


def on_page_content(html: str, page: Page, config: MkDocsConfig, **_: Any) -> str:
    if page.file.src_uri.endswith(".ipynb"):
        html = SCRIPT.sub(lambda match: offline(match.group(0)), html)
        headings = HEADING_ID.findall(html)
        entries = list(toc_entries(page.toc))
        if len(entries) == len(headings):  # the same headings, in the same order
            for entry, heading_id in zip(entries, headings, strict=True):
                entry.id = heading_id
    return html


def toc_entries(toc: TableOfContents | list[AnchorLink]) -> Iterator[AnchorLink]:
    """Every entry of a table of contents, in the order of the page's headings."""
    for entry in toc:
        yield entry
        yield from toc_entries(entry.children)


def broken_links(site: Path) -> list[str]:
    """Each link of the built site (a page, an anchor on one, a file) that leads nowhere,
    as "page: href". 404.html is left out: its links are absolute, for any depth."""
    ids: dict[Path, set[str]] = {}
    broken = []
    for page in sorted(site.rglob("*.html")):
        if page.name == "404.html":
            continue
        for href in HREF.findall(page.read_text(encoding="utf-8", errors="replace")):
            if re.match(r"[a-z][a-z0-9+.-]*:|//", href):  # elsewhere: https:, mailto:
                continue
            path, _, anchor = href.partition("#")
            target = (page.parent / unquote(path)).resolve() if path else page
            if target.is_dir():
                target = target / "index.html"
            if target.is_file() and anchor and target.suffix == ".html":
                if target not in ids:
                    ids[target] = set(ELEMENT_ID.findall(target.read_text(encoding="utf-8")))
                found = unquote(anchor) in ids[target]
            else:
                found = target.is_file()
            if not found:
                broken.append(f"{page.relative_to(site).as_posix()}: {href}")
    return broken


def on_post_build(config: MkDocsConfig) -> None:
    for link in broken_links(Path(config.site_dir)):
        log.warning(f"a link leads nowhere (no such page or anchor): {link}")
