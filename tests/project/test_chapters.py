"""The chapters: every notebook runs in a real kernel, and notebooks never drift from their prose.

chapters/NN-title.md is the source of a chapter, notebooks/NN_title.ipynb is built
from it by chapters/build.py. The notebooks run here as a reader would run them:
a fresh python3 kernel started in notebooks/, on the random chapter model
(ROSE_CHAPTER_MODEL=random) and a short training run (ROSE_CHAPTER_FAST=1). Each
notebook ends in a check cell that asserts its lesson, so a notebook that runs
through is a lesson that still holds.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from rosecourse.demo import RANDOM_MODEL_CONFIG, demo_model, oracle_weakness
from rosetrainer.checkpoint import save_checkpoint
from rosetrainer.config import GPTConfig
from rosetrainer.model import GPT

if TYPE_CHECKING:  # nbformat and jupyter_client are imported by the tests that use them
    import nbformat

REPO_ROOT = Path(__file__).resolve().parents[2]


def load_build_module():
    """chapters/build.py is a script, not part of a package: load it from its file."""
    spec = importlib.util.spec_from_file_location(
        "chapters_build", REPO_ROOT / "chapters" / "build.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = load_build_module()
CHAPTERS = build.chapter_files()
NOTEBOOKS = build.notebook_files()


def names(paths: list[Path]) -> list[str]:
    return [path.name for path in paths]


# -- which chapters exist --------------------------------------------------------------


def test_every_chapter_has_a_notebook_and_numbering_has_no_gap() -> None:
    problems = build.pairing_problems(names(CHAPTERS), names(NOTEBOOKS))
    assert not problems, "\n".join(problems)
    assert len(CHAPTERS) >= 6, names(CHAPTERS)


GOOD_LISTING = (
    ["00-train-a-tiny-gpt.md", "01-greedy-uncached.md", "02-past-kv.md"],
    ["00_train_a_tiny_gpt.ipynb", "01_greedy_uncached.ipynb", "02_past_kv.ipynb"],
)


@pytest.mark.parametrize(
    ("chapters", "notebooks", "complaint"),
    [
        (GOOD_LISTING[0], GOOD_LISTING[1][:2], "02-past-kv.md has no notebook"),
        (GOOD_LISTING[0][:2], GOOD_LISTING[1], "02_past_kv.ipynb has no chapter"),
        (
            [GOOD_LISTING[0][0], GOOD_LISTING[0][2]],
            [GOOD_LISTING[1][0], GOOD_LISTING[1][2]],
            "chapter 01 is missing",
        ),
        (GOOD_LISTING[0][1:], GOOD_LISTING[1][1:], "chapter 00 is missing"),
        (
            [*GOOD_LISTING[0], "02-another.md"],
            [*GOOD_LISTING[1], "02_another.ipynb"],
            "chapter number 02 is used more than once",
        ),
        ([*GOOD_LISTING[0], "03-Bad_Name.md"], GOOD_LISTING[1], "03-Bad_Name.md: not a chapter"),
        (GOOD_LISTING[0], [*GOOD_LISTING[1], "untitled.ipynb"], "untitled.ipynb: not a notebook"),
    ],
)
def test_pairing_check_finds_what_is_wrong(
    chapters: list[str], notebooks: list[str], complaint: str
) -> None:
    assert build.pairing_problems(*GOOD_LISTING) == []
    problems = build.pairing_problems(chapters, notebooks)
    assert any(complaint in problem for problem in problems), problems


def test_index_links_every_chapter_and_its_notebook() -> None:
    index = (REPO_ROOT / "chapters" / "README.md").read_text(encoding="utf-8")
    for chapter in CHAPTERS:
        assert f"]({chapter.name})" in index, f"chapters/README.md does not link {chapter.name}"
        notebook = build.notebook_name(chapter.name)
        assert f"](../notebooks/{notebook})" in index, (
            f"chapters/README.md does not link {notebook}"
        )


# -- notebooks are built from their chapters, and fit to commit ----------------------------


def cells(notebook: nbformat.NotebookNode) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in notebook.cells]


@pytest.mark.parametrize("chapter", CHAPTERS, ids=names(CHAPTERS))
def test_notebook_has_exactly_its_chapters_cells(chapter: Path) -> None:
    import nbformat

    notebook_path = build.NOTEBOOKS_DIR / build.notebook_name(chapter.name)
    expected = cells(build.read_chapter(chapter))
    committed = cells(nbformat.read(notebook_path, as_version=4))
    assert [source for kind, source in expected if kind == "code"], "a chapter without code"
    assert committed == expected, (
        f"{notebook_path.name} differs from {chapter.name}: run python chapters/build.py "
        f"{chapter.name[:2]}"
    )


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=names(NOTEBOOKS))
def test_committed_notebook_is_small_and_holds_no_machine_paths(notebook: Path) -> None:
    assert build.output_problems(notebook) == []


def test_output_check_finds_machine_paths_and_bulk(tmp_path: Path) -> None:
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell("print(1)")]
    clean = tmp_path / "clean.ipynb"
    nbformat.write(notebook, clean)
    assert build.output_problems(clean) == []

    notebook.cells[0].outputs = [nbformat.v4.new_output("stream", text="/home/me/rose/x.pt\n")]
    with_path = tmp_path / "with_path.ipynb"
    nbformat.write(notebook, with_path)
    assert any("/home/" in problem for problem in build.output_problems(with_path))

    notebook.cells[0].outputs = [nbformat.v4.new_output("stream", text="x" * 250_000)]
    bulky = tmp_path / "bulky.ipynb"
    nbformat.write(notebook, bulky)
    assert any("bytes" in problem for problem in build.output_problems(bulky))


# -- which model the chapters run on ---------------------------------------------------


def test_random_chapter_model_makes_a_strong_oracle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROSE_CHAPTER_MODEL", "random")
    model, tokenizer, about = demo_model()
    assert about.startswith("random seeded model")
    assert oracle_weakness(model, tokenizer) is None


def test_a_young_checkpoint_is_passed_over_unless_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GPT's own init (std 0.02): near-uniform logits, so greedy decoding repeats itself.
    torch.manual_seed(0)
    config = GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=32)
    path = tmp_path / "checkpoints" / "young" / "last.pt"
    save_checkpoint(path, {"model": GPT(config).state_dict(), "model_config": config.to_dict()})
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")  # where a notebook's kernel starts
    monkeypatch.delenv("ROSE_CHAPTER_MODEL", raising=False)

    model, _, about = demo_model()
    assert model.config == RANDOM_MODEL_CONFIG
    assert "checkpoints/young/last.pt was passed over: its greedy text repeats itself" in about

    monkeypatch.setenv("ROSE_CHAPTER_MODEL", str(path))
    model, _, about = demo_model()
    assert model.config == config
    assert about == "trained checkpoint checkpoints/young/last.pt (step ?)"


# -- every notebook runs ---------------------------------------------------------------


def test_python3_kernel_runs_this_interpreter() -> None:
    """nbclient starts the "python3" kernelspec; it must be this environment's Python, where
    rose is installed. ipykernel ships that spec in sys.prefix, with argv[0] "python",
    which jupyter_client replaces by sys.executable."""
    from jupyter_client import KernelManager

    command = KernelManager(kernel_name="python3").format_kernel_cmd()
    assert Path(command[0]).resolve() == Path(sys.executable).resolve(), (
        f"the python3 kernel runs {command[0]}, not {sys.executable}: a user-level kernelspec "
        f"shadows this environment's; remove it or run python -m ipykernel install --user"
    )


@pytest.mark.slow
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=names(NOTEBOOKS))
def test_notebook_runs_top_to_bottom(
    notebook: Path, monkeypatch: pytest.MonkeyPatch, record_property
) -> None:
    import nbformat

    monkeypatch.setenv("ROSE_CHAPTER_MODEL", "random")
    monkeypatch.setenv("ROSE_CHAPTER_FAST", "1")
    started = time.perf_counter()
    executed = build.execute(nbformat.read(notebook, as_version=4))  # raises at a failing cell
    elapsed = time.perf_counter() - started
    record_property("execution_s", round(elapsed, 1))
    print(f"{notebook.name}: executed in {elapsed:.1f} s")
    code_cells = [cell for cell in executed.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code_cells)
