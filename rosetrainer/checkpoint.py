"""Checkpoints: a plain dict of tensors and plain values, written atomically, read as data.

A checkpoint holds at least the model's weights ("model") and its shape as a plain
dict ("model_config"); the trainer adds its optimizer, step, RNG and data position.
It is read back with `torch.load(weights_only=True)`, which refuses to run code
from the file, so everything in it must be tensors, numbers, strings, None, and
lists/tuples/dicts of those.

Saving goes through rosetrainer.files.write_atomically: a crash mid-save leaves the
previous checkpoint as it was. Loading checks the archive's CRC-32 checksums (bytes
damaged after the save) and refuses non-finite weights. Where a checkpoint path
points follows one rule, `RunFiles`, for the trainer, the CLIs and the loader.
"""

from __future__ import annotations

import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError, one_line
from rosetrainer.files import write_atomically
from rosetrainer.model import GPT

CHECKPOINT_FORMAT = "rose-checkpoint-v1"
REQUIRED_KEYS = ("model", "model_config")
# Every file torch.save writes is a zip archive, and every zip archive starts so.
ZIP_MAGIC = b"PK\x03\x04"
# Prefixes wrappers put in front of parameter names: torch.compile, then DistributedDataParallel.
WRAPPER_PREFIXES = ("_orig_mod.", "module.")


@dataclass(frozen=True)
class RunFiles:
    """The files of one training run, named by the one rule for checkpoint paths.

    A path ending in ".pt" is that checkpoint file: training writes it, and beside it
    the same stem's best checkpoint, metrics and loss curve (run/a.pt, run/a.best.pt,
    run/a.metrics.jsonl, run/a.loss.png). Any other path is a run directory: run/last.pt,
    run/best.pt, run/metrics.jsonl, run/loss.png. The lock is the folder's, run/train.lock,
    either way: two paths can name the same files (run and run/last.pt both write
    run/last.pt; run and run/best.pt, run/best.pt), so one trainer writes in a folder.
    """

    last: Path  # written at every eval and on Ctrl-C; what --resume continues from
    best: Path  # the lowest validation loss so far
    metrics: Path
    plot: Path
    lock: Path  # held by the one process training in the run's folder

    @classmethod
    def of(cls, checkpoint_path: str | Path) -> RunFiles:
        path = Path(checkpoint_path)
        if path.suffix == ".pt":
            beside = path.parent / path.stem  # run/a.pt -> run/a.best.pt, run/a.metrics.jsonl
            return cls(
                last=path,
                best=Path(f"{beside}.best.pt"),
                metrics=Path(f"{beside}.metrics.jsonl"),
                plot=Path(f"{beside}.loss.png"),
                lock=path.parent / "train.lock",
            )
        return cls(
            last=path / "last.pt",
            best=path / "best.pt",
            metrics=path / "metrics.jsonl",
            plot=path / "loss.png",
            lock=path / "train.lock",
        )

    @property
    def folder(self) -> Path:
        return self.last.parent

    def existing(self) -> list[Path]:
        """The run's files that are already there (its lock file does not count)."""
        return [p for p in (self.last, self.best, self.metrics, self.plot) if p.exists()]


def checkpoint_to_load(path: str | Path) -> Path:
    """The file a checkpoint path names: a .pt (or any file) is itself; a run directory
    gives its best.pt, else its last.pt."""
    path = Path(path)
    if path.is_dir():
        run = RunFiles.of(path)
        for candidate in (run.best, run.last):
            if candidate.is_file():
                return candidate
        names = sorted(p.name for p in path.glob("*.pt"))
        inside = (
            f"it holds {', '.join(names)}; pass one of those" if names else "it holds no .pt files"
        )
        raise RoseError(
            f"checkpoint {path} is a run directory without best.pt or last.pt: {inside}"
        )
    return path


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write `state` (plus its format tag) to `path`; the old file survives any crash."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {**state, "format": CHECKPOINT_FORMAT}
    write_atomically(path, lambda f: _torch_save(state, f))


def _torch_save(state: dict[str, Any], f: BinaryIO) -> None:
    """torch.save, with the OSError of a failed write (a full disk, a file size limit)
    raised as itself: torch's zip writer would report it as an opaque RuntimeError."""
    failed: list[OSError] = []

    class Recorded:
        def write(self, data: bytes) -> int:
            try:
                return f.write(data)
            except OSError as err:
                failed.append(err)
                raise

        def __getattr__(self, name: str) -> Any:
            return getattr(f, name)

    try:
        torch.save(state, Recorded())
    except RuntimeError:
        if failed:
            raise failed[0] from None
        raise


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", *, mmap: bool = False
) -> dict[str, Any]:
    """Read a rose checkpoint (a file, or a run directory's best/last), with one clear error
    for each way it can be wrong: missing, not PyTorch's, truncated, damaged, code inside,
    not rose's, non-finite weights.

    mmap=True maps the file instead of reading it: a tensor's bytes are read only when it
    is used (a pipeline stage reads its own layers' weights and no others). The archive's
    checksums are still verified (streamed, nothing kept); the weights' values are then
    not scanned for NaN, which would read them all."""
    path = checkpoint_to_load(path)
    if not path.is_file():
        raise RoseError(
            f"checkpoint not found: {path}; check the path, or train one with python -m rosetrainer.train"
        )
    _check_archive(path)
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:
        raise RoseError(
            f"{path} holds Python objects, not only tensors and plain values, so it is not a "
            f"rose checkpoint (rose loads with weights_only=True and never runs code from a file)"
        ) from None
    except Exception as err:  # torch reports a damaged archive as RuntimeError, and others
        raise RoseError(f"checkpoint {path} cannot be read: {one_line(err, False)}") from None

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
    if not isinstance(ckpt["model"], dict) or not all(
        isinstance(t, torch.Tensor) for t in ckpt["model"].values()
    ):
        raise RoseError(f"checkpoint {path}: 'model' must be a dict of tensors (a state_dict)")
    if not mmap:
        check_finite(ckpt["model"], f"checkpoint {path}")
    return ckpt


def _check_archive(path: Path) -> None:
    """The zip archive torch.save wrote is whole, and every member matches its CRC-32."""
    try:
        with open(path, "rb") as f:
            magic = f.read(len(ZIP_MAGIC))
    except OSError as err:  # a file that cannot be read as one: /proc/self/mem, a device
        raise RoseError(f"checkpoint {path} cannot be read: {err.strerror}") from None
    if magic != ZIP_MAGIC:
        raise RoseError(f"{path} is not a PyTorch checkpoint file; pass a .pt file rose saved")
    if not zipfile.is_zipfile(path):  # the archive's index is written last, so it is missing
        raise RoseError(
            f"checkpoint {path} is truncated (a save or copy was cut short); "
            f"copy it again or use an earlier checkpoint"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()  # reads every member and checks its CRC-32
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        damaged = f"({err})"
    if damaged is not None:
        raise RoseError(
            f"checkpoint {path} is damaged: {damaged} fails its checksum (the bytes changed "
            f"after the save); copy it again or use an earlier checkpoint"
        )


def check_finite(state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Refuse weights holding NaN or infinity: a model made of them only writes garbage."""
    for name, tensor in state_dict.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise RoseError(
                f"{source}: {name} holds NaN or infinite values; use an earlier checkpoint"
            )


def check_declared_shape(
    config: GPTConfig, state_dict: dict[str, torch.Tensor], source: str
) -> None:
    """Compare the model a config declares with the tensors stored, before building it.

    A few bytes of config can declare a model of any size; checking the embeddings and
    the number of layers against what the file really holds first keeps a wrong or
    hostile config from allocating it (check_weights_fit then checks every tensor).
    """
    problems = []
    declared_shapes = {"transformer.wte.weight": (config.padded_vocab_size, config.n_embd)}
    if config.position_embedding == "learned":
        declared_shapes["transformer.wpe.weight"] = (config.block_size, config.n_embd)
    for name, declared in declared_shapes.items():
        tensor = state_dict.get(name)
        stored = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else "absent"
        if stored != declared:
            problems.append(f"{name} is {stored} in the weights but {declared} for the config")
    layers = len({n.split(".")[2] for n in state_dict if n.startswith("transformer.h.")})
    if layers < config.n_layer:
        problems.append(f"missing: transformer.h.{layers}.* ({config.n_layer} layers declared)")
    elif layers > config.n_layer:
        problems.append(f"unexpected: transformer.h.{config.n_layer}.* ({layers} layers stored)")
    if problems:
        raise RoseError(f"{source} do not fit the model config ({config}): {'; '.join(problems)}")


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
    check_declared_shape(config, state_dict, "checkpoint weights")
    model = GPT(config)
    check_weights_fit(state_dict, model, "checkpoint weights")
    head, embedding = state_dict["lm_head.weight"], state_dict["transformer.wte.weight"]
    if not torch.equal(head, embedding):
        # Saved with an output matrix of its own (the chapters' wide random init makes one):
        # loading it into the tied matrix would overwrite the token embedding with it.
        model.lm_head.weight = torch.nn.Parameter(torch.empty_like(head))
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
