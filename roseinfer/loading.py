"""Everything that turns a user's "this model, on this device, in this dtype" into a
model and its tokenizer: shared by the CLI, the offline LLM, the server and the exporter."""

from __future__ import annotations

from pathlib import Path

import torch

from rosetrainer.checkpoint import (
    checkpoint_to_load,
    find_latest_checkpoint,
    load_checkpoint,
    load_model,
)
from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError
from rosetrainer.hf import gpt_config_from_hf, load_hf_gpt2, read_hf_config
from rosetrainer.model import GPT
from rosetrainer.tokenizer import Tokenizer


def newest_checkpoint() -> Path:
    """With no --checkpoint-path: the newest checkpoint under checkpoints/."""
    latest = find_latest_checkpoint("checkpoints")
    if latest is None:
        raise RoseError(
            "no checkpoint given and none under checkpoints/: train one with "
            "`python -m rosetrainer.train --preset tiny`, or pass --checkpoint-path or --hf-model"
        )
    return latest


def load_model_and_tokenizer(
    checkpoint_path: str | None = None,
    hf_model: str | None = None,
    tokenizer_name: str | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[GPT, Tokenizer, str]:
    """The model in eval mode, its tokenizer, and where the model came from.

    hf_model: a Hugging Face GPT-2 directory; otherwise `checkpoint_path` (a .pt file, a
    run directory, or None for the newest checkpoint under checkpoints/; the one rule of
    rosetrainer.checkpoint.RunFiles). Devices and dtypes: rosetrainer.runtime.pick_device
    and pick_dtype.
    """
    device = torch.device(device)
    if hf_model:
        model, source, trained_with = load_hf_gpt2(hf_model, device), hf_model, "gpt2"
    else:
        path = checkpoint_to_load(checkpoint_path or newest_checkpoint())
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
    path = checkpoint_to_load(checkpoint_path or newest_checkpoint())
    ckpt = load_checkpoint(path, mmap=True)  # mapped: no tensor is loaded
    config = GPTConfig.from_dict(ckpt["model_config"])
    return config, ckpt.get("tokenizer_name", "gpt2"), path
