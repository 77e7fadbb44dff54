"""Issue 21 outside the server: the one sampling rule in the CLI's paths and the Python
API (class 1), the one-line errors with exit code 2 (class 8), the small ones (class 9).
Real CLIs (in-process `main`, or a subprocess where the OS must limit it), real files."""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from training import tiny_run

import roseinfer
from roseinfer.cli import export_onnx
from roseinfer.cli import generate as cli_generate
from roseinfer.request.sampling_params import SamplingParams
from rosetrainer.checkpoint import save_checkpoint
from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError
from rosetrainer.model import GPT

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = GPTConfig(vocab_size=50257, block_size=32, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("isolation-cli") / "tiny.pt"
    save_checkpoint(path, {"model": GPT(config).state_dict(), "model_config": config.to_dict()})
    return path


def one_line(capsys: pytest.CaptureFixture, prog: str) -> str:
    out, err = capsys.readouterr()
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"[{prog}] error: "), err
    return err


# -- class 1: one rule for what the sampler can compute --

PATHS = {  # the CLI's three generation paths, picked by flags
    "static": ["--prompt", "Hi"],
    "engine": ["--prompt", "Hi", "--prompt", "Ho"],
    "onnx": ["--prompt", "Hi", "--onnx", "{onnx}"],
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--temperature", "1e-50"], "--temperature 1e-50 is too small to sample with in float32"),
     (["--temperature", "1", "--top-p", "1e-50"], "--top-p 1e-50 is too small to compare")],
)  # fmt: skip
def test_cli_generate_refuses_values_the_sampler_cannot_compute(
    path: str, flags: list[str], message: str, checkpoint: Path, tmp_path: Path, capsys
) -> None:
    source = [] if path == "onnx" else ["--checkpoint-path", str(checkpoint)]
    argv = [a.format(onnx=tmp_path) for a in PATHS[path]] + source + flags
    assert cli_generate.main(argv) == 2
    assert message in one_line(capsys, "roseinfer")


@pytest.mark.parametrize(
    ("params", "field"),
    [({"temperature": 1e-300}, "temperature"), ({"top_p": 1e-50}, "top_p"),
     ({"logprobs": 10**6}, "logprobs"), ({"stop": ["s"] * 5}, "stop"),
     ({"stop": "s" * 257}, "stop"), ({"temperature": True}, "temperature")],
)  # fmt: skip
def test_sampling_params_refuse_what_the_sampler_cannot_compute(params: dict, field: str):
    with pytest.raises(RoseError) as refused:
        SamplingParams(**params)
    assert refused.value.param == field and field in str(refused.value)


def test_the_smallest_accepted_values_sample_real_tokens(checkpoint: Path) -> None:
    """At the rule's edge the sampler still computes: tokens, never NaN."""
    llm = roseinfer.LLM(str(checkpoint))
    tiny = SamplingParams(max_tokens=3, temperature=1.2e-38, top_p=1.2e-38, seed=0)
    greedy = SamplingParams(max_tokens=3)
    [edge, argmax] = llm.generate(["Hi", "Hi"], [tiny, greedy], use_tqdm=False)
    assert edge.token_ids == argmax.token_ids  # both keep only the likeliest token


# -- class 9: the small ones, from Python --


def test_stop_none_is_no_stop_strings() -> None:
    assert SamplingParams(stop=None).stop == ()


@pytest.mark.parametrize("prompt", [None, 3.5, [None]])
def test_llm_generate_refuses_a_prompt_that_is_not_text_or_ids(prompt, checkpoint: Path) -> None:
    llm = roseinfer.LLM(str(checkpoint))
    with pytest.raises(RoseError, match="prompt"):
        llm.generate([prompt], use_tqdm=False)
    assert llm.generate(["Hi"], use_tqdm=False)[0].finished  # and it still works


# -- class 8: one line, exit code 2 --


@pytest.mark.parametrize("out", ["/proc/rose-x", "{file}/sub"])
def test_export_onnx_to_an_unwritable_out_is_one_line(out: str, checkpoint: Path, capsys) -> None:
    argv = ["--checkpoint-path", str(checkpoint), "--out", out.format(file=checkpoint)]
    assert export_onnx.main(argv) == 2
    assert "--out: cannot write to" in one_line(capsys, "rose-export-onnx")


def test_a_checkpoint_path_that_cannot_be_read_is_one_line(capsys) -> None:
    assert cli_generate.main(["--checkpoint-path", "/proc/self/mem", "--prompt", "Hi"]) == 2
    assert "cannot be read" in one_line(capsys, "roseinfer")


@pytest.mark.slow
def test_a_full_disk_while_training_is_one_line_and_leaves_no_temp_file(
    text_file: Path, tmp_path: Path
) -> None:
    """The OS refuses to grow any file past 1 MiB (RLIMIT_FSIZE, as a full disk refuses
    to grow it): the first checkpoint save fails in one line, and nothing half-written
    is left behind."""

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    run_dir = tmp_path / "run"
    flags = tiny_run(text_file, run_dir, "--max-steps", "2", "--eval-interval", "2")
    result = subprocess.run(
        [sys.executable, "-m", "rosetrainer.train", *flags],
        capture_output=True,
        text=True,
        preexec_fn=limit_file_size,
        timeout=300,
    )
    err = result.stderr
    assert result.returncode == 2 and "Traceback" not in err, err
    assert "cannot write" in err and "larger than this process may write" in err, err
    assert not list(run_dir.rglob("*.tmp"))


# -- class 6: a split model's stages go with their launcher --


def live_members(group: int) -> list[int]:
    """Processes of a process group that are still running (zombies are gone already)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it ended while we looked
        if int(fields[2]) == group and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def stages(group: int) -> list[int]:
    def cmdline(pid: int) -> bytes:
        with contextlib.suppress(OSError):
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        return b""

    return [pid for pid in live_members(group) if b"spawn_main" in cmdline(pid)]


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc to find the stage processes")
@pytest.mark.parametrize(
    ("sent", "background", "code"),
    [(signal.SIGTERM, True, 128 + signal.SIGTERM), (signal.SIGTERM, False, 128 + signal.SIGTERM),
     (signal.SIGKILL, True, -signal.SIGKILL)],
)  # fmt: skip
@pytest.mark.slow
def test_the_stages_of_a_split_model_go_with_their_launcher(
    sent: int, background: bool, code: int, tmp_path: Path
) -> None:
    """Started in the background (SIGINT ignored, as `cmd &` leaves it) or not, stopped
    politely or killed: no stage outlives the launcher, and no stage prints a traceback."""
    from servers import write_test_checkpoint  # a 1,024-token window: a long generation

    checkpoint = tmp_path / "long.pt"
    write_test_checkpoint(checkpoint)

    def like_a_shell() -> None:
        if background:  # what `cmd &` does in a non-interactive shell
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    command = [sys.executable, "-m", "roseinfer.cli_generate", "--checkpoint-path",
               str(checkpoint), "--pipeline-parallel-size", "2", *["--prompt", "Hi"] * 4,
               "--batch-size", "1", "--max-new-tokens", "1000", "--no-stop-at-eot",
               "--temperature", "0"]  # fmt: skip
    launcher = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own group: the stages are found, and stopped, by it
        preexec_fn=like_a_shell,
    )
    group = launcher.pid
    try:
        deadline = time.monotonic() + 120
        printed = b""  # stage 0 prints the prompt, then each token as it comes
        while len(printed) < 20:
            assert launcher.poll() is None and time.monotonic() < deadline, printed
            if select.select([launcher.stdout], [], [], 0.2)[0]:
                printed += os.read(launcher.stdout.fileno(), 1024)
        assert len(stages(group)) == 2  # both stages are generating
        launcher.send_signal(sent)
        launcher.wait(timeout=60)
        deadline = time.monotonic() + 5  # the stages had seconds of work left
        while live_members(group) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = live_members(group)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)  # whatever a failure left behind
        err = launcher.communicate(timeout=60)[1].decode()
    assert left == [], err
    assert launcher.returncode == code, err
    assert "Traceback" not in err, err
