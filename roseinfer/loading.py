"""Everything that turns a user's "this model, on this device, in this dtype" into a
model and its tokenizer: shared by the CLI, the offline LLM, the server and the exporter."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from rosetrainer.checkpoint import (
    checkpoint_to_load,
    find_latest_checkpoint,
    load_checkpoint,
    load_model,
)
from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError
from rosetrainer.hf import LLAMA_TYPES, config_from_hf, load_hf, read_hf_config
from rosetrainer.model import GPT
from rosetrainer.tokenizer import HFTokenizer, Tokenizer


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
) -> tuple[GPT, Tokenizer | HFTokenizer, str]:
    """The model in eval mode, its tokenizer, and where the model came from.

    hf_model: a Hugging Face GPT-2, Llama or Qwen2 directory (a Llama's or Qwen2's own
    tokenizer.json is its tokenizer, unless tokenizer_name names another); otherwise `checkpoint_path` (a .pt file, a
    run directory, or None for the newest checkpoint under checkpoints/; the one rule of
    rosetrainer.checkpoint.RunFiles). Devices and dtypes: rosetrainer.runtime.pick_device
    and pick_dtype.
    """
    device = torch.device(device)
    if hf_model:
        model, source, trained_with = load_hf(hf_model, device), hf_model, "gpt2"
    else:
        path = checkpoint_to_load(checkpoint_path or newest_checkpoint())
        model, ckpt = load_model(path, device)
        source, trained_with = str(path), ckpt.get("tokenizer_name", "gpt2")
    model = model.to(dtype).eval()
    tokenizer = hf_tokenizer(hf_model) if hf_model and not tokenizer_name else None
    tokenizer = tokenizer or Tokenizer(tokenizer_name or trained_with)
    vocab_size = model.config.vocab_size
    if tokenizer.n_vocab > vocab_size:
        raise RoseError(
            f"tokenizer {tokenizer.name!r} has {tokenizer.n_vocab} tokens but the model's "
            f"vocabulary has {vocab_size}: use the tokenizer the model was trained with"
        )
    return fit_vocabulary(model, tokenizer.n_vocab), tokenizer, source


def hf_tokenizer(folder: str) -> HFTokenizer | None:
    """A Llama's or Qwen2's own tokenizer (its folder's tokenizer.json); None for a GPT-2,
    which rose tokenizes with tiktoken's GPT-2."""
    if read_hf_config(folder).get("model_type") not in LLAMA_TYPES:
        return None
    if not (Path(folder) / "tokenizer.json").is_file():
        raise RoseError(
            f"{folder} has no tokenizer.json; pass the folder save_pretrained wrote with its "
            f"tokenizer, or name a tiktoken tokenizer with --tokenizer-name"
        )
    return HFTokenizer(folder)


@torch.no_grad()
def fit_vocabulary(model: GPT, n_vocab: int) -> GPT:
    """The model without the rows of its embedding and output matrix past its tokenizer's
    n_vocab tokens.

    rose-train pads the matrices to a multiple of 64 rows (GPTConfig.vocab_multiple),
    and a model trained elsewhere may declare a vocabulary padded past its tokenizer's
    (50,304 for GPT-2's 50,257, as nanoGPT pads it): ids that could be sampled but never
    decoded. The model's forward returns the logits of its vocab_size ids only; cutting
    the rows to n_vocab also leaves every other id's logit exactly as it was and saves
    the products of rows no token reads, and an export (Hugging Face, ONNX) then holds
    the tokenizer's vocabulary and nothing else.
    """
    if model.config.padded_vocab_size == n_vocab:
        return model
    wte, head = model.transformer.wte, model.lm_head
    tied = head.weight is wte.weight
    model.transformer.wte = nn.Embedding.from_pretrained(wte.weight[:n_vocab].clone(), freeze=False)
    new_head = nn.Linear(model.config.n_embd, n_vocab, bias=False, device="meta")
    new_head.weight = (
        model.transformer.wte.weight if tied else nn.Parameter(head.weight[:n_vocab].clone())
    )
    model.lm_head = new_head
    model.config = dataclasses.replace(model.config, vocab_size=n_vocab, vocab_multiple=1)
    return model


def model_config_and_tokenizer(
    checkpoint_path: str | None = None, hf_model: str | None = None
) -> tuple[GPTConfig, str, Path | str]:
    """The model's shape, the tokenizer it was trained with, and where it is, without
    loading its weights (a split model's stages load their own shares)."""
    if hf_model:
        hf_config = read_hf_config(hf_model)
        if hf_config.get("model_type") in LLAMA_TYPES:
            # (its stages' processes and the launcher know tokenizers by tiktoken's names)
            raise RoseError(
                f"a split model reads tiktoken tokenizers only, and {hf_model} brings its own "
                f"tokenizer.json: run the folder in one process (rose-generate --hf-model)"
            )
        return config_from_hf(hf_config), "gpt2", hf_model
    path = checkpoint_to_load(checkpoint_path or newest_checkpoint())
    ckpt = load_checkpoint(path, mmap=True)  # mapped: no tensor is loaded
    config = GPTConfig.from_dict(ckpt["model_config"])
    return config, ckpt.get("tokenizer_name", "gpt2"), path
