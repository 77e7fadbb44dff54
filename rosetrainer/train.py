"""Train a GPT: python -m rosetrainer.train (or the rose-train command).

One run, top to bottom: pick the device (and, under torchrun, join the other
processes), tokenize the text once into cached .bin files, build the model and
AdamW, then loop: a learning rate from the schedule, one optimizer step over
grad_accum_steps micro-batches, one line in <run>/metrics.jsonl. Every
eval_interval steps, and at the end, train/val loss and a checkpoint; at the very
end a loss curve and a sample of text.

Resume is exact: a checkpoint holds everything the next step depends on (weights,
AdamW moments, loss scaler, step, the random number generators and the state of
the batch sampler), so N steps, stop, resume, N more gives the same losses as 2N
steps in one go.

Under `torchrun --nproc_per_node=N` each process trains on its slice of one global
batch: every rank draws the same world_size * batch_size windows from an identically
seeded generator and keeps its own batch_size rows, so N processes see exactly the
data one process with N times the batch size sees.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from roseinfer.generate import generate
from roseinfer.sampling import SamplingParams
from rosetrainer.checkpoint import load_checkpoint, model_from_checkpoint, save_checkpoint
from rosetrainer.config import PRESETS, GPTConfig, TrainConfig, load_config_file
from rosetrainer.data import get_batch, load_tokens, prepare_data
from rosetrainer.errors import RoseError, run_cli
from rosetrainer.model import GPT
from rosetrainer.runtime import (
    Runtime,
    keep_freed_memory,
    mean_over_ranks,
    setup_device,
    shutdown,
)
from rosetrainer.tokenizer import Tokenizer

PROG = "rosetrainer"


def say(message: str) -> None:
    """A status line on stdout that does not tear the progress bar."""
    tqdm.write(f"[{PROG}] {message}", file=sys.stdout)


# ---------------------------------------------------------------------------
# The learning-rate schedule
# ---------------------------------------------------------------------------


def learning_rate_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to learning_rate, cosine decay to min_lr, then min_lr for good.

    `step` counts the optimizer steps already taken (0 for the first). The decay ends
    at lr_decay_steps (default max_steps); a run extended past it goes on at min_lr.
    """
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    if step >= decay_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / (decay_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (
        cfg.learning_rate - cfg.min_lr
    )


# ---------------------------------------------------------------------------
# Data: one global batch, sliced by rank
# ---------------------------------------------------------------------------


def load_splits(cfg: TrainConfig, rt: Runtime) -> dict[str, np.memmap]:
    """Token arrays for "train" and "val", tokenized once and cached in data_dir."""

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
    return {"train": load_tokens(prepared.train_path), "val": load_tokens(prepared.val_path)}


def rank_batch(
    tokens: np.memmap, batch_size: int, block_size: int, generator: torch.Generator, rt: Runtime
) -> tuple[torch.Tensor, torch.Tensor]:
    """This process's batch_size rows of one global batch of world_size * batch_size windows."""
    x, y = get_batch(tokens, batch_size * rt.world_size, block_size, generator)
    rows = slice(rt.rank * batch_size, (rt.rank + 1) * batch_size)
    return x[rows].to(rt.device, non_blocking=True), y[rows].to(rt.device, non_blocking=True)


# ---------------------------------------------------------------------------
# Model, one training step, evaluation
# ---------------------------------------------------------------------------


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
                loss = model(x, y).loss / cfg.grad_accum_steps
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
                total += model(x, y).loss.float()
        losses[name] = mean_over_ranks(total / cfg.eval_iters, rt).item()
    model.train()
    return losses


# ---------------------------------------------------------------------------
# Checkpoints: everything the next step depends on
# ---------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """Every random stream training draws from, as tensors and plain lists."""
    version, mt_state, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": [version, list(mt_state), gauss_next],
    }


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, mt_state, gauss_next = state["python"]
    random.setstate((version, tuple(mt_state), gauss_next))


@dataclass
class TrainingState:
    """What the next step depends on; a checkpoint is this, written down."""

    raw_model: GPT
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    data_generator: torch.Generator  # draws the training batches: its state is the data position
    step: int = 0  # optimizer steps done
    best_val_loss: float = math.inf

    def to_checkpoint(self, model_cfg: GPTConfig, cfg: TrainConfig) -> dict[str, Any]:
        return {
            "model": self.raw_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            "step": self.step,
            "best_val_loss": self.best_val_loss,
            "model_config": model_cfg.to_dict(),
            "train_config": cfg.to_dict(),
            "rng": rng_state(),
            "data_state": self.data_generator.get_state(),
            "tokenizer_name": cfg.tokenizer_name,
        }

    def restore(self, ckpt: dict[str, Any], cfg: TrainConfig, rt: Runtime) -> None:
        """Continue from `ckpt` (its weights are already in raw_model)."""
        self.optimizer.load_state_dict(ckpt["optimizer"])
        if ckpt["scaler"] is not None and self.scaler.is_enabled():
            self.scaler.load_state_dict(ckpt["scaler"])
        self.step, self.best_val_loss = ckpt["step"], ckpt["best_val_loss"]
        self.data_generator.set_state(ckpt["data_state"])
        restore_rng(ckpt["rng"])
        if rt.rank > 0:  # only rank 0's streams are saved; the others start fresh, distinct ones
            torch.manual_seed(cfg.seed + rt.rank + self.step * rt.world_size)


def run_paths(checkpoint_path: str | Path) -> tuple[Path, Path]:
    """(run directory, checkpoint to resume from): a path to a .pt file names both."""
    path = Path(checkpoint_path)
    return (path.parent, path) if path.suffix == ".pt" else (path, path / "last.pt")


# ---------------------------------------------------------------------------
# Metrics, the loss curve, a sample of text, Ctrl-C
# ---------------------------------------------------------------------------


class MetricsLog:
    """<run>/metrics.jsonl: one JSON object per step ("train") and per eval ("eval")."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled  # rank 0 writes; the other ranks log nothing

    def write(self, kind: str, **values: Any) -> None:
        if self.enabled:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"kind": kind, **values}) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        lines = self.path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line]

    def keep_up_to(self, step: int) -> None:
        """Drop records past `step` (all of them for 0): a resumed run redoes those steps."""
        if self.enabled:
            kept = [record for record in self.read() if record["step"] <= step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")


def plot_losses(records: list[dict[str, Any]], png_path: Path) -> None:
    """Train loss at every step and train/val loss at every eval, as a PNG."""
    try:
        from matplotlib.figure import Figure  # the object API: no display backend needed
    except ImportError:
        say("matplotlib is not installed, so no loss curve (pip install matplotlib)")
        return
    steps = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.plot(
        [r["step"] for r in steps],
        [r["loss"] for r in steps],
        lw=0.8,
        alpha=0.5,
        label="train (step)",
    )
    ax.plot(
        [r["step"] for r in evals], [r["train_loss"] for r in evals], "o-", label="train (eval)"
    )
    ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="val (eval)")
    ax.set(xlabel="optimizer step", ylabel="cross-entropy (nats)", title="loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(png_path, dpi=120, bbox_inches="tight")


def sample_text(model: GPT, tokenizer: Tokenizer, n_tokens: int, seed: int) -> str:
    """n_tokens from the model, started from end-of-text; temperature 0.8, top-k 200."""
    params = SamplingParams(max_tokens=n_tokens, temperature=0.8, top_k=200, seed=seed)
    result = generate(model.eval(), [tokenizer.eot_id], params, eot_id=tokenizer.eot_id)
    return tokenizer.decode(result.token_ids)


class CtrlC:
    """The first Ctrl-C asks the loop to stop after the current step and save; a second
    one interrupts at once. Stopping between steps keeps the saved state consistent."""

    def __init__(self) -> None:
        self.pressed = False

    def __enter__(self) -> CtrlC:
        self.previous = signal.signal(signal.SIGINT, self.handle)
        return self

    def handle(self, signum: int, frame: Any) -> None:
        self.pressed = True
        signal.signal(signal.SIGINT, self.previous)
        print(f"\n[{PROG}] Ctrl-C: saving after this step (again to quit at once)", file=sys.stderr)

    def __exit__(self, *exc_info: Any) -> None:
        signal.signal(signal.SIGINT, self.previous)


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------


def train(model_cfg: GPTConfig, cfg: TrainConfig) -> dict[str, Any]:
    """Train, evaluate, checkpoint; return a summary (step, losses, tokens/s, sample).

    With cfg.resume, training goes on exactly where the checkpoint at cfg.checkpoint_path
    stopped (`resolve_configs` gives the configs that continue it).
    """
    rt = setup_device(cfg.device, cfg.dtype)
    if rt.device.type == "cpu":
        keep_freed_memory()
    try:
        return _train(model_cfg, cfg, rt)
    finally:
        shutdown(rt)


def start_state(
    model_cfg: GPTConfig, cfg: TrainConfig, rt: Runtime
) -> tuple[TrainingState, nn.Module]:
    """A fresh TrainingState, or the checkpoint's with cfg.resume; and the module that trains."""
    ckpt = load_checkpoint(run_paths(cfg.checkpoint_path)[1]) if cfg.resume else None
    if ckpt is not None and GPTConfig.from_dict(ckpt["model_config"]) != model_cfg:
        raise RoseError(f"the checkpoint's model is not {model_cfg}; see resolve_configs")
    # Each rank its own seed: dropout masks differ between ranks (DDP copies rank 0's weights).
    torch.manual_seed(cfg.seed + rt.rank)
    random.seed(cfg.seed + rt.rank)
    raw_model, model = build_model(model_cfg, cfg, rt, ckpt)
    optimizer = raw_model.configure_optimizer(
        cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), rt.device.type
    )
    scaler = torch.amp.GradScaler(rt.device.type, enabled=cfg.dtype == "float16")
    state = TrainingState(raw_model, optimizer, scaler, torch.Generator().manual_seed(cfg.seed))
    if ckpt is not None:
        state.restore(ckpt, cfg, rt)
    return state, model


def _train(model_cfg: GPTConfig, cfg: TrainConfig, rt: Runtime) -> dict[str, Any]:
    tokenizer = Tokenizer(cfg.tokenizer_name)
    if tokenizer.n_vocab > model_cfg.vocab_size:
        raise RoseError(
            f"tokenizer {cfg.tokenizer_name!r} has {tokenizer.n_vocab} tokens, more than the "
            f"model's vocab_size {model_cfg.vocab_size}"
        )
    splits = load_splits(cfg, rt)
    state, model = start_state(model_cfg, cfg, rt)
    raw_model = state.raw_model

    run_dir = run_paths(cfg.checkpoint_path)[0]
    if rt.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(run_dir / "metrics.jsonl", enabled=rt.is_main)
    log.keep_up_to(state.step)

    def save(name: str) -> None:
        if rt.is_main:
            save_checkpoint(run_dir / name, state.to_checkpoint(model_cfg, cfg))

    def train_batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield rank_batch(
                splits["train"], cfg.batch_size, model_cfg.block_size, state.data_generator, rt
            )

    batches = train_batches()
    tokens_per_step = cfg.batch_size * cfg.grad_accum_steps * model_cfg.block_size * rt.world_size
    if rt.is_main:
        where = (
            f"resuming {run_dir} at step {state.step}" if state.step else f"training into {run_dir}"
        )
        say(
            f"{where}: {raw_model.num_params() / 1e6:.2f}M parameters on {rt.device} ({cfg.dtype}), "
            f"{rt.world_size} process(es), {tokens_per_step:,} tokens per step"
        )
    progress = tqdm(
        total=cfg.max_steps, initial=state.step, desc="train", unit="step", file=sys.stderr,
        disable=not rt.is_main,
    )  # fmt: skip
    first_step, timed_seconds = state.step, 0.0
    losses: dict[str, float] = {}
    with CtrlC() as ctrl_c:
        while state.step < cfg.max_steps:
            lr = learning_rate_at(state.step, cfg)
            for group in state.optimizer.param_groups:
                group["lr"] = lr
            started = time.perf_counter()
            loss, grad_norm = train_step(model, state.optimizer, state.scaler, batches, cfg, rt)
            # One all-reduce for both: the loss to log, and whether any rank saw Ctrl-C.
            stop_flag = torch.tensor(float(ctrl_c.pressed), device=rt.device)
            loss, stop = mean_over_ranks(torch.stack([loss, stop_flag]), rt).tolist()
            seconds = time.perf_counter() - started
            state.step += 1
            if state.step > first_step + 1:  # the first step pays for warm-up (allocation, compile)
                timed_seconds += seconds
            tokens_per_s = tokens_per_step / seconds
            progress.set_postfix(
                loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}", refresh=False
            )
            progress.update()
            metrics = {
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm.item(),
                "tokens_per_s": tokens_per_s,
            }
            log.write("train", step=state.step, **metrics)

            if state.step % cfg.eval_interval == 0 or state.step == cfg.max_steps:
                losses = evaluate(model, splits, cfg, model_cfg.block_size, rt)
                improved = losses["val"] < state.best_val_loss
                state.best_val_loss = min(state.best_val_loss, losses["val"])
                save("last.pt")
                if improved:
                    save("best.pt")
                train_loss, val_loss, ppl = losses["train"], losses["val"], math.exp(losses["val"])
                log.write(
                    "eval", step=state.step, train_loss=train_loss, val_loss=val_loss, val_ppl=ppl
                )
                if rt.is_main:
                    say(
                        f"step {state.step}: train loss {train_loss:.4f}, val loss {val_loss:.4f} (ppl {ppl:.1f})"
                    )
            elif stop:
                save("last.pt")
            if stop:
                break
    progress.close()

    timed_steps = state.step - first_step - 1
    summary = {
        "step": state.step,
        "interrupted": state.step < cfg.max_steps,
        "train_loss": losses.get("train"),
        "val_loss": losses.get("val"),
        "best_val_loss": state.best_val_loss,
        "tokens_per_s": timed_steps * tokens_per_step / timed_seconds if timed_seconds else None,
        "run_dir": str(run_dir),
    }
    if rt.is_main:
        summary["sample"] = finish(summary, log, raw_model, tokenizer, cfg)
    return summary


def finish(
    summary: dict[str, Any], log: MetricsLog, model: GPT, tokenizer: Tokenizer, cfg: TrainConfig
) -> str | None:
    """The last words of a run: where it stopped, the loss curve, a sample of text."""
    run_dir = summary["run_dir"]
    if summary["interrupted"]:
        say(
            f"interrupted at step {summary['step']}: saved {run_dir}/last.pt; continue with --resume"
        )
        return None
    val_loss, tokens_per_s = summary["val_loss"], summary["tokens_per_s"]
    speed = f"{tokens_per_s:,.0f} tokens/s; " if tokens_per_s else ""
    say(
        f"step {summary['step']}: val loss {val_loss:.4f} (ppl {math.exp(val_loss):.1f}), "
        f"best {summary['best_val_loss']:.4f}; {speed}checkpoints in {run_dir}"
    )
    plot_losses(log.read(), Path(run_dir) / "loss.png")
    if not cfg.sample_tokens:
        return None
    sample = sample_text(model, tokenizer, cfg.sample_tokens, cfg.seed)
    print(f"[{PROG}] sample:\n{sample}")
    return sample


# ---------------------------------------------------------------------------
# Configs from the command line, a config file, a checkpoint
# ---------------------------------------------------------------------------

MODEL_FIELDS = {f.name for f in dataclasses.fields(GPTConfig)}
TRAIN_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)} - {"extra"}
# What a resumed run may change: how long it runs, and where and how it computes;
# never the data, the batch or the optimizer settings, which would make it another run.
RESUME_OVERRIDES = {
    "max_steps", "lr_decay_steps", "eval_interval", "eval_iters", "sample_tokens",
    "checkpoint_path", "data_dir", "resume", "device", "dtype", "compile",
    "activation_checkpointing",
}  # fmt: skip


def config_section(config_file: dict[str, Any], name: str) -> dict[str, Any]:
    section = config_file.get(name, {})
    if not isinstance(section, dict):
        raise RoseError(f"config file: [{name}] must be a table/object of settings")
    return section


def resolve_configs(flags: dict[str, Any]) -> tuple[GPTConfig, TrainConfig]:
    """Model and train config from defaults < preset < config file < flags.

    With resume the checkpoint decides the model and the training settings; flags and
    the file may only agree with it, or change RESUME_OVERRIDES.
    """
    config_file = load_config_file(flags["config"]) if "config" in flags else {}
    preset = flags.get("preset", config_file.get("preset", "tiny"))
    model_values = {**config_section(config_file, "model")}
    model_values.update({k: v for k, v in flags.items() if k in MODEL_FIELDS})
    train_values = {**config_section(config_file, "train")}
    train_values.update({k: v for k, v in flags.items() if k in TRAIN_FIELDS})
    train_values.setdefault("checkpoint_path", f"checkpoints/{preset}")

    if not train_values.get("resume"):
        model_cfg = GPTConfig.from_dict({**GPTConfig.from_preset(preset).to_dict(), **model_values})
        return model_cfg, TrainConfig.from_dict(train_values)
    ckpt = load_checkpoint(run_paths(train_values["checkpoint_path"])[1])
    if "preset" in flags or "preset" in config_file:  # a preset named on resume must match too
        model_values = {**GPTConfig.from_preset(preset).to_dict(), **model_values}
    return resume_configs(ckpt, model_values, train_values)


def resume_configs(
    ckpt: dict[str, Any], model_values: dict[str, Any], train_values: dict[str, Any]
) -> tuple[GPTConfig, TrainConfig]:
    """The checkpoint's configs, with the few train settings a resumed run may change."""
    needed = ("train_config", "optimizer", "scaler", "step", "best_val_loss", "rng", "data_state")
    missing = [key for key in needed if key not in ckpt]
    if missing:
        raise RoseError(
            f"the checkpoint has no {', '.join(missing)}: it holds weights only, so training "
            f"cannot resume from it (start a new run without --resume)"
        )
    saved_model = GPTConfig.from_dict(ckpt["model_config"])
    asked_model = GPTConfig.from_dict({**saved_model.to_dict(), **model_values})
    if asked_model.block_size > saved_model.block_size:
        raise RoseError(
            f"block_size {asked_model.block_size} is larger than the checkpoint's "
            f"{saved_model.block_size}: its model learned positions only up to there"
        )
    differ = [
        f"{k}={v!r} (checkpoint: {getattr(saved_model, k)!r})"
        for k, v in model_values.items()
        if getattr(saved_model, k) != v
    ]
    if differ:
        raise RoseError(
            f"resume keeps the checkpoint's model, so it cannot change {', '.join(differ)}; "
            f"drop those settings"
        )
    saved = ckpt["train_config"]
    differ = [
        f"{k}={v!r} (checkpoint: {saved.get(k)!r})"
        for k, v in train_values.items()
        if k not in RESUME_OVERRIDES and saved.get(k) != v
    ]
    if differ:
        raise RoseError(
            f"resume continues the checkpoint's run, which cannot change {', '.join(differ)}; "
            f"drop those settings, or start a new run"
        )
    # Unless asked, the schedule keeps its length: a run extended past it stays at min_lr.
    decay_steps = saved["lr_decay_steps"] or saved["max_steps"]
    train_cfg = TrainConfig.from_dict(
        {**saved, "lr_decay_steps": decay_steps, **train_values, "resume": True}
    )
    if ckpt["step"] >= train_cfg.max_steps:
        raise RoseError(
            f"the checkpoint is at step {ckpt['step']}, max_steps is {train_cfg.max_steps}: "
            f"pass --max-steps larger than {ckpt['step']} to train on"
        )
    return saved_model, train_cfg


def parse_args(argv: list[str] | None = None) -> dict[str, Any]:
    """Only the flags actually given (argparse.SUPPRESS), so that they can override a file."""
    parser = argparse.ArgumentParser(
        prog="python -m rosetrainer.train",
        usage="%(prog)s [options]  (--help lists them)",
        description="Train a GPT on a text (default: the tiny preset on TinyShakespeare).",
        argument_default=argparse.SUPPRESS,
    )
    add = parser.add_argument
    add("--preset", help=f"model shape: {', '.join(PRESETS)} (default tiny)")
    add("--config", help="a JSON or TOML file {preset, model: {...}, train: {...}}; flags win")
    add("--text-file", help="train on this local text file instead of --dataset")
    add("--dataset", help="tinyshakespeare (default) or a Hugging Face dataset name")
    add("--data-dir", help="where token .bin files are cached (default data)")
    add(
        "--checkpoint-path", help="run directory (default checkpoints/<preset>), or a .pt to resume"
    )
    add("--resume", action=argparse.BooleanOptionalAction, help="continue from <run>/last.pt")
    for name in ("max_steps", "lr_decay_steps", "batch_size", "grad_accum_steps", "warmup_steps",
                 "eval_interval", "eval_iters", "sample_tokens", "seed"):  # fmt: skip
        add("--" + name.replace("_", "-"), type=int)
    for name in ("learning_rate", "min_lr", "weight_decay", "grad_clip"):
        add("--" + name.replace("_", "-"), type=float)
    for name in ("block_size", "n_layer", "n_head", "n_embd"):
        add("--" + name.replace("_", "-"), type=int, help="override the preset")
    add("--dropout", type=float, help="override the preset")
    add("--activation-checkpointing", action=argparse.BooleanOptionalAction,
        help="recompute each block in backward: less memory, about 1/3 more compute")  # fmt: skip
    add("--device", help="auto (default), cpu, cuda or cuda:N")
    add("--dtype", help="float32 (default), bfloat16 or float16 (CUDA only)")
    add("--compile", action=argparse.BooleanOptionalAction, help="torch.compile the model")
    add("--num-threads", type=int, help="CPU threads for PyTorch (default: one per core)")
    return vars(parser.parse_args(argv))


def cli(argv: list[str] | None = None) -> int:
    """The command line: parse, resolve the configs, train. Returns the exit code."""
    flags = parse_args(argv)
    if "num_threads" in flags:
        if flags["num_threads"] < 1:
            raise RoseError(f"--num-threads must be >= 1, got {flags['num_threads']}")
        torch.set_num_threads(flags["num_threads"])
    model_cfg, train_cfg = resolve_configs(flags)
    try:
        summary = train(model_cfg, train_cfg)
    except KeyboardInterrupt:  # a second Ctrl-C, or one before training started
        print(f"[{PROG}] interrupted; nothing saved", file=sys.stderr)
        return 130
    return 130 if summary["interrupted"] else 0


def main() -> None:
    run_cli(cli, "rosetrainer.train")


if __name__ == "__main__":
    main()
