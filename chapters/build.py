"""Build the notebooks from the chapters: chapters/NN-title.md -> notebooks/NN_title.ipynb.

    python chapters/build.py           # every chapter
    python chapters/build.py 02 03     # only these

Each chapter is one jupytext markdown file, the single source of its prose and
code. Building reads it with jupytext, executes it top to bottom in a fresh
python3 kernel (nbclient), keeps only the last state of progress bars, and writes
the notebook. Never edit a notebook by hand: edit the chapter and build again
(tests/project/test_chapters.py fails when the two differ).

Kernels start in notebooks/, the folder Jupyter starts a notebook's kernel in, so
a notebook behaves the same built here, run by the tests, or opened by a reader.

The environment decides the model (ROSE_CHAPTER_MODEL, see rosecourse/demo.py) and
how long chapter 00 trains (ROSE_CHAPTER_FAST=1: ten steps). Build the committed
notebooks without ROSE_CHAPTER_FAST: its run writes to a temporary folder, whose
path would show in the outputs, and the build refuses notebooks with machine paths.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

# jupytext, nbformat and nbclient are imported where they are used: the tests list the
# chapters through this module, and importing those (nbformat's JSON-schema checks build
# a grammar at import) would cost every test run seconds.
if TYPE_CHECKING:
    import nbformat

CHAPTERS_DIR = Path(__file__).resolve().parent
REPO_ROOT = CHAPTERS_DIR.parent
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"

CHAPTER_NAME = re.compile(r"(?P<number>\d\d)-(?P<title>[a-z0-9]+(?:-[a-z0-9]+)*)\.md")
NOTEBOOK_NAME = re.compile(r"(?P<number>\d\d)_(?P<title>[a-z0-9]+(?:_[a-z0-9]+)*)\.ipynb")
KERNEL = "python3"
CELL_TIMEOUT_S = 120  # what the tests allow a cell
BUILD_CELL_TIMEOUT_S = 900  # a full build trains chapter 00 for real: minutes on a busy CPU
MAX_NOTEBOOK_BYTES = 200_000
# Paths that only exist on one machine; a committed notebook must show none of them.
MACHINE_PATHS = ("/work/", "/root/", "/home/", "/Users/", "/tmp/")


def notebook_name(chapter_name: str) -> str:
    """'03-sliced-causal-mask.md' -> '03_sliced_causal_mask.ipynb'."""
    match = CHAPTER_NAME.fullmatch(chapter_name)
    if match is None:
        raise ValueError(f"{chapter_name} is not a chapter name like 01-greedy-uncached.md")
    return f"{match['number']}_{match['title'].replace('-', '_')}.ipynb"


def chapter_files() -> list[Path]:
    return sorted(CHAPTERS_DIR.glob("[0-9][0-9]-*.md"))


def notebook_files() -> list[Path]:
    return sorted(NOTEBOOKS_DIR.glob("*.ipynb"))


def pairing_problems(chapter_names: Iterable[str], notebook_names: Iterable[str]) -> list[str]:
    """What is wrong with a listing of chapters and notebooks; empty when all is well.

    Each name must have its numbered form, each chapter its notebook and each
    notebook its chapter, one chapter per number, and the numbers run 00, 01, ...
    with no gap.
    """
    chapter_names, notebook_names = sorted(chapter_names), sorted(notebook_names)
    problems = [
        f"{name}: not a chapter name (NN-title-in-kebab-case.md)"
        for name in chapter_names
        if not CHAPTER_NAME.fullmatch(name)
    ]
    problems += [
        f"{name}: not a notebook name (NN_title_in_snake_case.ipynb)"
        for name in notebook_names
        if not NOTEBOOK_NAME.fullmatch(name)
    ]
    chapters = [name for name in chapter_names if CHAPTER_NAME.fullmatch(name)]
    expected_notebooks = {notebook_name(name) for name in chapters}
    problems += [
        f"{name} has no notebook {notebook_name(name)} (python chapters/build.py)"
        for name in chapters
        if notebook_name(name) not in notebook_names
    ]
    problems += [
        f"{name} has no chapter: notebooks are built from chapters/NN-title.md"
        for name in notebook_names
        if NOTEBOOK_NAME.fullmatch(name) and name not in expected_notebooks
    ]
    numbers = [int(name[:2]) for name in chapters]
    problems += [
        f"chapter number {n:02d} is used more than once"
        for n in sorted(set(numbers))
        if numbers.count(n) > 1
    ]
    problems += [
        f"chapter {n:02d} is missing: numbering runs from 00 with no gap"
        for n in range(max(numbers, default=-1) + 1)
        if n not in numbers
    ]
    return problems


def read_chapter(path: Path) -> nbformat.NotebookNode:
    import jupytext

    return jupytext.read(path, fmt="md")


def execute(
    notebook: nbformat.NotebookNode, cell_timeout_s: int = CELL_TIMEOUT_S
) -> nbformat.NotebookNode:
    """Run every cell in a fresh kernel started in notebooks/; raise at the first failing cell."""
    from nbclient import NotebookClient

    client = NotebookClient(
        notebook,
        kernel_name=KERNEL,
        timeout=cell_timeout_s,
        record_timing=False,  # timestamps would change the file at every build
        coalesce_streams=True,  # one stdout and one stderr per cell; progress bars at their end
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
    )
    return client.execute()


def output_problems(notebook_path: Path) -> list[str]:
    """Why a built notebook should not be committed: too big, or machine paths in it."""
    text = notebook_path.read_text(encoding="utf-8")
    problems = []
    if len(text.encode()) > MAX_NOTEBOOK_BYTES:
        problems.append(
            f"{notebook_path.name} is {len(text.encode()):,} bytes (limit {MAX_NOTEBOOK_BYTES:,}): "
            f"make its figures smaller or print less"
        )
    problems += [
        f"{notebook_path.name} contains the machine path {path!r}"
        for path in MACHINE_PATHS
        if path in text
    ]
    return problems


def build(chapter: Path) -> Path:
    """Chapter -> executed, tidied notebook in notebooks/; returns the notebook's path."""
    import nbformat

    notebook = execute(read_chapter(chapter), BUILD_CELL_TIMEOUT_S)
    path = NOTEBOOKS_DIR / notebook_name(chapter.name)
    nbformat.write(notebook, path)
    problems = output_problems(path)
    if problems:
        raise SystemExit("\n".join(problems))
    return path


def main(numbers: list[str]) -> None:
    # Offline machines keep tiktoken's BPE files next to the repository.
    shared_cache = REPO_ROOT.parent / "shared" / "tiktoken_cache"
    if "TIKTOKEN_CACHE_DIR" not in os.environ and shared_cache.is_dir():
        os.environ["TIKTOKEN_CACHE_DIR"] = str(shared_cache)
    chapters = [c for c in chapter_files() if not numbers or c.name[:2] in numbers]
    if not chapters:
        raise SystemExit(f"no chapter numbered {', '.join(numbers)} in {CHAPTERS_DIR}")
    for chapter in chapters:
        started = time.perf_counter()
        path = build(chapter)
        elapsed = time.perf_counter() - started
        print(f"{chapter.name} -> {path.relative_to(REPO_ROOT)} ({elapsed:.1f} s)")
    problems = pairing_problems(
        [p.name for p in chapter_files()], [p.name for p in notebook_files()]
    )
    if problems:
        raise SystemExit("\n".join(problems))


if __name__ == "__main__":
    main(sys.argv[1:])
