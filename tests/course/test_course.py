"""The course: an exercise per chapter, graded by `rose-course` against the oracle.

Every lesson's reference solution passes its check; every known wrong answer of the
chapters 00, 01, 10 to 17 and 20 is caught with its own diagnosis (chapters 02 to 09, 18
and 21: tests/course/test_exercises.py); a fresh workspace's stubs each fail with one "not written
yet" line; the reference solutions pass `check all` through the installed console
script; and no line of a reference solution is printed in its chapter.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rosecourse import cli, course
from rosecourse.course import BUILDS, LESSONS, Lesson, lesson, stub_source
from rosecourse.exercises import (
    ch00_causal_attention,
    ch01_greedy_decode,
    ch10_decode_read_bytes,
    ch11_slot_mapping,
    ch12_schedule,
    ch13_cached_prefix,
    ch14_held_back,
    ch15_export_prepare,
    ch16_stage_forward,
    ch17_quantize,
    ch20_choice_mask,
)
from rosecourse.exercises.common import Outcomes, check, difference, same

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_EXERCISES = [
    module.EXERCISE
    for module in (
        ch00_causal_attention,
        ch01_greedy_decode,
        ch10_decode_read_bytes,
        ch11_slot_mapping,
        ch12_schedule,
        ch13_cached_prefix,
        ch14_held_back,
        ch15_export_prepare,
        ch16_stage_forward,
        ch17_quantize,
        ch20_choice_mask,
    )
]
WRONG = [(exercise, wrong) for exercise in NEW_EXERCISES for wrong in exercise.known_wrong]


def test_every_chapter_has_its_exercise_or_build() -> None:
    chapters = sorted(path.name[:2] for path in (REPO_ROOT / "chapters").glob("[0-9][0-9]-*.md"))
    # Chapter 19's exercise is a build (the verify-and-rollback step); every other chapter
    # has one lesson of its own, in order.
    assert [c.chapter for c in LESSONS] == [c for c in chapters if c != "19"]
    assert [b.chapters for b in BUILDS if b.name == "verify"] == ["19"]
    assert lesson("7").name == "padded_position_ids"


def answer(chosen: Lesson) -> object:
    """The function whose code answers a lesson: rose's own piece where the reference
    delegates to it (reference.py's `rose_NAME`), else the reference's."""
    return getattr(chosen.solution_module(), f"rose_{chosen.name}", chosen.solution())


def code_lines(function: object) -> list[str]:
    """The lines of a function's body that are code: no docstring, comment or blank line."""
    source = textwrap.dedent(inspect.getsource(function))  # a method's too
    tree = ast.parse(source).body[0]
    assert isinstance(tree, ast.FunctionDef)
    body = tree.body[1:] if isinstance(tree.body[0], ast.Expr) else tree.body
    source = source.splitlines()
    first = body[0].lineno - 1
    lines = [line.split("#")[0].strip() for line in source[first : body[-1].end_lineno]]
    return [line for line in lines if line]


def test_at_least_half_the_exercises_are_more_than_five_lines() -> None:
    # Chapters 00-17's exercises, the course's promise; chapter 18's (the rolling cache's
    # slot) is a small one for now.
    sizes = {c.chapter: len(code_lines(answer(c))) for c in LESSONS if c.chapter <= "17"}
    assert sum(size > 5 for size in sizes.values()) >= len(sizes) / 2, sizes


# The reference solutions pass: test_console_script_solutions_pass_check_all, once for all.


@pytest.mark.parametrize("chosen", LESSONS, ids=[c.chapter for c in LESSONS])
def test_stub_is_not_written_yet(chosen, tmp_path: Path) -> None:
    namespace: dict[str, object] = {}
    exec(compile(stub_source(chosen), chosen.file_name, "exec"), namespace)  # noqa: S102
    stub = chosen.check(namespace[chosen.name])
    assert not stub.passed
    assert "not written yet" in str(stub) and "\n" not in str(stub), str(stub)
    # What `rose-course check` says of the untouched stub without running it (no torch, no
    # process): the check's words, and what the stub raised.
    (tmp_path / chosen.file_name).write_text(stub_source(chosen), encoding="utf-8")
    (told,) = course.unwritten(chosen.chapter, tmp_path)
    said = "not written yet: replace the stub with your function"
    assert said in stub.explanation and f"NotImplementedError: write {chosen.name}" in str(stub)
    assert told == (f"{chosen.name}: {said} [it raises NotImplementedError: write {chosen.name}]")


def test_a_stub_is_told_by_its_code_whatever_its_comments_and_docstrings(tmp_path: Path) -> None:
    chosen = lesson("13")
    stub = stub_source(chosen)
    path = tmp_path / chosen.file_name

    def told(text: str) -> list[str] | None:
        path.write_text(text, encoding="utf-8")
        return course.unwritten("13", tmp_path)

    assert told(stub) is not None
    noted = stub.replace('"""', '"""My notes: the hash chains. ', 1).replace("\n\n", "\n\n# hm\n")
    assert told("# chapter 13\n\n" + noted + "\n\n") == told(stub)
    written = stub.replace('raise NotImplementedError("write cached_prefix")', "return []")
    assert told(written) is None
    assert told(stub + "\nprint('runs at import')\n") is None  # the check must run it
    assert told(stub + "\n\ndef helper() -> None:\n    pass\n") is None
    assert told("def cached_prefix(manager, token_ids):\n    return (\n") is None
    assert told("\0") is None
    path.unlink()
    assert course.unwritten("13", tmp_path) is None  # missing: the check's line says so
    for build in BUILDS:  # a build's stub with a comment: a line per part
        (tmp_path / build.file_name).write_text("# mine\n" + stub_source(build), encoding="utf-8")
        assert len(course.unwritten(build.name, tmp_path)) == len(build.parts)


# Run in a fresh interpreter: the workspace written, every check asked for, and whether
# torch was ever imported.
STUBS_WITHOUT_TORCH = """
import sys
from rosecourse import cli
workspace = sys.argv[1]
assert cli.main(["start", workspace]) == 0
code = cli.main(["check", "all", "--dir", workspace])
print("exit", code, "torch imported:", "torch" in sys.modules)
"""


def test_untouched_stubs_are_told_before_torch_is_imported(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-c", STUBS_WITHOUT_TORCH, str(tmp_path / "ws")],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[-1] == "exit 1 torch imported: False", run.stdout[-2000:]
    # An untouched stub is no wrong answer: "not written yet", never FAILED.
    assert not any("FAILED" in line for line in lines), run.stdout[-2000:]
    told = [line for line in lines if ": not written yet: replace the stub" in line]
    assert len(told) == len(LESSONS) + sum(len(build.parts) for build in BUILDS)
    every = [*(c.chapter for c in LESSONS), *(build.name for build in BUILDS)]
    assert [line.split()[-1] for line in lines[-len(every) - 2 : -2]] == ["yet"] * len(every)
    assert lines[-2] == f"0/{len(every)} passed; not written yet: {' '.join(every)}"


@pytest.mark.slow
@pytest.mark.parametrize(("exercise", "wrong"), WRONG, ids=[f"{e.name}-{w.name}" for e, w in WRONG])
def test_known_wrong_answer_gets_its_diagnosis(exercise, wrong) -> None:
    result = check(exercise, wrong.fn)
    assert not result.passed
    assert wrong.explanation in result.explanation, str(result)


@pytest.mark.slow  # each check is a process of its own
def test_a_check_that_breaks_on_the_learner_code_is_one_line(tmp_path: Path, capsys) -> None:
    workspace = tmp_path / "ws"
    cli.main(["start", str(workspace), "--solutions"])
    # A function that returns something the check cannot even compare.
    (workspace / lesson("12").file_name).write_text("def schedule(scheduler):\n    return 42\n")
    capsys.readouterr()
    assert cli.main(["check", "12", "--dir", str(workspace)]) == 1
    line, hints = capsys.readouterr().out.splitlines()  # the verdict, then the hints used
    assert line.startswith("schedule: FAILED"), line
    assert hints.startswith("hints used: 0 of 4 (stuck? `rose-course hint 12 --dir "), hints


# Lines any code could hold (a bare return, no_grad, a closing bracket) say nothing.
GENERIC_LINE = r"return \w+(, \w+)?|else:|break|with torch\.(no_grad|inference_mode)\(\):"


def answer_pieces(line: str) -> list[str]:
    """What of a solution's line would give the answer away, spaces removed: the line, and
    the expression it returns or assigns (without `torch.`, as prose writes it)."""
    pieces = [line]
    if line.startswith("return "):
        pieces.append(line.removeprefix("return "))
    elif re.match(r"[\w, \[\]:.]+ = ", line):
        pieces.append(line.split(" = ", 1)[1])
    squeezed = [re.sub(r"\s+", "", piece) for piece in pieces]
    squeezed += [piece.replace("torch.", "") for piece in squeezed]
    # A bare name or attribute (`stage.transformer`) or a short expression is no answer.
    return [piece for piece in squeezed if len(piece) > 16 and not re.fullmatch(r"[\w.]+", piece)]


@pytest.mark.parametrize("chosen", LESSONS, ids=[c.chapter for c in LESSONS])
def test_no_line_of_a_solution_is_in_its_chapter(chosen) -> None:
    (chapter,) = (REPO_ROOT / "chapters").glob(f"{chosen.chapter}-*.md")
    text = re.sub(r"\s+", "", chapter.read_text(encoding="utf-8"))
    shown = [
        line
        for line in code_lines(answer(chosen))
        if not re.fullmatch(GENERIC_LINE, line)
        and any(piece in text for piece in answer_pieces(line))
    ]
    assert not shown, f"{chapter.name} gives the answer away: {shown}"


def test_stub_keeps_signature_and_contract_but_not_the_answer() -> None:
    chosen = lesson("13")
    stub = stub_source(chosen)
    assert "def cached_prefix(manager: BlockManager, token_ids: list[int]) -> list[int]:" in stub
    assert "longest run" in stub  # the contract
    assert "chain_hash(parent, tokens)" not in stub
    assert stub.rstrip().endswith('raise NotImplementedError("write cached_prefix")')


def test_cli_list_start_and_its_mistakes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["list"]) == 0
    listing = capsys.readouterr().out.split("\n\n")[0].splitlines()  # (then the builds)
    assert [line[:2] for line in listing] == [c.chapter for c in LESSONS]

    assert cli.main(["start", str(tmp_path / "ws")]) == 0
    assert f"wrote {len(LESSONS) + len(BUILDS)} stubs" in capsys.readouterr().out
    for chosen in [*LESSONS, *BUILDS]:
        # each stub fails its check: test_stub_is_not_written_yet, tests/course/test_builds.py
        text = (tmp_path / "ws" / chosen.file_name).read_text(encoding="utf-8")
        assert text == stub_source(chosen)

    assert cli.main(["check", "99", "--dir", str(tmp_path)]) == 2
    assert "no exercise for chapter '99'" in capsys.readouterr().err
    assert cli.main(["check", "02", "--dir", str(tmp_path / "nowhere")]) == 2
    assert "no workspace" in capsys.readouterr().err


@pytest.mark.slow  # each check is a process of its own
def test_cli_check_a_stub_and_a_file_that_does_not_parse(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert cli.main(["start", str(tmp_path / "ws")]) == 0
    capsys.readouterr()
    assert cli.main(["check", "2", "--dir", str(tmp_path / "ws")]) == 1
    line, hints = capsys.readouterr().out.splitlines()
    assert line.startswith("concat_kv: not written yet"), line
    assert hints.startswith("hints used: 0 of 2"), hints

    broken = tmp_path / "ws" / lesson("04").file_name
    broken.write_text("def position_ids(past_len, q_len, device=None):\n    return (\n")
    assert cli.main(["check", "04", "--dir", str(tmp_path / "ws")]) == 1
    line, _ = capsys.readouterr().out.splitlines()
    assert "syntax error" in line


def console_script(name: str) -> list[str]:
    """The command pyproject's [project.scripts] installs as `name`, run as its script
    runs it (in this worktree, whatever copy of rose the environment has installed)."""
    pyproject = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    entry = re.search(rf'^{name} = "([\w.]+):(\w+)"$', pyproject, re.MULTILINE)
    assert entry, f"pyproject.toml's [project.scripts] has no {name}"
    module, function = entry.groups()
    return [
        sys.executable,
        "-c",
        f"import sys; from {module} import {function}; sys.exit({function}())",
    ]


@pytest.mark.slow
def test_console_script_solutions_pass_check_all(tmp_path: Path) -> None:
    command = console_script("rose-course")
    workspace = tmp_path / "solutions"
    started = subprocess.run(
        [*command, "start", str(workspace), "--solutions"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert started.returncode == 0, started.stderr
    checked = subprocess.run(
        [*command, "check", "all", "--dir", str(workspace)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    every = len(LESSONS) + len(BUILDS)  # the chapters' exercises and the builds
    assert f"{every}/{every} passed" in checked.stdout
    assert "Traceback" not in checked.stdout + checked.stderr


def test_outcomes_are_computed_as_they_are_read_and_compared_until_they_differ() -> None:
    made: list[int] = []

    def call(n: int) -> int:
        made.append(n)
        return n

    lazy = Outcomes({f"case {n}": (lambda n=n: call(n)) for n in range(4)})
    assert made == []
    seen = {"case 0": 0, "case 1": 99, "case 2": 2, "case 3": 3}
    assert difference(seen, lazy) == "case 1: it gives 99 where 1 is right"
    assert made == [0, 1]  # the first two cases only: the second already differs
    assert same(dict(lazy), {f"case {n}": n for n in range(4)})
    assert lazy["case 0"] == 0 and made == [0, 1, 2, 3]  # each case once


def end_of_text_always(vocab, choices, prefix, eot_id):
    """A wrong choice mask no known mistake explains: end-of-text is always allowed."""
    wanted = [choice.encode("utf-8") for choice in choices]
    allowed = [any(c.startswith(prefix + token) for c in wanted) for token in vocab]
    allowed[eot_id] = True
    return torch.tensor(allowed, dtype=torch.bool)


@pytest.mark.slow
def test_a_wrong_choice_mask_is_told_from_the_known_ones_at_the_first_case_they_differ() -> None:
    """Chapter 20's check of an unknown wrong answer ran every known wrong answer's masks
    over GPT-2's 50,257 tokens in all 13 cases (6.6 s of CPU for the check); each now runs
    until its masks differ from the learner's, the small vocabularies' cases first (here
    no mask over GPT-2's tokens is made), and the verdict is the whole probes' one."""
    exercise = ch20_choice_mask.EXERCISE
    on_gpt2: list[str] = []

    def counting(wrong):  # a known wrong answer that counts its masks over GPT-2's tokens
        def fn(vocab, choices, prefix, eot_id):
            if len(vocab) > 1000:
                on_gpt2.append(wrong.name)
            return wrong.fn(vocab, choices, prefix, eot_id)

        return dataclasses.replace(wrong, fn=fn)

    def variant(**changes: object):
        known = [counting(wrong) for wrong in exercise.known_wrong]  # (each probed afresh)
        return dataclasses.replace(exercise, known_wrong=known, **changes)

    told = check(variant(), end_of_text_always)
    assert not told.passed and "different set of tokens" in told.explanation, str(told)
    assert on_gpt2 == []
    on_gpt2.clear()
    whole = check(variant(probe=lambda fn: dict(exercise.probe(fn))), end_of_text_always)
    assert len(on_gpt2) == 13 * len(exercise.known_wrong)  # every case of every one
    assert str(whole) == str(told)
