"""The command-line tools against hostile input (issue 43, item 13): each case was a
traceback, a crash or a read without end; each is one line on stderr and exit code 2.

The tools run in this process through their `main(argv)` (the same `run_cli` wrapper a
user's command goes through), except where a case could kill the process it runs in.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from servers import write_test_checkpoint

from rosecourse import cli as course_cli
from roseinfer.cli import export_hf as cli_export_hf
from roseinfer.cli import generate as cli_generate
from roseinfer.cli import serve as cli_serve

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli-hostile") / "tiny.pt"
    write_test_checkpoint(path)
    return path


def one_line_exit_2(capsys: pytest.CaptureFixture, main, argv: list[str], *says: str) -> str:
    try:
        code = main([str(arg) for arg in argv])
    except SystemExit as exit:  # (argparse's exit, where a parser reports the mistake)
        code = exit.code
    out, err = capsys.readouterr()
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert all(s in err for s in says), err
    return err


def loop(tmp_path: Path) -> Path:
    """A symbolic link that leads to itself through another."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    return tmp_path / "a"


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ('{"type":"array","items":' * 5_000 + "{}" + "}" * 5_000, "nested too deeply"),
        ('{"type": "integer", "maximum": ' + "9" * 5_000 + "}", "integer longer than"),
        (b'{"description": "caf\xe9"}', "not UTF-8"),
    ],
    ids=["deep", "long-integer", "latin-1"],
)
def test_a_json_schema_file_it_cannot_read_is_one_line(
    capsys: pytest.CaptureFixture,
    checkpoint: Path,
    tmp_path: Path,
    content: str | bytes,
    says: str,
) -> None:
    schema = tmp_path / "schema.json"
    if isinstance(content, bytes):
        schema.write_bytes(content)
    else:
        schema.write_text(content)
    argv = ["--checkpoint-path", checkpoint, "--prompt", "Hi", "--json-schema", schema]
    one_line_exit_2(capsys, cli_generate.main, argv, says)


def test_a_json_schema_from_a_file_without_end_is_refused(
    capsys: pytest.CaptureFixture, checkpoint: Path
) -> None:
    """/dev/zero never ends: it is read only as far as a schema may be long."""
    argv = ["--checkpoint-path", checkpoint, "--prompt", "Hi", "--json-schema", "/dev/zero"]
    one_line_exit_2(capsys, cli_generate.main, argv, "/dev/zero", "larger than")


def test_a_regex_that_is_not_utf8_is_one_line(
    capsys: pytest.CaptureFixture, checkpoint: Path
) -> None:
    # (Python reads a command line's byte 0xff, not UTF-8, as the surrogate U+DCFF)
    regex = b"\xff".decode("utf-8", "surrogateescape")
    argv = ["--checkpoint-path", checkpoint, "--prompt", "Hi", "--regex", regex]
    one_line_exit_2(capsys, cli_generate.main, argv, "not a character")


@pytest.mark.parametrize("main", [cli_generate.main, cli_serve.main], ids=["generate", "serve"])
def test_a_speculative_method_with_a_digit_int_cannot_read_is_one_line(
    capsys: pytest.CaptureFixture, checkpoint: Path, main
) -> None:
    """'²' is a digit to str.isdigit, not to int()."""
    argv = ["--checkpoint-path", checkpoint, "--speculative-method", "self:²",
            "--num-speculative-tokens", "2"]  # fmt: skip
    one_line_exit_2(capsys, main, argv, "self:N", "'self:²'")


@pytest.mark.parametrize("which", ["out", "checkpoint"])
def test_export_with_a_symlink_loop_is_one_line(
    capsys: pytest.CaptureFixture, checkpoint: Path, tmp_path: Path, which: str
) -> None:
    looping = loop(tmp_path)
    argv = (
        ["--checkpoint-path", checkpoint, "--out", looping]
        if which == "out"
        else ["--checkpoint-path", looping, "--out", tmp_path / "hf"]
    )
    one_line_exit_2(capsys, cli_export_hf.main, argv, str(looping), "loop")
    assert not (tmp_path / "hf").exists()


def test_course_check_with_a_timeout_past_what_a_wait_takes_is_one_line(
    capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """3,000,000 s is past what select(2) waits (an OverflowError in the runner)."""
    argv = ["check", "01", "--dir", tmp_path, "--timeout", "3e6"]
    one_line_exit_2(capsys, course_cli.main, argv, "--timeout", "3e6")


@pytest.mark.parametrize("main", [cli_generate.main, cli_serve.main], ids=["generate", "serve"])
@pytest.mark.parametrize("flag", ["--kv-cache-window", "--kv-cache-group-size"])
def test_quantized_cache_flags_without_a_quantized_cache_are_refused(
    capsys: pytest.CaptureFixture, checkpoint: Path, main, flag: str
) -> None:
    """The window and the group size shape an int8/int4 cache only: with the default
    cache they would do nothing, so both tools say so before loading anything."""
    argv = ["--checkpoint-path", checkpoint, flag, "4"]
    one_line_exit_2(capsys, main, argv, flag, "--kv-cache-dtype int8 or int4")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--cache", "offloaded", "--no-kv-cache"], "--no-kv-cache"),
    ],
    ids=["uncached-offloaded"],
)
def test_generate_flags_that_would_be_ignored_are_refused(
    capsys: pytest.CaptureFixture, checkpoint: Path, flags: list[str], says: str
) -> None:
    """A flag the chosen path would not use is told, not silently dropped."""
    argv = ["--checkpoint-path", checkpoint, "--prompt", "Hi", *flags]
    one_line_exit_2(capsys, cli_generate.main, argv, says)


# Each tool's argv before the engine flags (rose-generate's engine path: two prompts).
ENGINE_TOOLS = {
    "generate": (cli_generate.main, ["--prompt", "a", "--prompt", "b"]),
    "serve": (cli_serve.main, []),
}


@pytest.mark.parametrize("tool", ENGINE_TOOLS)
def test_a_kv_pool_past_the_memory_is_one_line(
    capsys: pytest.CaptureFixture, checkpoint: Path, tool: str
) -> None:
    """A pool larger than the memory there is was the allocator's traceback: refused,
    naming the flag and the memory available."""
    main, argv = ENGINE_TOOLS[tool]
    argv = ["--checkpoint-path", checkpoint, *argv, "--kv-cache-memory", "1TiB"]
    err = one_line_exit_2(capsys, main, argv, "--kv-cache-memory '1TiB' is a KV pool of")
    assert re.search(r"more than the [0-9.]+ GiB of memory available on cpu", err), err


@pytest.mark.parametrize("tool", ENGINE_TOOLS)
@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--kv-block-size", "0"], "--kv-block-size must be an integer >= 1, got 0"),
        (["--kv-block-size", "100000"], "--kv-block-size 100000 is more than the model's"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be an integer >= 1, got 0"),
        (["--num-kv-blocks", "0"], "--num-kv-blocks must be an integer >= 1, got 0"),
        (["--kv-cache-memory", "lots"], "--kv-cache-memory must be a byte count"),
    ],
    ids=[
        "kv-block-size",
        "kv-block-past-context",
        "max-num-seqs",
        "num-kv-blocks",
        "kv-cache-memory",
    ],
)
def test_an_engine_flags_mistake_names_the_flag(
    capsys: pytest.CaptureFixture, checkpoint: Path, tool: str, flags: list[str], says: str
) -> None:
    """EngineConfig names its fields (the Python API's words); the tools name the flag
    the user typed."""
    main, argv = ENGINE_TOOLS[tool]
    one_line_exit_2(capsys, main, ["--checkpoint-path", checkpoint, *argv, *flags], says)
