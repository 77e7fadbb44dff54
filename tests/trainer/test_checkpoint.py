"""Checkpoints: a faithful round trip, one clear error per kind of bad file, crash-safe saves."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rosecourse.demo import wide_random_init
from rosetrainer.checkpoint import (
    CHECKPOINT_FORMAT,
    find_latest_checkpoint,
    load_checkpoint,
    load_model,
    model_from_checkpoint,
    save_checkpoint,
)
from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError
from rosetrainer.model import GPT

CONFIG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)


def trained_state(seed: int = 0) -> dict:
    """What the trainer stores, after one real optimizer step so AdamW has moments."""
    torch.manual_seed(seed)
    model = GPT(CONFIG)
    optimizer = model.configure_optimizer(0.1, 1e-3, (0.9, 0.99), "cpu")
    idx = torch.randint(CONFIG.vocab_size, (2, 16))
    model(idx, targets=idx).loss.backward()
    optimizer.step()
    version, mt_state, gauss = random.getstate()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": None,
        "step": 1,
        "best_val_loss": 5.25,
        "model_config": CONFIG.to_dict(),
        "train_config": {"batch_size": 2, "dtype": "float32", "text_file": None},
        "rng": {
            "torch": torch.Generator().manual_seed(seed).get_state(),
            "python": [version, list(mt_state), gauss],
        },
        "data_state": {"epoch": 0, "position": 123},
    }


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict]:
    state = trained_state()
    path = tmp_path / "run" / "last.pt"
    save_checkpoint(path, state)
    return path, state


def test_round_trip_restores_weights_configs_and_trainer_state(saved):
    path, state = saved
    model, ckpt = load_model(path)

    assert ckpt["format"] == CHECKPOINT_FORMAT
    assert ckpt["model_config"] == state["model_config"]
    assert ckpt["train_config"] == state["train_config"]
    assert model.config == CONFIG
    for name, tensor in state["model"].items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied after loading

    optimizer = model.configure_optimizer(0.1, 1e-3, (0.9, 0.99), "cpu")
    optimizer.load_state_dict(ckpt["optimizer"])
    saved_moments = state["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], saved_moments)

    generator = torch.Generator().manual_seed(999)
    generator.set_state(ckpt["rng"]["torch"])
    expected = torch.randn(4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.randn(4, generator=generator), expected)
    version, mt_state, gauss = ckpt["rng"]["python"]
    random.setstate((version, tuple(mt_state), gauss))
    draws = [random.random() for _ in range(3)]
    random.setstate((version, tuple(state["rng"]["python"][1]), gauss))
    assert draws == [random.random() for _ in range(3)]
    assert ckpt["scaler"] is None and ckpt["step"] == 1 and ckpt["best_val_loss"] == 5.25
    assert ckpt["data_state"] == {"epoch": 0, "position": 123}


def test_weights_saved_from_compiled_or_ddp_models_load(tmp_path: Path):
    state = trained_state()
    wrapped = {f"module._orig_mod.{name}": t for name, t in state["model"].items()}
    save_checkpoint(tmp_path / "wrapped.pt", {**state, "model": wrapped})
    model, _ = load_model(tmp_path / "wrapped.pt")
    assert torch.equal(model.transformer.wte.weight, state["model"]["transformer.wte.weight"])


def test_an_untied_output_matrix_stays_untied(tmp_path: Path):
    """A model with its own output matrix loads as saved: embedding and head both kept."""
    model = wide_random_init(
        GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)), 0
    )
    save_checkpoint(
        tmp_path / "untied.pt",
        {**trained_state(), "model": model.state_dict(), "model_config": model.config.to_dict()},
    )
    loaded, _ = load_model(tmp_path / "untied.pt")
    assert loaded.lm_head.weight is not loaded.transformer.wte.weight
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)


def _bad_files(tmp_path: Path, good: Path) -> dict[str, tuple[Path, str]]:
    """name -> (a bad checkpoint path, a piece of the error it must give)."""
    good_bytes = good.read_bytes()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good_bytes[: len(good_bytes) // 2])
    random_bytes = tmp_path / "random.pt"
    random_bytes.write_bytes(os.urandom(4096))
    state = load_checkpoint(good)
    bare = tmp_path / "bare.pt"
    torch.save(state["model"], bare)
    other_format = tmp_path / "other.pt"
    torch.save({**state, "format": "someone-else-v3"}, other_format)
    no_config = tmp_path / "noconfig.pt"
    torch.save({k: v for k, v in state.items() if k != "model_config"}, no_config)
    (tmp_path / "empty").mkdir()
    with_code = tmp_path / "code.pt"
    torch.save({**state, "extra": Path("a python object")}, with_code)
    return {
        "missing": (tmp_path / "nope.pt", "checkpoint not found"),
        "run directory without a checkpoint": (tmp_path / "empty", "it holds no .pt files"),
        "random bytes": (random_bytes, "not a PyTorch checkpoint file"),
        "truncated": (truncated, "is truncated"),
        "bare state_dict": (bare, "not a rose checkpoint (no 'format' key"),
        "other format": (other_format, "has format 'someone-else-v3'"),
        "no model_config": (no_config, "lacks model_config"),
        "python objects": (with_code, "holds Python objects"),
    }


def test_each_kind_of_bad_file_gets_its_own_one_line_error(tmp_path: Path, saved):
    good, _ = saved
    for name, (path, expected) in _bad_files(tmp_path, good).items():
        with pytest.raises(RoseError) as info:
            load_checkpoint(path)
        message = str(info.value)
        assert expected in message, (name, message)
        assert "\n" not in message, name


@pytest.mark.parametrize(
    "edit, expected",
    [
        (
            {"n_embd": 64},
            "transformer.wte.weight is (256, 32) in the weights but (256, 64) for the config",
        ),
        ({"n_layer": 3}, "missing: transformer.h.2."),
        ({"n_layer": 1}, "unexpected: transformer.h.1."),
    ],
)
def test_weights_that_do_not_fit_their_config_are_named(saved, edit, expected):
    path, _ = saved
    ckpt = load_checkpoint(path)
    ckpt["model_config"] = {**ckpt["model_config"], **edit}
    with pytest.raises(RoseError, match="do not fit the model config") as info:
        model_from_checkpoint(ckpt)
    assert expected in str(info.value)


def test_failed_save_leaves_previous_file_and_no_temp_file(saved):
    path, state = saved
    before = path.read_bytes()
    with pytest.raises(Exception):  # noqa: B017 - whatever pickling raises for a lambda
        save_checkpoint(path, {**state, "model": lambda: None})
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]
    assert path.read_bytes() == before


def test_find_latest_checkpoint_picks_newest_pt_at_any_depth(tmp_path: Path):
    assert find_latest_checkpoint(tmp_path / "absent") is None
    assert find_latest_checkpoint(tmp_path) is None
    old, new, temp = tmp_path / "a" / "old.pt", tmp_path / "b" / "c" / "new.pt", tmp_path / "x.tmp"
    for age, path in ((300, old), (200, new), (100, temp)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
        os.utime(path, (path.stat().st_atime, path.stat().st_mtime - age))
    assert find_latest_checkpoint(tmp_path) == new


# The child saves with the real save_checkpoint, but its torch.save writes half the bytes
# and then hangs: it is killed exactly while the temp file exists and the save is unfinished.
HANGING_SAVE = textwrap.dedent(
    """
    import io, sys, time
    import torch
    from rosetrainer import checkpoint

    real_save = torch.save

    def save_half_then_hang(obj, f):
        buffer = io.BytesIO()
        real_save(obj, buffer)
        f.write(buffer.getvalue()[: buffer.tell() // 2])
        f.flush()
        print("half written", flush=True)
        time.sleep(120)

    checkpoint.torch.save = save_half_then_hang
    state = {"model": {"w": torch.zeros(1 << 20)}, "model_config": {}}
    checkpoint.save_checkpoint(sys.argv[1], state)
    """
)


@pytest.mark.slow
def test_process_killed_mid_save_leaves_previous_checkpoint_intact(saved):
    path, state = saved
    child = subprocess.Popen(
        [sys.executable, "-c", HANGING_SAVE, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "half written"
        temp_files = [p for p in path.parent.iterdir() if p.suffix == ".tmp"]
        assert len(temp_files) == 1 and temp_files[0].stat().st_size > 0
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    model, ckpt = load_model(path)
    assert ckpt["step"] == state["step"]
    for name, tensor in state["model"].items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert find_latest_checkpoint(path.parent) == path  # the leftover temp file is not a .pt
