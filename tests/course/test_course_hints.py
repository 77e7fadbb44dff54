"""Hints the learner asks for: the stub states the contract, `rose-course hint` the how.

Every exercise and build keeps its hints in its reference solution (`HINTS` in its
folder's reference.py), in the order they are given: the idea first, the near-code last.
The stub leaves them out, and gives away no line of the solution's code; `rose-course hint
NAME` prints the next one each time (noted in the workspace, whose files it never
touches), says when none is left and shows the ones given again with --seen; `check` says
how many were used, and `check all`'s table too. None of it loads torch.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rosecourse import cli, course
from rosecourse.course import (
    HINT_RECORD,
    about,
    check_names,
    file_name,
    hints,
    solution_source,
    stub_source,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
NAMES = check_names()


@pytest.mark.parametrize("name", NAMES)
def test_every_exercise_and_build_has_its_hints_and_the_stub_leaves_them_out(name: str) -> None:
    given = hints(name)
    assert len(given) >= 2 and all(isinstance(h, str) and len(h) > 40 for h in given), given
    assert len(set(given)) == len(given)
    stub = stub_source(file_name(name))
    assert "HINTS" not in stub and "rose-course hint" not in stub
    assert not any(hint[:60] in stub for hint in given)
    ast.parse(stub)  # still a module, every function's contract kept (tests/course/test_course.py)


@pytest.mark.parametrize(
    "name", ["model", "training_step", "cached_loop", "block_manager", "verify"]
)
def test_a_builds_last_hint_is_near_code(name: str) -> None:
    first, *_, last = hints(name)
    assert "\n    " in last and "\n    " not in first  # the idea first, code lines last


def code_of_bodies(source: str) -> list[str]:
    """Every line of code in the bodies of a module's functions and methods, spaces removed
    (no docstring, comment or blank line)."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef):
            body = node.body[1:] if isinstance(node.body[0], ast.Expr) else node.body
            for line in lines[body[0].lineno - 1 : body[-1].end_lineno]:
                code = re.sub(r"\s+", "", line.split("#")[0])
                if code:
                    found.append(code)
    return found


@pytest.mark.parametrize("name", NAMES)
def test_the_stub_gives_away_no_line_of_the_solution(name: str) -> None:
    """The contract says what, never how: no line of the solution's code (but the short and
    generic ones: `returnk,v`, `else:`) is in the stub's text."""
    stub = re.sub(r"\s+", "", stub_source(file_name(name)))
    given = [line for line in code_of_bodies(solution_source(file_name(name))) if len(line) > 24]
    assert not [line for line in given if line in stub]


def test_hint_gives_the_next_one_each_time_and_notes_it_in_the_workspace(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    workspace = tmp_path / "ws"
    assert cli.main(["start", str(workspace)]) == 0
    assert "rose-course hint NN" in capsys.readouterr().out  # start says how to ask
    mine = workspace / "build_model.py"
    mine.write_text("# my model, half written\n", encoding="utf-8")
    total = len(hints("model"))
    for number in range(1, total + 1):
        assert cli.main(["hint", "model", "--dir", str(workspace)]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"hint {number} of {total} for model:\n"), out
        assert hints("model")[number - 1].split()[1] in out  # its own text, wrapped
        record = json.loads((workspace / HINT_RECORD).read_text())
        assert record == {"model": number}
    assert cli.main(["hint", "model", "--dir", str(workspace)]) == 0
    assert capsys.readouterr().out.startswith(f"no more hints for model: all {total} given")
    assert cli.main(["hint", "model", "--dir", str(workspace), "--seen"]) == 0
    seen = capsys.readouterr().out
    assert [f"hint {n} of {total} for model:" in seen for n in range(1, total + 1)] == [
        True
    ] * total
    assert mine.read_text(encoding="utf-8") == "# my model, half written\n"  # never touched

    # A chapter by its number, in any spelling; its count is its own.
    assert cli.main(["hint", "2", "--dir", str(workspace)]) == 0
    assert capsys.readouterr().out.startswith("hint 1 of 2 for 02:")
    assert json.loads((workspace / HINT_RECORD).read_text()) == {"model": total, "02": 1}
    assert cli.main(["hint", "13", "--dir", str(workspace), "--seen"]) == 0
    assert capsys.readouterr().out.startswith("no hints given for 13 yet")


def test_hints_asked_at_once_are_each_counted(tmp_path: Path) -> None:
    """Eight `rose-course hint` processes at once in one workspace: each gets its own
    hint, and the record counts all eight (read, count and write are one step at a time)."""
    workspace = tmp_path / "ws"
    assert cli.main(["start", str(workspace)]) == 0
    calls = [
        subprocess.Popen(
            [sys.executable, "-m", "rosecourse.cli", "hint", "model", "--dir", str(workspace)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    said = sorted(call.communicate(timeout=120)[0].split(":")[0] for call in calls)
    assert said == [f"hint {n} of 8 for model" for n in range(1, 9)]
    assert json.loads((workspace / HINT_RECORD).read_text()) == {"model": 8}


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["hint", "nope"], "no build or chapter called 'nope': choose a build ("),
        (["hint", "99"], "no exercise for chapter '99': choose one of 00,"),
        (["hint", "all"], "hint takes one exercise: a chapter's number or a build's name"),
        (["hint", "model", "--dir", "{missing}"], "no build_model.py in "),
        # an existing folder that is no workspace gets no record written into it
        (["hint", "model", "--dir", "{empty}"], "no build_model.py in "),
    ],
)
def test_a_bad_hint_request_is_one_line_and_exit_2(
    args: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    args = [arg.replace("{missing}", str(tmp_path / "nowhere")) for arg in args]
    args = [arg.replace("{empty}", str(tmp_path)) for arg in args]
    assert cli.main(args) == 2
    assert not (tmp_path / HINT_RECORD).exists()
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith(f"rose-course: error: {said}"), line
    assert "or all" not in line  # (`check` offers all; `hint` takes one)


def test_a_damaged_record_starts_the_count_again(tmp_path: Path, capsys) -> None:
    (tmp_path / course.file_name("12")).write_text("# my schedule\n", encoding="utf-8")
    (tmp_path / HINT_RECORD).write_text("{not json", encoding="utf-8")
    assert course.hints_used("12", tmp_path) == (0, len(hints("12")))
    assert cli.main(["hint", "12", "--dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("hint 1 of")
    assert course.hints_used("12", tmp_path) == (1, len(hints("12")))


# In a fresh interpreter: two hints, a check of a stub, check all; whether torch was loaded.
HINTS_AND_CHECKS = """
import sys
from rosecourse import cli
workspace = sys.argv[1]
cli.main(["start", workspace])
for _ in range(2):
    cli.main(["hint", "05", "--dir", workspace])
cli.main(["check", "05", "--dir", workspace])
cli.main(["check", "all", "--dir", workspace])
print("torch imported:", "torch" in sys.modules)
"""


def test_check_reports_the_hints_used_and_check_all_has_a_column(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-c", HINTS_AND_CHECKS, str(tmp_path / "ws")],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[-1] == "torch imported: False"
    total = len(hints("05"))
    stuck = f" (stuck? `rose-course hint 05 --dir {tmp_path / 'ws'}` gives the next)"
    assert f"hints used: 2 of {total}" + (stuck if total > 2 else "") in lines
    header = lines.index(next(line for line in lines if line.split()[:2] == ["check", "file"]))
    assert lines[header].split() == ["check", "file", "hints", "verdict"]
    table = {row.split()[0]: row.split() for row in lines[header + 1 : -2]}
    assert table["05"][2] == f"2/{total}" and table["model"][2] == f"0/{len(hints('model'))}"


def test_a_pipe_in_place_of_the_record_is_replaced_not_read(tmp_path: Path, capsys) -> None:
    """Reading a FIFO would wait for a writer forever: the count starts again instead."""
    (tmp_path / course.file_name("12")).write_text("# my schedule\n", encoding="utf-8")
    os.mkfifo(tmp_path / HINT_RECORD)
    assert course.hints_used("12", tmp_path) == (0, len(hints("12")))
    assert cli.main(["hint", "12", "--dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("hint 1 of")
    assert (tmp_path / HINT_RECORD).is_file()


@pytest.mark.slow
def test_a_builds_hints_follow_its_failing_part(tmp_path: Path, capsys) -> None:
    """A build's check notes the part it failed first; `hint` then gives that part's
    hints first (those naming the class the part grades), then the rest in order, and
    `--seen` shows them all."""
    workspace = tmp_path / "ws"
    assert cli.main(["start", str(workspace)]) == 0
    # The stub and one more line: no longer the untouched stub, so its check runs, and
    # its first part (weights: GPT.__init__) is the first that fails.
    (workspace / "build_model.py").write_text(stub_source("build_model.py") + "\nx = 1\n")
    assert cli.main(["check", "model", "--dir", str(workspace)]) == 1
    record = json.loads((workspace / HINT_RECORD).read_text())
    assert record == {"failing": {"model": "weights"}}
    capsys.readouterr()
    firsts = about("model", "weights")
    texts = hints("model")
    assert firsts and firsts[0] > 0 and all("GPT." in texts[i] for i in firsts)
    for index in firsts:
        assert cli.main(["hint", "model", "--dir", str(workspace)]) == 0
        out = capsys.readouterr().out
        assert out.startswith(
            f"hint {index + 1} of {len(texts)} for model (about model/weights, which failed):"
        ), out
    assert cli.main(["hint", "model", "--dir", str(workspace)]) == 0
    first_other = min(set(range(len(texts))) - set(firsts))
    assert capsys.readouterr().out.startswith(f"hint {first_other + 1} of {len(texts)} for model:")
    given = sorted([*firsts, first_other])
    record = json.loads((workspace / HINT_RECORD).read_text())
    assert record["model"] == (len(given) if given == list(range(len(given))) else given)
    assert cli.main(["hint", "model", "--dir", str(workspace), "--seen"]) == 0
    seen = capsys.readouterr().out
    assert [line.split(" of ")[0] for line in seen.splitlines() if line.startswith("hint ")] == [
        f"hint {i + 1}" for i in given
    ]
