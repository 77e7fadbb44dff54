"""The computations of training: the data a process sees, one optimizer step, an eval.

Under `torchrun --nproc_per_node=N` each process trains on its slice of one global
batch: every rank draws the same world_size * batch_size windows from an identically
seeded generator and keeps its own batch_size rows, so N processes see exactly the
data one process with N times the batch size sees.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rosetrainer.checkpoint import model_from_checkpoint
from rosetrainer.config import GPTConfig, TrainConfig
from rosetrainer.data import get_batch, load_tokens, prepare_data
from rosetrainer.errors import RoseError
from rosetrainer.model import GPT
from rosetrainer.runtime import Runtime, mean_over_ranks


def load_splits(cfg: TrainConfig, rt: Runtime, block_size: int) -> tuple[dict[str, np.memmap], str]:
    """Token arrays for "train" and "val" (tokenized once, cached in data_dir), and the
    sha256 of the text they came from; refused when a split is shorter than one window
    of `block_size` tokens and its next."""

    def prepare():
        return prepare_data(
            text_file=cfg.text_file,
            dataset=cfg.dataset,
            data_dir=cfg.data_dir,
            tokenizer_name=cfg.tokenizer_name,
            val_fraction=cfg.val_fraction,
        )

    # Rank 0 tokenizes and writes the cache; the others wait for it, then only read it.
    if rt.is_main:
        prepared = prepare()
    if rt.distributed:
        dist.barrier()
    if not rt.is_main:
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            prepared = prepare()
    check_long_enough(prepared.meta, block_size)
    splits = {"train": load_tokens(prepared.train_path), "val": load_tokens(prepared.val_path)}
    return splits, prepared.meta["text_sha256"]


def check_long_enough(meta: dict[str, Any], block_size: int) -> None:
    """A text too short to train on is said so, with its numbers (an empty split's token
    file would be "not a token file" otherwise)."""
    n_train, n_val = meta["n_train_tokens"], meta["n_val_tokens"]
    if min(n_train, n_val) <= block_size:
        raise RoseError(
            f"{meta['source']} is too short to train on: its {n_train + n_val} tokens split "
            f"into {n_train} for training and {n_val} for validation (--val-fraction "
            f"{meta['val_fraction']}), and a batch needs windows of block_size + 1 = "
            f"{block_size + 1} tokens from each; use a longer text or a smaller --block-size"
        )


def rank_batch(
    tokens: np.memmap, batch_size: int, block_size: int, generator: torch.Generator, rt: Runtime
) -> tuple[torch.Tensor, torch.Tensor]:
    """This process's batch_size rows of one global batch of world_size * batch_size windows."""
    x, y = get_batch(tokens, batch_size * rt.world_size, block_size, generator)
    rows = slice(rt.rank * batch_size, (rt.rank + 1) * batch_size)
    x, y = x[rows], y[rows]
    if rt.device.type == "cuda":
        # Page-locked memory lets the copy to the GPU run while the CPU goes on (from
        # pageable memory a "non-blocking" copy waits).
        x, y = x.pin_memory(), y.pin_memory()
    return x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True)


def build_model(
    model_cfg: GPTConfig, cfg: TrainConfig, rt: Runtime, ckpt: dict[str, Any] | None
) -> tuple[GPT, nn.Module]:
    """The bare GPT (saved, sampled from) and the module that trains (compiled, DDP-wrapped)."""
    raw_model = model_from_checkpoint(ckpt, rt.device) if ckpt else GPT(model_cfg).to(rt.device)
    raw_model.activation_checkpointing = cfg.activation_checkpointing
    model = torch.compile(raw_model) if cfg.compile else raw_model
    if rt.distributed:
        device_ids = [rt.device.index] if rt.device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=device_ids)
    return raw_model, model


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    cfg: TrainConfig,
    rt: Runtime,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over grad_accum_steps micro-batches -> (mean loss, grad norm)."""
    total_loss = torch.zeros((), device=rt.device)
    for micro_step in range(cfg.grad_accum_steps):
        x, y = next(batches)
        # DDP averages gradients over the processes in every backward; with accumulation
        # only the last micro-step's needs to, the others just add up locally.
        last = micro_step == cfg.grad_accum_steps - 1
        sync = model.no_sync() if rt.distributed and not last else contextlib.nullcontext()
        with sync:
            with rt.autocast():
                # validate=False: the ids come from the tokenizer, checked against the
                # model's vocabulary when the run started, and every window fits the
                # context; the checks would wait on the GPU and split a compiled graph.
                loss = model(x, y, validate=False).loss / cfg.grad_accum_steps
            scaler.scale(loss).backward()
        total_loss += loss.detach()
    scaler.unscale_(optimizer)  # clip the true gradients, not the fp16-scaled ones
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return total_loss, grad_norm


@torch.no_grad()
def evaluate(
    model: nn.Module, splits: dict[str, np.memmap], cfg: TrainConfig, block_size: int, rt: Runtime
) -> dict[str, float]:
    """Mean loss over eval_iters batches of each split: the same batches at every eval."""
    model.eval()
    losses = {}
    for name, tokens in splits.items():
        # A generator of its own, reseeded each time: evals never move the training data
        # stream, and every eval scores the same windows, so evals compare like with like.
        generator = torch.Generator().manual_seed(cfg.seed + 1)
        total = torch.zeros((), device=rt.device)
        for _ in range(cfg.eval_iters):
            x, y = rank_batch(tokens, cfg.batch_size, block_size, generator, rt)
            with rt.autocast():
                total += model(x, y, validate=False).loss.float()
        losses[name] = mean_over_ranks(total / cfg.eval_iters, rt).item()
    model.train()
    return losses
