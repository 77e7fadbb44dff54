"""What rose protects (issue 11): nothing lost, nothing silently wrong.

One section per numbered class of the issue. Every bad case asserts the one-line error
and that no file that existed before changed (`unchanged`). Crafted files are built
here, in temporary folders; none is committed.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from training import tiny_run, train_losses

from rosetrainer import trainer
from rosetrainer.checkpoint import (
    RunFiles,
    load_checkpoint,
    load_model,
    save_checkpoint,
)
from rosetrainer.config import GPTConfig, TrainConfig
from rosetrainer.errors import RoseError
from rosetrainer.files import ensure_writable_dir, write_bytes_atomically
from rosetrainer.hf import load_hf_gpt2
from rosetrainer.model import GPT
from rosetrainer.run import run_lock, sign
from rosetrainer.train import main, parse_args, resolve_configs

TRAIN_ERROR = "[rosetrainer.train] error: "
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one thread is faster


def snapshot(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def unchanged(before: dict[Path, bytes]) -> bool:
    """Every file of the snapshot is still there, byte for byte."""
    return all(p.is_file() and p.read_bytes() == content for p, content in before.items())


def one_line_error(capsys: pytest.CaptureFixture, prog: str = TRAIN_ERROR) -> str:
    """The one error line on stderr (a run that had started also drew its progress bar)."""
    err = capsys.readouterr().err
    assert err.count(prog) == 1 and "Traceback" not in err, err
    return err[err.index(prog) :].split("\n")[0]


@pytest.fixture(scope="module")
def finished_run(text_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step run (evals at 2 and 4) that tests copy before they touch it."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    assert main(tiny_run(text_file, run_dir, "--max-steps", "4", "--eval-interval", "2")) == 0
    return run_dir


@pytest.fixture
def run_copy(finished_run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(finished_run, tmp_path / "run"))


# ---------------------------------------------------------------------------
# 1. A fresh run never destroys an existing one
# ---------------------------------------------------------------------------


def test_the_quickstart_twice_says_the_run_exists_and_keeps_it(
    text_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)  # the default checkpoints/<preset> of the README's command
    flags = tiny_run(text_file, Path("unused"), "--max-steps", "2")
    flags = flags[:4] + flags[6:]  # no --checkpoint-path: the default, checkpoints/tiny
    assert main(["--preset", "tiny", *flags]) == 0
    run = tmp_path / "checkpoints" / "tiny"
    before = snapshot(run)
    capsys.readouterr()

    assert main(["--preset", "tiny", *flags]) == 2
    err = one_line_error(capsys)
    assert "checkpoints/tiny/last.pt already holds a run (step 2, best val loss" in err
    assert "--resume" in err and "--overwrite" in err and "another --checkpoint-path" in err
    assert unchanged(before)


@pytest.mark.slow
def test_a_refused_run_fails_before_reading_its_text(run_copy: Path, tmp_path: Path, capsys):
    before = snapshot(run_copy)
    bad_text = tmp_path / "bad.txt"
    bad_text.write_bytes(b"\xff\xfe not utf-8")
    assert main(tiny_run(bad_text, run_copy, "--max-steps", "2")) == 2
    assert "already holds a run (step 4" in one_line_error(capsys)
    assert unchanged(before)


def test_overwrite_replaces_the_run_on_purpose(run_copy: Path, text_file: Path) -> None:
    assert main(tiny_run(text_file, run_copy, "--max-steps", "2", "--overwrite")) == 0
    assert load_checkpoint(run_copy / "last.pt")["step"] == 2
    assert [step for step, _ in train_losses(run_copy)] == [1, 2]


def test_resume_and_overwrite_together_are_refused(run_copy: Path, capsys) -> None:
    before = snapshot(run_copy)
    assert main(["--checkpoint-path", str(run_copy), "--resume", "--overwrite"]) == 2
    assert "pass one of them" in one_line_error(capsys)
    assert unchanged(before)


# ---------------------------------------------------------------------------
# 2. One run, one process: the lock
# ---------------------------------------------------------------------------


def test_a_second_process_on_a_locked_run_is_refused(
    run_copy: Path, text_file: Path, capsys
) -> None:
    before = snapshot(run_copy)
    lock = RunFiles.of(run_copy).lock
    with run_lock(lock) as lock_file:
        sign(lock_file)  # this test process is the holder
        assert main([*tiny_run(text_file, run_copy), "--resume", "--max-steps", "6"]) == 2
        assert lock.read_text() == f"{os.getpid()}\n"  # the live run's lock is left alone
    assert not lock.exists()
    err = one_line_error(capsys)
    assert f"another process (pid {os.getpid()}) is training in {run_copy}" in err
    assert unchanged(before)


@pytest.mark.parametrize("name", ["last.pt", "best.pt", "a.pt"])
def test_two_paths_into_one_folder_share_its_lock(
    tmp_path: Path, text_file: Path, capsys, name: str
) -> None:
    """`run` and `run/last.pt` both write run/last.pt (`run/best.pt`: run/best.pt): while
    a trainer holds `run`, a second one given a checkpoint file in that folder is refused."""
    run = tmp_path / "run"
    run.mkdir()
    with run_lock(RunFiles.of(run).lock) as lock_file:
        sign(lock_file)
        assert main(tiny_run(text_file, run / name, "--max-steps", "2")) == 2
    assert f"another process (pid {os.getpid()}) is training in {run}" in one_line_error(capsys)
    assert not list(run.iterdir())  # nothing written


def offline(monkeypatch: pytest.MonkeyPatch) -> int:
    def no_network(*args: object, **kwargs: object) -> None:
        raise OSError(-2, "Name or service not known")

    monkeypatch.setattr("urllib.request.urlopen", no_network)
    return 2  # one line: offline? pass --text-file


def fails_while_it_runs(monkeypatch: pytest.MonkeyPatch) -> type[Exception]:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug while training")

    monkeypatch.setattr(trainer, "train_loop", broken)
    return RuntimeError  # a bug: its traceback


def interrupted(monkeypatch: pytest.MonkeyPatch) -> int:
    def ctrl_c(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # before the trainer's own handler is in place

    monkeypatch.setattr(trainer, "start_run", ctrl_c)
    return 130


def interrupted_mid_run(monkeypatch: pytest.MonkeyPatch) -> int:
    real_step = trainer.one_step

    def step_then_ctrl_c(*args: object, **kwargs: object) -> tuple[float, bool]:
        done = real_step(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)  # the trainer's handler: stop after this step
        return done

    monkeypatch.setattr(trainer, "one_step", step_then_ctrl_c)
    return 130


def finished(monkeypatch: pytest.MonkeyPatch) -> int:
    return 0


@pytest.mark.parametrize(
    "ending", [finished, offline, fails_while_it_runs, interrupted, interrupted_mid_run]
)
@pytest.mark.slow
def test_every_run_leaves_no_lock_file_behind(
    ending, text_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that finishes, the README's first command offline (no TinyShakespeare to
    download), a bug in the loop, a Ctrl-C at startup or while it trains: the lock is
    let go and its file gone, and the next run claims the folder as usual."""
    run = tmp_path / "run"
    outcome = ending(monkeypatch)
    flags = tiny_run(text_file, run, "--max-steps", "2")
    if ending is offline:  # the default dataset, into a data folder without it
        flags = ["--data-dir", str(tmp_path / "data"), *flags[4:]]
    if isinstance(outcome, int):
        assert main(flags) == outcome
    else:
        with pytest.raises(outcome):
            main(flags)
    assert not (run / "train.lock").exists()
    monkeypatch.undo()
    assert main(tiny_run(text_file, run, "--max-steps", "2", "--overwrite")) == 0
    assert not (run / "train.lock").exists()


def test_a_lock_file_removed_after_it_was_opened_is_opened_again(tmp_path: Path) -> None:
    """A failing run removes its lock file while it holds it; a process that opened the
    file just before locks a file no longer in the folder: it must open the new one."""
    path = tmp_path / "train.lock"
    opened = []

    def open_then_lose_the_race(path: Path):
        handle = real_open(path)
        if not opened:  # the first open: the file goes, another run makes a new one
            path.unlink()
            path.write_text("")
        opened.append(handle)
        return handle

    from rosetrainer import run as run_module

    real_open = run_module._open_lock_file
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run_module, "_open_lock_file", open_then_lose_the_race)
        with run_lock(path) as lock_file:
            sign(lock_file)
            assert path.read_text() == f"{os.getpid()}\n"  # the new file is the one held
    assert len(opened) == 2 and opened[0].closed


# ---------------------------------------------------------------------------
# 3. A torn last line in metrics.jsonl
# ---------------------------------------------------------------------------


def test_resume_drops_a_torn_last_metrics_line_and_says_so(run_copy: Path, capsys) -> None:
    metrics = run_copy / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"kind": "train", "st')
    assert main(["--checkpoint-path", str(run_copy), "--resume", "--max-steps", "5"]) == 0
    assert "dropped a torn last line" in capsys.readouterr().out
    assert [step for step, _ in train_losses(run_copy)] == [1, 2, 3, 4, 5]


def test_a_damaged_metrics_line_inside_the_file_is_one_line(run_copy: Path, capsys) -> None:
    metrics = run_copy / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    before = snapshot(run_copy)
    assert main(["--checkpoint-path", str(run_copy), "--resume", "--max-steps", "5"]) == 2
    assert "metrics.jsonl line 2 is not a metrics record" in one_line_error(capsys)
    assert unchanged(before)


# ---------------------------------------------------------------------------
# 4. Resume on changed data
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_on_a_changed_text_is_refused_unless_accepted(
    text_file: Path, tmp_path: Path, capsys
) -> None:
    text = tmp_path / "text.txt"
    text.write_text(text_file.read_text())
    run = tmp_path / "run"
    assert main(tiny_run(text, run, "--max-steps", "2", "--eval-interval", "2")) == 0
    text.write_text(text_file.read_text().replace("the", "thy"))  # same path, new content
    before = snapshot(run)
    resume = ["--checkpoint-path", str(run), "--resume", "--max-steps", "3"]
    assert main(resume) == 2
    err = one_line_error(capsys)
    assert "the training text changed since the checkpoint (sha256" in err
    assert "--accept-different-data" in err
    assert unchanged(before)
    assert main([*resume, "--accept-different-data"]) == 0
    assert load_checkpoint(run / "last.pt")["step"] == 3


# ---------------------------------------------------------------------------
# 5. Non-finite training
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "1e9"])
def test_a_non_finite_or_absurd_learning_rate_is_refused(value: str, tmp_path: Path, capsys):
    assert main(["--learning-rate", value, "--checkpoint-path", str(tmp_path / "run")]) == 2
    assert "learning_rate must be a finite number (0, 1]" in one_line_error(capsys)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("poison", ["loss", "weights"])
def test_a_run_that_goes_non_finite_stops_and_keeps_the_last_good_checkpoint(
    poison: str, run_copy: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    real_step = trainer.train_step

    def poisoned_step(*args, **kwargs):
        loss, grad_norm = real_step(*args, **kwargs)
        if poison == "loss":
            return loss * float("nan"), grad_norm
        with torch.no_grad():  # NaN weights after the update: the eval loss shows it
            kwargs["model"].transformer.wte.weight.fill_(float("nan"))
        return loss, grad_norm

    monkeypatch.setattr(trainer, "train_step", poisoned_step)
    checkpoints = {p: p.read_bytes() for p in run_copy.glob("*.pt")}
    code = main(["--checkpoint-path", str(run_copy), "--resume", "--max-steps", "5"])
    assert code == 2
    err = one_line_error(capsys)
    which = "training" if poison == "loss" else "validation"
    assert f"the {which} loss became nan at step 5" in err
    assert "last.pt keeps its last good state" in err
    assert unchanged(checkpoints)


# ---------------------------------------------------------------------------
# 7. Damaged weights are refused on load
# ---------------------------------------------------------------------------


def test_bytes_damaged_inside_a_tensor_fail_the_checksum(
    finished_run: Path, tmp_path: Path
) -> None:
    damaged = tmp_path / "damaged.pt"
    payload = bytearray((finished_run / "last.pt").read_bytes())
    middle = len(payload) // 2  # inside the weights, far from the zip headers
    payload[middle : middle + 16] = bytes(16)
    damaged.write_bytes(payload)
    with pytest.raises(RoseError, match=r"damaged\.pt is damaged: .* fails its checksum") as info:
        load_model(damaged)
    assert "\n" not in str(info.value)


def test_nan_weights_are_refused_by_the_generate_cli(
    finished_run: Path, tmp_path: Path, capsys
) -> None:
    from roseinfer.cli import generate as cli_generate

    ckpt = load_checkpoint(finished_run / "last.pt")
    ckpt["model"]["transformer.wte.weight"][3, 5] = float("nan")
    save_checkpoint(tmp_path / "nan.pt", ckpt)  # a valid archive: only the values are wrong
    assert cli_generate.main(["--checkpoint-path", str(tmp_path / "nan.pt")]) == 2
    err = one_line_error(capsys, "[roseinfer] error: ")
    assert "nan.pt: transformer.wte.weight holds NaN or infinite values" in err


# ---------------------------------------------------------------------------
# 10. Fractional warmup, a damaged token cache
# ---------------------------------------------------------------------------


def test_a_fractional_warmup_from_a_config_file_is_refused(tmp_path: Path, capsys) -> None:
    config = tmp_path / "run.toml"
    config.write_text("[train]\nwarmup_steps = 2.5\n")
    assert main(["--config", str(config)]) == 2
    assert "warmup_steps must be an integer >= 0, got 2.5" in one_line_error(capsys)


def test_a_zeroed_token_cache_is_noticed_and_rebuilt(text_file: Path, tmp_path: Path, capsys):
    from rosetrainer.data import prepare_data

    first = prepare_data(text_file=str(text_file), data_dir=str(tmp_path))
    tokens = first.train_path.read_bytes()
    first.train_path.write_bytes(bytes(len(tokens)))  # same size, every token 0
    capsys.readouterr()
    again = prepare_data(text_file=str(text_file), data_dir=str(tmp_path))
    assert "fail their checksum; tokenising again" in capsys.readouterr().out
    assert again.train_path.read_bytes() == tokens


# ---------------------------------------------------------------------------
# 11. A small file declaring a huge model is refused before allocating it
# ---------------------------------------------------------------------------

# 50,257 x 2**20 floats: 200 TB. Built, it would fail with a traceback (or worse).
HUGE = {"n_embd": 2**20, "n_head": 1}


def test_a_checkpoint_declaring_a_huge_model_is_refused(finished_run: Path, tmp_path: Path):
    ckpt = load_checkpoint(finished_run / "last.pt")
    ckpt["model_config"] = {**ckpt["model_config"], **HUGE}
    save_checkpoint(tmp_path / "huge.pt", ckpt)
    # (the trainer pads the vocabulary's rows to a multiple of 64: 50,304 of them)
    with pytest.raises(RoseError, match="transformer.wte.weight is \\(50304, 32\\) in the"):
        load_model(tmp_path / "huge.pt")


def test_a_hugging_face_config_declaring_a_huge_model_is_refused(
    hf_gpt2_dir: Path, tmp_path: Path
) -> None:
    folder = Path(shutil.copytree(hf_gpt2_dir, tmp_path / "hf"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_embd": 2**20, "n_head": 1}))
    with pytest.raises(RoseError, match="do not fit the model config") as info:
        load_hf_gpt2(str(folder))
    assert "model.safetensors" in str(info.value)


# ---------------------------------------------------------------------------
# 12. File-system errors: one line naming the path and the cause
# ---------------------------------------------------------------------------


def test_a_checkpoint_path_that_is_a_file_is_refused_up_front(
    text_file: Path, tmp_path: Path, capsys
) -> None:
    a_file = tmp_path / "notes"
    a_file.write_text("mine")
    assert main(tiny_run(text_file, a_file)) == 2
    assert f"{a_file} is a file; pass a run directory or a path ending in .pt" in one_line_error(
        capsys
    )
    assert a_file.read_text() == "mine"


@pytest.mark.parametrize(
    ("flag", "path"), [("--checkpoint-path", "/proc/rose/run"), ("--data-dir", "/proc/rose/data")]
)
def test_unwritable_places_fail_before_any_work(
    flag: str, path: str, text_file: Path, tmp_path: Path, capsys
) -> None:
    flags = tiny_run(text_file, tmp_path / "run")
    flags[flags.index(flag) + 1] = path
    flags[flags.index("--text-file") + 1] = str(tmp_path / "fresh.txt")  # not cached yet
    (tmp_path / "fresh.txt").write_text(text_file.read_text()[:5000])
    assert main(flags) == 2
    assert f"{flag}: cannot write to {path}" in one_line_error(capsys)


@pytest.mark.parametrize(
    ("code", "cause"),
    [(errno.ENOSPC, "no space left on the device"), (errno.EROFS, "the file system is read-only")],
)
def test_a_failed_save_names_the_cause_and_keeps_the_old_file(
    code: int, cause: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "last.pt"
    save_checkpoint(path, {"model": {}, "model_config": {}})
    before = snapshot(tmp_path)

    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(torch, "save", fail)
    with pytest.raises(RoseError, match=f"cannot write {path}: {cause}"):
        save_checkpoint(path, {"model": {}, "model_config": {}})
    assert snapshot(tmp_path) == before  # the old file, and no temporary file left


def test_an_unwritable_folder_is_named_with_its_cause(monkeypatch, tmp_path: Path) -> None:
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("tempfile.TemporaryFile", read_only)
    with pytest.raises(RoseError, match="the file system is read-only"):
        ensure_writable_dir(tmp_path, "--data-dir")


# ---------------------------------------------------------------------------
# 13. Config values of the wrong type or range; damaged checkpoint fields
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[train]\nlearning_rate = "fast"\n', "learning_rate must be a number, got 'fast'"),
        ('[model]\ndropout = "0.1"\n', "dropout must be a number, got '0.1'"),
        ("[train]\ndevice = 5\n", "device must be auto, cpu, cuda or cuda:N, got 5"),
        ("[train]\nbeta1 = 1.5\n", "beta1 must be a finite number [0, 1), got 1.5"),
        ('[train]\nseed = "abc"\n', "seed must be an integer in [0, "),
        ("[train]\nresume = 1\n", "resume must be true or false, got 1"),
    ],
)
def test_config_values_of_the_wrong_type_or_range(toml: str, message: str, tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(toml)
    assert main(["--config", str(config)]) == 2
    assert message in one_line_error(capsys)


def test_a_config_file_that_is_not_utf8(tmp_path: Path, capsys) -> None:
    config = tmp_path / "run.toml"
    config.write_bytes(b"[train]\nmax_steps = 5 # caf\xe9\n")
    assert main(["--config", str(config)]) == 2
    assert "run.toml is not UTF-8 text" in one_line_error(capsys)


TRAIN_FIELDS = [f for f in TrainConfig.__dataclass_fields__ if f != "extra"]
ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), st.lists(st.integers()),
)  # fmt: skip


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=st.dictionaries(st.sampled_from(TRAIN_FIELDS), ANY_VALUE, max_size=4))
def test_any_train_config_is_valid_or_one_clear_error(values: dict) -> None:
    try:
        TrainConfig.from_dict(values)
    except RoseError as err:
        assert "\n" not in str(err) and str(err).startswith("train config: ")


@settings(max_examples=100, deadline=None)
@given(values=st.dictionaries(st.sampled_from(list(GPTConfig.__dataclass_fields__)), ANY_VALUE))
def test_any_model_config_is_valid_or_one_clear_error(values: dict) -> None:
    try:
        GPTConfig.from_dict(values)
    except RoseError as err:
        assert "\n" not in str(err) and str(err).startswith("model config: ")


NUMERIC_FLAGS = ["--max-steps", "--batch-size", "--warmup-steps", "--seed", "--learning-rate",
                 "--min-lr", "--dropout", "--n-layer", "--grad-clip", "--eval-iters"]  # fmt: skip


@settings(max_examples=100, deadline=None)
@given(
    argv=st.lists(
        st.tuples(st.sampled_from(NUMERIC_FLAGS), st.text(min_size=1, max_size=12)), max_size=3
    )
)
def test_any_command_line_is_valid_or_one_clear_error(argv: list[tuple[str, str]]) -> None:
    flat = [item for flag, value in argv for item in (flag, f"={value}")]
    flat = [flag + value for flag, value in zip(flat[::2], flat[1::2], strict=True)]
    try:
        resolve_configs(parse_args(flat))
    except RoseError as err:
        assert "\n" not in str(err)


@pytest.mark.parametrize(
    ("field", "damage", "message"),
    [
        ("data_state", lambda c: "not a generator state", "its 'data_state' is damaged"),
        ("optimizer", lambda c: {"state": {}, "param_groups": []}, "its 'optimizer' is damaged"),
        ("optimizer", "wrong moment shapes", "exp_avg has shape (3,)"),
        ("rng", lambda c: {"torch": torch.zeros(3)}, "its 'rng' is damaged"),
        ("train_config", lambda c: [1, 2], "train_config is damaged"),
    ],
)
def test_damaged_fields_of_a_checkpoint_are_named_on_resume(
    field: str, damage, message: str, run_copy: Path, capsys
) -> None:
    ckpt = load_checkpoint(run_copy / "last.pt")
    if damage == "wrong moment shapes":
        first = next(iter(ckpt["optimizer"]["state"].values()))
        first["exp_avg"] = torch.zeros(3)
    else:
        ckpt[field] = damage(ckpt)
    save_checkpoint(run_copy / "last.pt", ckpt)
    before = snapshot(run_copy)
    assert main(["--checkpoint-path", str(run_copy), "--resume", "--max-steps", "6"]) == 2
    assert message in one_line_error(capsys)
    assert unchanged(before)


# ---------------------------------------------------------------------------
# 14, 18. Seeds beyond 64 bits; argument errors in one line
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--seed", str(2**70)], "seed must be an integer in [0, 9223372036854775807]"),
        (["--seed", "-1"], "seed must be an integer in [0, "),
        (["--max-steps", "ten"], "argument --max-steps: invalid int value: 'ten' (see --help)"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag (see --help)"),
    ],
)
def test_seeds_and_argument_errors_are_one_line(flags: list[str], message: str, capsys):
    assert main(flags) == 2
    assert message in one_line_error(capsys)


# ---------------------------------------------------------------------------
# 15, 16. Temp files of killed saves; the umask
# ---------------------------------------------------------------------------


def test_a_save_removes_temp_files_of_dead_processes_only(tmp_path: Path) -> None:
    target = tmp_path / "last.pt"
    dead = tmp_path / ".last.pt.999999999.x1y2.tmp"  # no process has this id
    alive = tmp_path / f".last.pt.{os.getpid()}.z3.tmp"  # a save running right now
    for temp in (dead, alive):
        temp.write_bytes(b"half a checkpoint")
    write_bytes_atomically(target, b"new")
    assert target.read_bytes() == b"new"
    assert not dead.exists() and alive.exists()


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_saved_files_follow_the_umask(umask: int, tmp_path: Path) -> None:
    previous = os.umask(umask)
    try:
        save_checkpoint(tmp_path / "last.pt", {"model": {}, "model_config": {}})
        write_bytes_atomically(tmp_path / "meta.json", b"{}")
    finally:
        os.umask(previous)
    for name in ("last.pt", "meta.json"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~umask, name


# ---------------------------------------------------------------------------
# The one rule for checkpoint paths (issue 12)
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_pt_checkpoint_path_is_that_file_for_train_resume_and_generate(
    text_file: Path, tmp_path: Path, capsys
) -> None:
    from roseinfer.cli import generate as cli_generate

    path = tmp_path / "run" / "a.pt"
    assert main(tiny_run(text_file, path, "--max-steps", "2", "--eval-interval", "2")) == 0
    names = sorted(p.name for p in path.parent.iterdir())
    assert names == ["a.best.pt", "a.loss.png", "a.metrics.jsonl", "a.pt"]
    assert main(["--checkpoint-path", str(path), "--resume", "--max-steps", "3"]) == 0
    assert load_checkpoint(path)["step"] == 3
    assert [s for s, _ in train_losses(path.parent / "a.metrics.jsonl")] == [1, 2, 3]
    capsys.readouterr()
    generate = ["--checkpoint-path", str(path), "--max-new-tokens", "3", "--temperature", "0"]
    assert cli_generate.main(generate) == 0
    assert f"model: {path} (" in capsys.readouterr().err


def test_a_run_directory_loads_its_best_then_its_last(finished_run: Path, tmp_path: Path):
    run = Path(shutil.copytree(finished_run, tmp_path / "run"))
    best = load_checkpoint(run / "best.pt")
    assert load_checkpoint(run)["best_val_loss"] == best["best_val_loss"]
    (run / "best.pt").unlink()
    assert load_checkpoint(run)["step"] == load_checkpoint(run / "last.pt")["step"] == 4


# ---------------------------------------------------------------------------
# 8. Stop strings whose last character GPT-2 splits over tokens
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("stop", ["你", "😀", "好😀"])
def test_a_stop_string_ending_in_a_split_character_fires(stop: str) -> None:
    from roseinfer.engine.sequence import EngineSequence
    from roseinfer.request.sampling import SamplingParams
    from rosetrainer.tokenizer import Tokenizer

    tokenizer = Tokenizer("gpt2")
    text = "ab 你好😀 and on"
    ids = tokenizer.encode(text)
    params = SamplingParams(max_tokens=len(ids) + 5, stop=(stop,))
    seq = EngineSequence([tokenizer.eot_id], params, decode=tokenizer.decode)
    streamed = []
    for token in ids:  # as a model would write them, one token at a time
        seq.append_token(token)
        streamed.append(seq.report().new_text)
        if seq.finish_reason is not None:
            break
    assert (seq.finish_reason, seq.stop_reason) == ("stop", stop)
    # The ids end with the token that completed the stop string, not one later...
    assert tokenizer.decode(seq.output_ids) == text[: text.index(stop) + len(stop)]
    # ...and the streamed text, as the OpenAI API has it, ends just before the stop string.
    assert "".join(streamed) == text[: text.index(stop)]


# ---------------------------------------------------------------------------
# 9, 10, 14, 17, 19. The generate CLI: a padded vocabulary, temperature, seed, stdin, status
# ---------------------------------------------------------------------------

PADDED_VOCAB = 50304  # GPT-2's 50,257 rounded up to a multiple of 64, as nanoGPT does


@pytest.fixture(
    scope="module",
    params=[dict(vocab_size=PADDED_VOCAB), dict(vocab_multiple=64)],
    ids=["vocab_size 50304 (nanoGPT's)", "vocab_multiple 64 (rose-train's)"],
)
def padded_checkpoint(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model whose 47 padding ids have embeddings so large that, left in, they would win
    nearly every draw and every argmax; its padding declared as nanoGPT declares it (a
    vocabulary of 50,304) or as rose-train does (50,257 ids in rows of a multiple of 64)."""
    config = GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32, **request.param)
    assert config.padded_vocab_size == PADDED_VOCAB
    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():
        model.transformer.wte.weight[50257:] *= 1000.0
    path = tmp_path_factory.mktemp("padded") / "padded.pt"
    save_checkpoint(path, {"model": model.state_dict(), "model_config": config.to_dict()})
    return path


@pytest.mark.parametrize("temperature", ["0", "1.0"])
def test_a_padded_vocabulary_never_yields_an_undecodable_id(
    temperature: str, padded_checkpoint: Path, capsys
) -> None:
    from roseinfer.cli import generate as cli_generate

    flags = ["--checkpoint-path", str(padded_checkpoint), "--json", "--max-new-tokens", "12"]
    code = cli_generate.main(
        [*flags, "--temperature", temperature, "--seed", "3", "--prompt", "Hi"]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    [result] = [json.loads(line) for line in out.splitlines()]
    assert len(result["token_ids"]) == 12
    assert max(result["token_ids"]) < 50257


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--temperature", "inf"], "temperature must be a finite number >= 0"),
        (["--temperature", "nan"], "temperature must be a finite number >= 0"),
        (["--seed", str(2**70)], "seed must be an integer in [0, 2**64 - 1]"),
        (["--seed", "-3"], "seed must be an integer in [0, 2**64 - 1]"),
    ],
)
def test_generate_refuses_bad_sampling_flags_before_printing(
    flags: list[str], message: str, padded_checkpoint: Path, capsys
) -> None:
    from roseinfer.cli import generate as cli_generate

    code = cli_generate.main(
        ["--checkpoint-path", str(padded_checkpoint), "--prompt", "Hi", *flags]
    )
    out = capsys.readouterr().out
    assert code == 2 and out == ""  # not even the prompt
    # (capsys was read: check the line with a second run's stderr)
    cli_generate.main(["--checkpoint-path", str(padded_checkpoint), "--prompt", "Hi", *flags])
    assert message in one_line_error(capsys, "[roseinfer] error: ")


def test_prompt_file_dash_reads_standard_input(
    padded_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    import io

    from roseinfer.cli import generate as cli_generate

    stdin = io.TextIOWrapper(io.BytesIO("first\n\nsecond 你\n".encode()), encoding="utf-8")
    monkeypatch.setattr("sys.stdin", stdin)
    flags = ["--checkpoint-path", str(padded_checkpoint), "--json", "--max-new-tokens", "2"]
    assert cli_generate.main([*flags, "--temperature", "0", "--prompt-file", "-"]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(line)["prompt"] for line in out.splitlines()] == ["first", "second 你"]
    assert "prompt file: standard input (1 blank lines skipped)" in err
    assert "seed: none (temperature 0: greedy, no random draws)" in err
    assert "pass --seed to repeat" not in err


# ---------------------------------------------------------------------------
# Issue 33: Ctrl-C is one line and exit 130 in every command line
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "prog", "argv"),
    [
        ("roseinfer.cli.serve", "rose-serve", ["--port", "0"]),
        ("roseinfer.cli.export_onnx", "rose-export-onnx", ["--out", "OUT"]),
        ("roseinfer.cli.export_hf", "roseinfer.cli.export_hf", ["--checkpoint-path", "x.pt",
                                                               "--out", "OUT"]),
    ],
)  # fmt: skip
def test_ctrl_c_while_loading_is_one_line_and_exit_130(
    module: str, prog: str, argv: list[str], tmp_path: Path, monkeypatch, capsys
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    cli = importlib.import_module(module)
    monkeypatch.setattr(cli, "load_model_and_tokenizer", interrupted)
    argv = [str(tmp_path / "out") if arg == "OUT" else arg for arg in argv]
    assert cli.main(argv) == 130
    assert capsys.readouterr().err == f"[{prog}] interrupted: stopped by Ctrl-C\n"
