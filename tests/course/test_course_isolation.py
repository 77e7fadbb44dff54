"""rose-course against a hostile learner and a careless operator (issue 33).

Each check runs in a process of its own (rosecourse/runner.py): a learner's code that
exits, loops, floods the output, leaves a process running or leaves torch's global
defaults changed is one FAILED line, never a pass and never a traceback, and no
chapter's code reaches another's check; `check all` always ends with its table. `start`
writes stubs atomically and never overwrites a learner's work. Every mistake is one
`rose-course: error:` line and exit code 2; Ctrl-C is one line and exit code 130.

The hostile cases run the real command line in a subprocess on a workspace of reference
solutions, each on chapter 10 (its check is the quickest) with its solution wrapped so
that its function does the hostile thing before answering, or its module on import.
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from rosecourse import cli, course
from rosecourse.course import BUILDS, LESSONS, hints, key, lesson, stub_source
from rosecourse.exercises.answers import ALTERNATIVES, load
from rosecourse.runner import OUTPUT_LIMIT

REPO_ROOT = Path(__file__).resolve().parents[2]
ERROR = "rose-course: error: "


def rose_course(*args: str) -> subprocess.CompletedProcess:
    """The command line as a learner runs it, in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "rosecourse.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
    )


def without_hints(output: str) -> list[str]:
    """A single check's lines up to its verdict: the last line says how many hints were used."""
    *lines, hints = output.splitlines()
    assert hints.startswith("hints used: "), output[-2000:]
    return lines


def solution_file(
    workspace: Path, chapter: str, in_function: str = "", at_import: str = ""
) -> Path:
    """Chapter `chapter`'s reference solution in `workspace`, its function wrapped to run
    `in_function` before answering, and `at_import` at the end of its module."""
    chosen = lesson(chapter)
    wrapper = [
        "",
        "import os, sys",
        "",
        "import torch",
        "",
        f"_answer = {chosen.name}",
        "",
        "",
        f"def {chosen.name}(*args, **kwargs):",
        textwrap.indent(in_function or "pass", "    "),
        "    return _answer(*args, **kwargs)",
        "",
        "",
        at_import,
    ]
    workspace.mkdir(parents=True, exist_ok=True)
    path = workspace / chosen.file_name
    path.write_text(inspect.getsource(chosen.solution_module()) + "\n".join(wrapper) + "\n")
    return path


EVIL = """
class Evil:
    def __eq__(self, other):
        raise SystemExit(0)

    def __bool__(self):
        raise SystemExit(0)
"""

# name: (in the function, at import, what the FAILED line says, --timeout)
HOSTILE = {
    "sys.exit in the function": ("sys.exit(0)", "", "raised SystemExit(0)", None),
    "sys.exit on import": ("", "sys.exit(0)", "raised SystemExit(0)", None),
    "os._exit": ("os._exit(0)", "", "exited with code 0 before its verdict", None),
    # The grader never holds the learner's objects: an Evil arrives as its class's name.
    "an answer whose == exits": ("return Evil()", EVIL, "it gives a Evil object where", None),
    "a loop in the function": ("while True:\n    pass", "", "did not finish in 3 s", "3"),
    "a loop on import": ("", "while True:\n    pass", "did not finish in 3 s", "3"),
    "the default dtype": (
        "torch.set_default_dtype(torch.float64)",
        "",
        "changed torch's default dtype from torch.float32 to torch.float64",
        None,
    ),
    "the number of threads": (
        "",
        "torch.set_num_threads(7)",
        "changed torch's number of threads from",
        None,
    ),
    "megabytes of output": (
        "print('x' * 4_000_000)",
        "",
        f"printed too much (output cut at {OUTPUT_LIMIT} characters)",
        None,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", HOSTILE, ids=list(HOSTILE))
def test_hostile_code_is_one_failed_line(case: str, tmp_path: Path) -> None:
    in_function, at_import, said, timeout = HOSTILE[case]
    course.write_workspace(tmp_path, solutions=True)
    solution_file(tmp_path, "10", in_function, at_import)
    flags = ["--timeout", timeout] if timeout else []
    checked = rose_course("check", "10", "--dir", str(tmp_path), *flags)
    assert checked.returncode == 1, checked
    assert "Traceback" not in checked.stdout + checked.stderr, checked
    lines = without_hints(checked.stdout)
    verdicts = [line for line in lines if line.startswith("decode_read_bytes:")]
    assert verdicts == [lines[-1]], lines[-3:]  # one verdict, the last line
    assert verdicts[0].startswith("decode_read_bytes: FAILED") and said in verdicts[0], lines[-1]
    assert len(checked.stdout.encode()) < OUTPUT_LIMIT + 1000  # the flood was cut


@pytest.mark.slow
def test_check_all_grades_every_chapter_in_a_fresh_process_and_ends_with_its_table(
    tmp_path: Path,
) -> None:
    # Chapter 00 leaves float64 the default (before: chapter 15 then failed), 01 exits on
    # import (before: the run ended there, rc 0); 15 is right; the others are missing.
    solution_file(tmp_path, "00", at_import="torch.set_default_dtype(torch.float64)")
    solution_file(tmp_path, "01", at_import="sys.exit(0)")
    solution_file(tmp_path, "15")
    checked = rose_course("check", "all", "--dir", str(tmp_path))
    assert checked.returncode == 1, checked
    assert "Traceback" not in checked.stdout + checked.stderr
    lines = checked.stdout.splitlines()
    assert any(
        line.startswith("causal_attention: FAILED") and "default dtype" in line for line in lines
    )
    assert any(
        line.startswith("greedy_decode: FAILED") and "SystemExit(0)" in line for line in lines
    )
    assert any(line.startswith("export_prepare: passed") for line in lines), lines
    graded = [*LESSONS, *BUILDS]  # the builds' files are missing too
    table = lines[-len(graded) - 2 :]
    assert table[0].split() == ["check", "file", "hints", "verdict"]
    rows = [row.split() for row in table[1:-1]]
    expected = [
        [key(c), c.file_name, f"0/{len(hints(key(c)))}", "passed" if key(c) == "15" else "FAILED"]
        for c in graded
    ]
    assert rows == expected
    failing = " ".join(key(c) for c in graded if key(c) != "15")
    assert table[-1] == f"1/{len(graded)} passed; failing: {failing}"


@pytest.mark.slow
def test_ctrl_c_stops_the_check_and_its_process(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    loop = f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\nwhile True:\n    pass"
    solution_file(tmp_path / "ws", "10", at_import=loop)
    command = [sys.executable, "-m", "rosecourse.cli", "check", "10", "--dir", str(tmp_path / "ws")]
    grader = subprocess.Popen(
        command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text()):  # the learner's loop runs
            assert grader.poll() is None and time.monotonic() < deadline, grader.poll()
            time.sleep(0.05)
        grader.send_signal(signal.SIGINT)
        out, err = grader.communicate(timeout=60)
    finally:
        grader.kill()
    assert grader.returncode == 130
    assert err.decode() == "rose-course: interrupted: stopped by Ctrl-C\n"
    with pytest.raises(ProcessLookupError):  # the check's process was killed and reaped
        os.kill(int(pid_file.read_text()), 0)


# ---------------------------------------------------------------------------
# Mistakes: one line, exit code 2
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("chapter", ["", "x"])
def test_a_chapter_that_is_not_one_is_one_line(
    chapter: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert cli.main(["check", chapter, "--dir", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    builds = ", ".join(b.name for b in BUILDS)
    assert captured.err == (
        f"{ERROR}no build or chapter called {chapter!r}: choose a build ({builds}), a "
        "chapter's number (as `rose-course list` shows), or all\n"
    )


def one_error_line(capsys: pytest.CaptureFixture) -> str:
    captured = capsys.readouterr()
    assert captured.err.startswith(ERROR) and captured.err.count("\n") == 1, captured.err
    return captured.err


@pytest.mark.parametrize(
    ("where", "said"),
    [
        ("a file", "is a file, not a directory"),
        ("under a file", "a part of the path is a file"),
        ("/proc", "cannot write to /proc"),  # a folder that takes no files, even from root
        ("/sys/rose-course", "cannot write to /sys/rose-course"),
    ],
)
def test_start_where_no_workspace_can_be_is_one_line(
    where: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "a file").write_text("notes\n")
    path = {"a file": tmp_path / "a file", "under a file": tmp_path / "a file" / "ws"}.get(
        where, Path(where)
    )
    assert cli.main(["start", str(path)]) == 2
    assert said in one_error_line(capsys)
    assert (tmp_path / "a file").read_text() == "notes\n"


@pytest.mark.parametrize(
    ("failing", "code", "said"),
    [
        ("fsync", errno.ENOSPC, "no space left on the device"),  # the disk filled mid-write
        ("mkstemp", errno.EROFS, "the file system is read-only"),
    ],
)
def test_start_on_a_full_or_read_only_disk_leaves_no_half_stub(
    failing: str,
    code: int,
    said: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    workspace = tmp_path / "ws"
    mine = workspace / lesson("03").file_name
    mine.parent.mkdir()
    mine.write_text("my work\n")
    refused = OSError(code, os.strerror(code))

    def fail(*args: object, **kwargs: object) -> None:
        raise refused

    target = {"fsync": (os, "fsync"), "mkstemp": (tempfile, "mkstemp")}[failing]
    with monkeypatch.context() as patch:
        patch.setattr(*target, fail)
        assert cli.main(["start", str(workspace)]) == 2
    line = one_error_line(capsys)
    assert f"cannot write {workspace / lesson('00').file_name}: {said}" in line
    assert sorted(p.name for p in workspace.iterdir()) == [mine.name]  # no stub, no temp file
    # Space again: every stub written whole, the learner's file kept.
    assert cli.main(["start", str(workspace)]) == 0
    assert f"kept your work: {mine.name}\n" in capsys.readouterr().out
    assert mine.read_text() == "my work\n"
    for chosen in LESSONS:
        if chosen.chapter != "03":
            assert (workspace / chosen.file_name).read_text() == stub_source(chosen)
    # Full again: a workspace with every file there needs no space.
    with monkeypatch.context() as patch:
        patch.setattr(*target, fail)
        assert cli.main(["start", str(workspace)]) == 0
    assert (
        f"wrote 0 stubs in {workspace}, {len(LESSONS) + len(BUILDS) - 1} there already\n"
        in capsys.readouterr().out
    )


def test_a_later_start_replaces_only_files_that_hold_no_work(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    workspace = tmp_path / "ws"
    with monkeypatch.context() as patch:  # the stubs of an earlier rose: other text
        patch.setattr(course, "stub_source", lambda chosen: f"# {chosen}, an old stub\n")
        assert cli.main(["start", str(workspace)]) == 0
    files = {chosen.chapter: workspace / chosen.file_name for chosen in LESSONS}
    files["02"].write_text("def concat_kv(layer_past, k, v):\n    return 'my work'\n")
    files["03"].write_bytes(b"")  # what a non-atomic write on a full disk left
    files["04"].write_text(stub_source(lesson("04"))[:40])  # and a half of one
    capsys.readouterr()

    assert cli.main(["start", str(workspace)]) == 0
    assert f"wrote {len(LESSONS) + len(BUILDS) - 1} stubs" in capsys.readouterr().out
    assert files["02"].read_text().endswith("return 'my work'\n")
    for chosen in LESSONS:
        if chosen.chapter != "02":
            assert files[chosen.chapter].read_text() == stub_source(chosen)

    # The solutions replace the untouched stubs, and only them.
    assert cli.main(["start", str(workspace), "--solutions"]) == 0
    assert f"kept your work: {files['02'].name}\n" in capsys.readouterr().out
    assert files["02"].read_text().endswith("return 'my work'\n")
    for chosen in LESSONS:
        if chosen.chapter != "02":
            solution = inspect.getsource(chosen.solution_module())
            assert files[chosen.chapter].read_text() == solution


def test_a_folder_named_like_a_chapter_file_is_one_line_each_way(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    folder = tmp_path / "ws" / lesson("02").file_name
    folder.mkdir(parents=True)
    assert cli.main(["start", str(tmp_path / "ws")]) == 2
    said = f"{folder} is not a file (a folder of that name?): move it away"
    assert said in one_error_line(capsys)
    assert [p.name for p in (tmp_path / "ws").iterdir()] == [folder.name]  # nothing written
    assert cli.main(["check", "02", "--dir", str(tmp_path / "ws")]) == 1
    (line,) = without_hints(capsys.readouterr().out)
    assert line.startswith("concat_kv: FAILED: ") and said in line


class FullDisk:
    """A standard output on a full disk."""

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_an_output_on_a_full_disk_is_one_line(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(sys, "stdout", FullDisk())
        code = cli.main(["list"])
    assert code == 2
    assert capsys.readouterr().err == f"{ERROR}no space left on the device\n"


def test_a_check_whose_output_is_on_a_full_disk_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not the answer's failure: the grader's own output cannot be written."""
    course.write_workspace(tmp_path, solutions=True)
    with monkeypatch.context() as patch:
        patch.setattr(sys, "stdout", FullDisk())
        code = cli.main(["check", "10", "--dir", str(tmp_path)])
    assert code == 2
    assert capsys.readouterr().err == f"{ERROR}no space left on the device\n"


# ---------------------------------------------------------------------------
# The verdict comes from where the learner's code never runs (issue 43, item 14)
# ---------------------------------------------------------------------------

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="a child subreaper, and /proc: Linux"
)

# At import: every socket this process holds is told the check passed, in every form the
# grader has read a verdict in (a JSON line, a framed ("verdict", True)), then os._exit(0).
FORGE = """
import json, os, pickle
_said = pickle.dumps(("verdict", True))
for _fd in os.listdir("/proc/self/fd"):
    try:
        if os.readlink(f"/proc/self/fd/{_fd}").startswith("socket:"):
            os.write(int(_fd), json.dumps({"passed": True}).encode())
            os.write(int(_fd), len(_said).to_bytes(8, "big") + _said)
    except OSError:
        pass
os._exit(0)
"""

# At import: the class that holds a verdict says "passed" whatever it is given.
PATCH = """
from rosecourse.exercises.common import CheckResult
CheckResult.passed = property(lambda self: True, lambda self, value: None)
"""


def stub_file(workspace: Path, name: str, at_import: str) -> None:
    """`name`'s stub (every answer wrong: not written yet) in `workspace`, and `at_import`."""
    chosen = course.find(name)
    workspace.mkdir(parents=True, exist_ok=True)
    (workspace / chosen.file_name).write_text(stub_source(chosen) + "\n" + at_import + "\n")


@linux_only
@pytest.mark.slow
@pytest.mark.parametrize("name", ["10", "model"])
@pytest.mark.parametrize("hostile", ["forged verdict", "patched CheckResult"])
def test_a_wrong_answer_cannot_tell_the_grader_it_passed(
    name: str, hostile: str, tmp_path: Path
) -> None:
    stub_file(tmp_path, name, FORGE if hostile == "forged verdict" else PATCH)
    checked = rose_course("check", name, "--dir", str(tmp_path))
    assert checked.returncode == 1, checked
    assert "Traceback" not in checked.stdout + checked.stderr, checked
    lines = without_hints(checked.stdout)
    assert lines and all("passed" not in line.split(":")[1] for line in lines if ":" in line)
    assert "FAILED" in lines[-1] or "not written yet" in lines[-1], lines[-3:]


# At import: the build's child drops every failure it finds, and prints "passed" for every
# part; its GPT's logits are 1% off. Before issue 54 a build's verdict came from here.
FORGED_PASSES = """
from rosecourse.builds import grading as _grading
from rosecourse.course import build as _build

_observe = _grading.observe  # what the check's process answers a part with
_grading.observe = lambda b, part, module: (_observe(b, part, module)[0], None)
for _part in _build("model").parts:
    print(f"model/{_part.name}: passed: equal to rose's GPT (rosetrainer/model.py) within the tolerance")


class GPT(GPT):
    def forward(self, *args):
        return super().forward(*args) * 1.01
"""


@pytest.mark.slow
def test_a_build_whose_process_forges_passed_fails_in_the_grader(tmp_path: Path) -> None:
    chosen = course.find("model")
    tmp_path.joinpath(chosen.file_name).write_text(
        course.solution_source(chosen) + "\n" + FORGED_PASSES
    )
    checked = rose_course("check", "model", "--dir", str(tmp_path))
    assert checked.returncode == 1, checked
    lines = without_hints(checked.stdout)
    judged = [line for line in lines if line.startswith("model/logits: ")]
    assert judged[-1].startswith("model/logits: FAILED: logits of a (1, 1) batch"), lines
    assert ": at index " in judged[-1], lines


class Pwn:
    """An object whose unpickling runs a command: what a learner could send the grader."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.path}",))


def test_the_grader_reads_answers_as_plain_data_only(tmp_path: Path) -> None:
    import pickle

    import torch

    from rosecourse.exercises.common import Raised
    from rosecourse.plain import Foreign, dumps, loads

    sent = {
        "x": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)[:, 1:],
        "mask": torch.tensor([True, False]),
        "none": torch.zeros(0, 4, dtype=torch.int64),
        (1, "a"): [Raised("IndexError"), torch.float16, frozenset({"b"}), 2.5, None],
        "object": Pwn(tmp_path / "x"),
    }
    got = loads(dumps(sent))
    assert got.keys() == sent.keys()
    for name in ("x", "mask", "none"):
        assert got[name].dtype == sent[name].dtype and torch.equal(got[name], sent[name])
    assert got[(1, "a")] == sent[(1, "a")]
    assert got["object"] == Foreign("Pwn")
    # A message that would build an object (and here run a command) is refused unread.
    with pytest.raises(pickle.UnpicklingError, match="plain data only"):
        loads(pickle.dumps(("probe", Pwn(tmp_path / "pwned"))))
    assert not (tmp_path / "pwned").exists()


@linux_only
@pytest.mark.slow
def test_a_message_that_would_run_code_in_the_grader_is_refused(tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    send = f"""
import os, pickle, socket
class _Pwn:
    def __reduce__(self):
        return (os.system, ("touch {pwned}",))
_said = pickle.dumps(("probe", _Pwn()))
for _fd in os.listdir("/proc/self/fd"):
    try:
        if os.readlink(f"/proc/self/fd/{{_fd}}").startswith("socket:"):
            os.write(int(_fd), len(_said).to_bytes(4, "big") + _said)
    except OSError:
        pass
"""
    stub_file(tmp_path / "ws", "10", send)
    checked = rose_course("check", "10", "--dir", str(tmp_path / "ws"))
    assert checked.returncode == 1, checked
    assert "cannot read" in without_hints(checked.stdout)[-1], checked.stdout
    assert not pwned.exists()


def marked(marker: str) -> list[int]:
    """The pids of the running processes whose command line holds `marker` (a zombie's
    command line is empty)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def sleeper(marker: str, holds_output: bool) -> str:
    """At import: a grandchild in a session of its own (fork, setsid, fork, exec) that
    sleeps with `marker` in its command line, holding the check's output or not."""
    return textwrap.dedent(f"""
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                if not {holds_output}:
                    _null = os.open(os.devnull, os.O_WRONLY)
                    os.dup2(_null, 1)
                    os.dup2(_null, 2)
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(300)", "{marker}"])
            os._exit(0)
        """)


@linux_only
@pytest.mark.slow
@pytest.mark.parametrize("holds_output", [True, False], ids=["holding stdout", "detached"])
@pytest.mark.parametrize("name", ["10", "model"])
def test_a_check_that_leaves_a_process_running_fails_and_ends_it(
    name: str, holds_output: bool, tmp_path: Path
) -> None:
    """A right answer (10) or a stub (model) that starts a process in a session of its own
    and leaves it running: the check fails for it, at once, and the process is gone."""
    marker = f"rose-sleeper-{uuid.uuid4().hex}"
    if name == "10":
        solution_file(tmp_path, name, at_import=sleeper(marker, holds_output))
    else:
        stub_file(tmp_path, name, "import os, sys\n" + sleeper(marker, holds_output))
    started = time.monotonic()
    checked = rose_course("check", name, "--dir", str(tmp_path), "--timeout", "100")
    assert time.monotonic() - started < 90, checked
    assert marked(marker) == []
    assert checked.returncode == 1, checked
    line = without_hints(checked.stdout)[-1]
    # The sleeper, and the process that started it when it had not yet exited (a fork of
    # the check's process, which holds the grader's memory, takes a while to start).
    assert re.match(
        rf"{course.find(name).name}: FAILED: your code left processes running \([12], ", line
    ), line


@linux_only
@pytest.mark.slow
def test_a_killed_grader_takes_the_checks_process_with_it(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    loop = f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\nwhile True:\n    pass"
    solution_file(tmp_path / "ws", "10", at_import=loop)
    command = [sys.executable, "-m", "rosecourse.cli", "check", "10", "--dir", str(tmp_path / "ws")]
    grader = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text()):  # the learner's loop runs
            assert grader.poll() is None and time.monotonic() < deadline, grader.poll()
            time.sleep(0.05)
        child = Path(f"/proc/{pid_file.read_text()}/cmdline")
        stat = child.with_name("stat").read_bytes()
        assert int(stat.rpartition(b")")[2].split()[1]) == grader.pid  # the grader's fork
        grader.kill()
        grader.wait()
        deadline = time.monotonic() + 30
        while child.exists() and child.read_bytes():  # (a zombie's command line is empty)
            assert time.monotonic() < deadline, "the check's process outlived its grader"
            time.sleep(0.05)
    finally:
        grader.kill()


@linux_only
@pytest.mark.slow
def test_code_that_kills_its_grader_passes_nothing(tmp_path: Path) -> None:
    """A right answer that SIGKILLs its grader (its process's parent): no verdict at all,
    and the command fails."""
    solution_file(tmp_path, "10", at_import="os.kill(os.getppid(), 9)")
    checked = rose_course("check", "10", "--dir", str(tmp_path))
    assert checked.returncode == -signal.SIGKILL, checked
    assert "passed" not in checked.stdout, checked


@linux_only
def test_a_check_gives_its_callers_process_back_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """`rose-course check` called in a process that goes on (a notebook, a test) makes it
    the grader only while it grades: dumpable again after, no child subreaper, and with
    the torch threads it had."""
    import torch

    from rosecourse.runner import process_settings

    course.write_workspace(tmp_path, solutions=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # (the grader runs on one)
    try:
        before = process_settings()
        assert before == (1, 0, 2)
        assert cli.main(["check", "10", "--dir", str(tmp_path)]) == 0, capsys.readouterr()
        assert process_settings() == before
    finally:
        torch.set_num_threads(threads)


def test_every_chapter_is_judged_by_its_exercise_in_the_grader() -> None:
    from rosecourse.runner import exercise_of

    for chosen in LESSONS:
        module = sys.modules[chosen.check.__module__]
        assert exercise_of(chosen) is module.EXERCISE, chosen.chapter
        # What the grader runs (the exercise's check) is what the lesson's check runs.
        body = inspect.getsource(chosen.check).rstrip().splitlines()[-1].strip()
        assert body == "return check(EXERCISE, fn)", chosen.chapter
    assert all(exercise_of(build) is None for build in BUILDS)


class InProcess:
    """The check's process's side, answered here: `answer`, through the plain-data wire."""

    def __init__(self, exercise: object, fn: object) -> None:
        self.exercise, self.fn = exercise, fn

    def ask(self, *request: object) -> list:
        from rosecourse.plain import dumps, loads
        from rosecourse.runner import answer

        _, *content = loads(dumps(answer(None, self.exercise, self.fn, request)))
        return content


@pytest.mark.slow
@pytest.mark.parametrize("chosen", LESSONS, ids=[lesson.chapter for lesson in LESSONS])
def test_the_grader_judges_as_the_check_does(chosen: course.Lesson) -> None:
    """The check judged in the grader on the answers that crossed the wire says what the
    check run in one process says: for the reference and a known wrong answer."""
    from rosecourse.exercises.common import check
    from rosecourse.runner import exercise_of, judge

    exercise = exercise_of(chosen)
    for fn in [exercise.reference, exercise.known_wrong[0].fn]:
        alone = check(exercise, fn, show=False)
        assert str(judge(chosen.name, exercise, InProcess(exercise, fn))) == str(alone)


@pytest.mark.slow
def test_an_answer_that_rewrites_a_later_check_fails_it_and_every_later_one(
    tmp_path: Path,
) -> None:
    """A right chapter 00 answer that appends to the installed check of chapter 05 (here a
    copy of rosecourse, imported first) so that it compares no run: `check all` fails
    chapter 00 for it, runs no later check, and never passes the wrong chapter 05 answer."""
    import shutil

    code = tmp_path / "code"
    shutil.copytree(
        REPO_ROOT / "rosecourse",
        code / "rosecourse",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    workspace = tmp_path / "ws"
    command = [sys.executable, "-m", "rosecourse.cli"]
    subprocess.run([*command, "start", str(workspace)], cwd=code, check=True, capture_output=True)
    rewrite = textwrap.dedent("""
        import rosecourse
        from pathlib import Path
        _check = Path(rosecourse.__file__).parent / "exercises" / "ch05_top_p_filter.py"
        with open(_check, "a") as _file:
            _file.write("\\nimport dataclasses\\nEXERCISE = dataclasses.replace(EXERCISE, runs=[])\\n")
        """)
    solution_file(workspace, "00", at_import=rewrite)
    top_p = lesson("05")
    (workspace / top_p.file_name).write_text(
        "def top_p_filter(logits, top_p):\n    return logits\n"
    )
    checked = subprocess.run(
        [*command, "check", "all", "--dir", str(workspace)],
        cwd=code,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert checked.returncode == 1, checked
    lines = checked.stdout.splitlines()
    (first,) = [line for line in lines if line.startswith("causal_attention:")]
    assert "FAILED" in first and "changed rose's or the course's files" in first, first
    (fifth,) = [line for line in lines if line.startswith("top_p_filter:")]
    assert "FAILED: not run" in fifth, fifth
    assert not any(": passed" in line for line in lines), lines


def in_own_words(chosen: course.Lesson) -> object:
    """Chapter `chosen`'s reference solution as a learner could write it: calling copies of
    the pieces of rose it delegates to (a copy runs rose's code, not rose's function)."""
    import types

    def copied(fn: types.FunctionType) -> types.FunctionType:
        copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__)
        copy.__kwdefaults__ = fn.__kwdefaults__
        return copy

    solution = chosen.solution()
    names = {**solution.__globals__}
    names.update({name: copied(fn) for name, fn in names.items() if name.startswith("rose_")})
    return types.FunctionType(solution.__code__, names, solution.__name__, solution.__defaults__)


load()  # every exercise's answers, the ALTERNATIVES among them
RIGHT_ANSWERS = [(chosen.chapter, in_own_words(chosen)) for chosen in LESSONS] + [
    (chosen.chapter, fn) for chosen in LESSONS for fn in ALTERNATIVES.get(chosen.chapter, [])
]


# ---------------------------------------------------------------------------
# rose's own code is no answer
# ---------------------------------------------------------------------------

# One answer in each form: the check's name, the learner's file (a build's: added to its
# stub), and what its FAILED line says.
ROSES_OWN = {
    "re-exported": (
        "03",
        "from rosetrainer.model import causal_mask\n",
        "causal_mask: FAILED: your causal_mask runs rose's own rosetrainer.model.causal_mask",
    ),
    "captured on import, then delegated to": (
        "05",
        "from roseinfer.request import sampling\n\n_rose = sampling.top_p_filter\n\n\n"
        "def top_p_filter(logits, p):\n    return _rose(logits, p)\n",
        "top_p_filter: FAILED: your top_p_filter runs rose's own "
        "roseinfer.request.sampling.top_p_filter",
    ),
    "looked up when called, what it raised caught": (
        "09",
        "import importlib\n\n\ndef window_start(start, seq_len, block_size, keep):\n"
        "    rows = importlib.import_module('roseinfer.request.rows')\n"
        "    try:\n        return rows.window_start(start, seq_len, block_size, keep)\n"
        "    except BaseException:\n        return start\n",
        "window_start: FAILED: your window_start runs rose's own "
        "roseinfer.request.rows.window_start",
    ),
    "subclassed": (
        "block_manager",
        "from roseinfer.engine import block_manager as _rose\n\n\n"
        "class BlockManager(_rose.BlockManager):\n    pass\n",
        "block_manager: FAILED: your BlockManager subclasses rose's own "
        "roseinfer.engine.block_manager.BlockManager",
    ),
}


@pytest.mark.parametrize("form", ROSES_OWN, ids=list(ROSES_OWN))
def test_an_answer_that_is_roses_own_code_fails_naming_it(
    form: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    name, text, said = ROSES_OWN[form]
    if name in course.BUILD_NAMES:
        stub_file(tmp_path, name, text)
    else:
        (tmp_path / course.find(name).file_name).write_text(text)
    assert cli.main(["check", name, "--dir", str(tmp_path)]) == 1
    (line,) = without_hints(capsys.readouterr().out)
    assert line == f"{said}: the exercise is to write it"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("chapter", "fn"), RIGHT_ANSWERS, ids=[f"{c}-{f.__name__}" for c, f in RIGHT_ANSWERS]
)
def test_every_right_answer_passes_with_roses_piece_refused(chapter: str, fn: object) -> None:
    """A right answer other than the reference solution runs in a check's process where
    rose's piece is refused (runner.refuse_roses_pieces), and passes: rose's code never
    calls the refused piece inside the learner's function."""
    from rosecourse.runner import answering, exercise_of, judge, refuse_roses_pieces

    chosen = lesson(chapter)
    exercise = exercise_of(chosen)

    class Refusing(InProcess):
        def ask(self, *request: object) -> list:
            give_back = refuse_roses_pieces(chosen)
            try:
                return super().ask(*request)
            finally:
                give_back()

    result = judge(chosen.name, exercise, Refusing(exercise, answering(fn)))
    assert result.passed, str(result)
