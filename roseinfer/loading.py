"""Everything that turns a user's "this model, on this device, in this dtype" into a
model and its tokenizer: shared by the CLI, the offline LLM, the server and the exporter."""

from __future__ import annotations

from pathlib import Path

import torch

from rosetrainer.checkpoint import find_latest_checkpoint, load_checkpoint, load_model
from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError
from rosetrainer.hf import gpt_config_from_hf, load_hf_gpt2, read_hf_config
from rosetrainer.model import GPT
from rosetrainer.runtime import DTYPES
from rosetrainer.tokenizer import Tokenizer


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RoseError(
            "--device cuda, but CUDA is not available here (no GPU, or a CPU-only torch); "
            "use --device cpu or auto"
        )
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "float16" and device.type == "cpu":
        raise RoseError("float16 is not supported on CPU; use bfloat16 or float32")
    if name == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise RoseError(
            f"bfloat16 is not supported on {torch.cuda.get_device_name(device)}; "
            f"use float16 or float32"
        )
    return DTYPES[name]


def checkpoint_file(path_arg: str | None) -> Path:
    """The .pt to load: the one named, best.pt / last.pt of a run directory, or the newest."""
    if path_arg is None:
        latest = find_latest_checkpoint("checkpoints")
        if latest is None:
            raise RoseError(
                "no checkpoint given and none under checkpoints/: train one with "
                "`python -m rosetrainer.train --preset tiny`, or pass --checkpoint-path or --hf-model"
            )
        return latest
    path = Path(path_arg)
    if path.is_dir():
        for name in ("best.pt", "last.pt"):
            if (path / name).is_file():
                return path / name
    return path  # load_model says what is wrong with it, if anything


def load_model_and_tokenizer(
    checkpoint_path: str | None = None,
    hf_model: str | None = None,
    tokenizer_name: str | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[GPT, Tokenizer, str]:
    """The model in eval mode, its tokenizer, and where the model came from.

    hf_model: a Hugging Face GPT-2 directory; otherwise `checkpoint_path` (a .pt file, a
    run directory, or None for the newest checkpoint under checkpoints/).
    """
    device = torch.device(device)
    if hf_model:
        model, source, trained_with = load_hf_gpt2(hf_model, device), hf_model, "gpt2"
    else:
        path = checkpoint_file(checkpoint_path)
        model, ckpt = load_model(path, device)
        source, trained_with = str(path), ckpt.get("tokenizer_name", "gpt2")
    model = model.to(dtype).eval()
    tokenizer = Tokenizer(tokenizer_name or trained_with)
    vocab_size = model.config.vocab_size
    if tokenizer.n_vocab > vocab_size:
        raise RoseError(
            f"tokenizer {tokenizer.name!r} has {tokenizer.n_vocab} tokens but the model's "
            f"vocabulary has {vocab_size}: use the tokenizer the model was trained with"
        )
    return model, tokenizer, source


def model_config_and_tokenizer(
    checkpoint_path: str | None = None, hf_model: str | None = None
) -> tuple[GPTConfig, str, Path | str]:
    """The model's shape, the tokenizer it was trained with, and where it is, without
    loading its weights (a split model's stages load their own shares)."""
    if hf_model:
        return gpt_config_from_hf(read_hf_config(hf_model)), "gpt2", hf_model
    path = checkpoint_file(checkpoint_path)
    ckpt = load_checkpoint(path, mmap=True)  # mapped: no tensor is read
    config = GPTConfig.from_dict(ckpt["model_config"])
    return config, ckpt.get("tokenizer_name", "gpt2"), path
