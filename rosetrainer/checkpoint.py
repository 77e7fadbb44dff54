"""Checkpoints: a plain dict of tensors and plain values, written atomically, read as data.

A checkpoint holds at least the model's weights ("model") and its shape as a plain
dict ("model_config"); the trainer adds its optimizer, step, RNG and data position.
It is read back with `torch.load(weights_only=True)`, which refuses to run code
from the file, so everything in it must be tensors, numbers, strings, None, and
lists/tuples/dicts of those.

Saving writes a temporary file next to the target and renames it over the target
only once it is complete on disk: a crash mid-save leaves the previous checkpoint
as it was.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError
from rosetrainer.model import GPT

CHECKPOINT_FORMAT = "rose-checkpoint-v1"
REQUIRED_KEYS = ("model", "model_config")
# Every file torch.save writes is a zip archive, and every zip archive starts so.
ZIP_MAGIC = b"PK\x03\x04"
# Prefixes wrappers put in front of parameter names: torch.compile, then DistributedDataParallel.
WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write `state` (plus its format tag) to `path`; the old file survives any crash."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {**state, "format": CHECKPOINT_FORMAT}
    # The temp file must be in the same directory: os.replace is atomic only within one
    # filesystem. Its ".tmp" suffix keeps it out of find_latest_checkpoint's "*.pt".
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    if os.name == "posix":  # make the rename itself survive a power cut
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", *, mmap: bool = False
) -> dict[str, Any]:
    """Read a rose checkpoint, with one clear error for each way the file can be wrong.

    mmap=True maps the file instead of reading it: a tensor's bytes are read only when it
    is used (a pipeline stage reads its own layers' weights and no others)."""
    path = Path(path)
    if path.is_dir():
        names = sorted(p.name for p in path.glob("*.pt"))
        inside = (
            f"it holds {', '.join(names)}; pass one of those" if names else "it holds no .pt files"
        )
        raise RoseError(f"checkpoint {path} is a directory, not a file: {inside}")
    if not path.is_file():
        raise RoseError(
            f"checkpoint not found: {path}; check the path, or train one with python -m rosetrainer.train"
        )
    with open(path, "rb") as f:
        if f.read(len(ZIP_MAGIC)) != ZIP_MAGIC:
            raise RoseError(f"{path} is not a PyTorch checkpoint file; pass a .pt file rose saved")
    if not zipfile.is_zipfile(path):  # the archive's index is written last, so it is missing
        raise RoseError(
            f"checkpoint {path} is truncated (a save or copy was cut short); "
            f"copy it again or use an earlier checkpoint"
        )
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:
        raise RoseError(
            f"{path} holds Python objects, not only tensors and plain values, so it is not a "
            f"rose checkpoint (rose loads with weights_only=True and never runs code from a file)"
        ) from None
    except Exception as err:  # torch reports a damaged archive as RuntimeError, and others
        reason = (str(err).splitlines() or [type(err).__name__])[0]
        raise RoseError(f"checkpoint {path} cannot be read: {reason}") from None

    if not isinstance(ckpt, dict) or "format" not in ckpt:
        raise RoseError(
            f"{path} is a PyTorch file but not a rose checkpoint (no 'format' key; a bare "
            f"state_dict?); for Hugging Face GPT-2 weights use rosetrainer.hf.load_hf_gpt2"
        )
    if ckpt["format"] != CHECKPOINT_FORMAT:
        raise RoseError(
            f"{path} has format {ckpt['format']!r}; this rose reads {CHECKPOINT_FORMAT!r} only"
        )
    missing = [key for key in REQUIRED_KEYS if key not in ckpt]
    if missing:
        raise RoseError(
            f"checkpoint {path} lacks {', '.join(missing)}; it was not written by rose's trainer"
        )
    return ckpt


def strip_wrapper_prefixes(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameter names as the bare GPT has them, whether saved from a compiled or DDP model."""
    clean = {}
    for name, tensor in state_dict.items():
        while name.startswith(WRAPPER_PREFIXES):
            name = name.split(".", 1)[1]
        clean[name] = tensor
    return clean


def check_weights_fit(state_dict: dict[str, torch.Tensor], model: GPT, source: str) -> None:
    """Raise a RoseError naming what differs when `state_dict` does not fit `model`.

    It checks against the model the weights are about to be loaded into: a model built on
    PyTorch's meta device instead would cost no memory, but its initialisation imports
    torch._dynamo, two seconds at every start of the CLI."""
    config = model.config
    expected = {name: t.shape for name, t in model.state_dict().items()}
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    mismatched = [
        name for name in expected if name in state_dict and state_dict[name].shape != expected[name]
    ]
    if not (missing or unexpected or mismatched):
        return
    problems = []
    if mismatched:
        first = mismatched[0]
        problems.append(
            f"{first} is {tuple(state_dict[first].shape)} in the weights but "
            f"{tuple(expected[first])} for the config ({len(mismatched)} shape(s) differ)"
        )
    if missing:
        problems.append(f"missing: {_first_few(missing)}")
    if unexpected:
        problems.append(f"unexpected: {_first_few(unexpected)}")
    raise RoseError(f"{source} do not fit the model config ({config}): {'; '.join(problems)}")


def _first_few(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (
        f" and {len(names) - limit} more" if len(names) > limit else ""
    )


def model_from_checkpoint(ckpt: dict[str, Any], device: str | torch.device = "cpu") -> GPT:
    """Build the GPT a checkpoint describes and load its weights (strictly: every name, every shape)."""
    if not isinstance(ckpt.get("model_config"), dict):
        raise RoseError("checkpoint's model_config must be a plain dict of GPTConfig fields")
    config = GPTConfig.from_dict(ckpt["model_config"])
    state_dict = strip_wrapper_prefixes(ckpt["model"])
    model = GPT(config)
    check_weights_fit(state_dict, model, "checkpoint weights")
    model.load_state_dict(state_dict)
    return model.to(device)


def load_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[GPT, dict[str, Any]]:
    """The model a checkpoint file holds, and the checkpoint itself (for its configs, step...)."""
    ckpt = load_checkpoint(path)
    return model_from_checkpoint(ckpt, device), ckpt


def find_latest_checkpoint(root: str | Path = "checkpoints") -> Path | None:
    """The most recently written *.pt below `root` (any depth), or None when there is none."""
    candidates = [p for p in Path(root).rglob("*.pt") if p.is_file()]
    return max(candidates, key=lambda p: p.stat().st_mtime, default=None)
