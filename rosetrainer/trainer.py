"""The training run, top to bottom: python -m rosetrainer.train calls `train`.

Pick the device (and, under torchrun, join the other processes), claim the run
(`open_run`: its files checked and locked), tokenize the text once into cached .bin
files, build the model and AdamW (or restore them from the checkpoint), then loop: a
learning rate from the schedule, one optimizer step over grad_accum_steps
micro-batches, one line in metrics.jsonl. Every eval_interval steps, and at the end,
train/val loss and a checkpoint; at the very end a loss curve and a sample of text.

Nothing non-finite is ever saved: a loss that becomes NaN or infinite stops the run
with an error, and the checkpoints on disk stay those of the last good eval.
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from rosetrainer.checkpoint import RunFiles, check_finite, load_checkpoint, save_checkpoint
from rosetrainer.config import GPTConfig, TrainConfig
from rosetrainer.errors import RoseError
from rosetrainer.metrics import MetricsLog, plot_losses
from rosetrainer.run import describe_run, open_run
from rosetrainer.runtime import Runtime, keep_freed_memory, mean_over_ranks, setup_device, shutdown
from rosetrainer.sample import sample_text
from rosetrainer.schedule import learning_rate_at
from rosetrainer.signals import StopSignals, setup_interrupts
from rosetrainer.state import TrainingState
from rosetrainer.step import build_model, evaluate, load_splits, rank_batch, train_step
from rosetrainer.threads import Threads
from rosetrainer.tokenizer import Tokenizer

PROG = "rosetrainer"
# Steps timed, after the first (warm-up) one, before the run's length is estimated.
ESTIMATE_AFTER_STEPS = 5


def say(message: str) -> None:
    """A status line on stdout that does not tear the progress bar."""
    tqdm.write(f"[{PROG}] {message}", file=sys.stdout)


@dataclass
class Run:
    """Everything one training run works with, built by `start_run`."""

    model_cfg: GPTConfig
    cfg: TrainConfig
    rt: Runtime
    files: RunFiles
    splits: dict[str, np.memmap]
    state: TrainingState
    model: nn.Module  # what trains: state.raw_model, maybe compiled and DDP-wrapped
    log: MetricsLog
    tokens_per_step: int
    losses: dict[str, float] = field(default_factory=dict)  # of the latest eval

    def save(self, path: Path) -> None:
        """Write the training state to `path` (rank 0), never a model holding NaN or inf."""
        if self.rt.is_main:
            check_finite(self.state.raw_model.state_dict(), f"the model at step {self.state.step}")
            save_checkpoint(path, self.state.to_checkpoint(self.model_cfg, self.cfg))

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        tokens, block_size = self.splits["train"], self.model_cfg.block_size
        while True:
            yield rank_batch(tokens, self.cfg.batch_size, block_size, self.state.data_generator,
                             self.rt)  # fmt: skip


def train(model_cfg: GPTConfig, cfg: TrainConfig, threads: Threads | None = None) -> dict[str, Any]:
    """Train, evaluate, checkpoint; return a summary (step, losses, tokens/s, sample).

    With cfg.resume, training goes on exactly where the checkpoint at cfg.checkpoint_path
    stopped (`rosetrainer.train.resolve_configs` gives the configs that continue it).
    threads: the CPU's torch threads (default: auto, rosetrainer/threads.py).
    """
    threads = Threads() if threads is None else threads
    rt = setup_device(cfg.device, cfg.dtype)
    if rt.device.type == "cpu":
        keep_freed_memory()
    try:
        # (SIGTERM from before the lock is taken: the lock file is removed however it ends)
        with setup_interrupts(), open_run(cfg, rt.is_main) as files:
            run = start_run(model_cfg, cfg, rt, files)
            summary = train_loop(run, threads)
            if rt.is_main:
                summary["sample"] = finish(summary, run)
            return summary
    finally:
        shutdown(rt)


def start_run(model_cfg: GPTConfig, cfg: TrainConfig, rt: Runtime, files: RunFiles) -> Run:
    """Data, model, optimizer: fresh, or the checkpoint's with cfg.resume. Only once all of
    that worked are an overwritten run's files removed, or a resumed run's metrics cut back."""
    tokenizer = Tokenizer(cfg.tokenizer_name)
    if tokenizer.n_vocab > model_cfg.vocab_size:
        raise RoseError(
            f"tokenizer {cfg.tokenizer_name!r} has {tokenizer.n_vocab} tokens, more than the "
            f"model's vocab_size {model_cfg.vocab_size}"
        )
    splits, data_sha256 = load_splits(cfg, rt, model_cfg.block_size)
    ckpt = load_checkpoint(files.last) if cfg.resume else None
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
    generator = torch.Generator().manual_seed(cfg.seed)
    state = TrainingState(raw_model, optimizer, scaler, generator, data_sha256)
    if ckpt is not None:
        state.restore(ckpt, f"checkpoint {files.last}", cfg, rt)
        state.check_data(ckpt, cfg)
    log = MetricsLog(files.metrics, enabled=rt.is_main)
    if rt.is_main and cfg.overwrite and not cfg.resume and files.existing():
        say(f"--overwrite: removing the run at {files.folder} ({describe_run(files)})")
        for path in files.existing():
            path.unlink()
    if log.keep_up_to(state.step):
        say(f"{files.metrics}: dropped a torn last line (a crash or full disk mid-write)")
    tokens_per_step = cfg.batch_size * cfg.grad_accum_steps * model_cfg.block_size * rt.world_size
    return Run(model_cfg, cfg, rt, files, splits, state, model, log, tokens_per_step)


def train_loop(run: Run, threads: Threads) -> dict[str, Any]:
    """Steps until max_steps or a stop signal; a summary of the run."""
    state, cfg, rt = run.state, run.cfg, run.rt
    if rt.is_main:
        where = f"resuming {run.files.last} at step {state.step}" if state.step else (
            f"training into {run.files.last}")  # fmt: skip
        say(
            f"{where}: {state.raw_model.num_params() / 1e6:.2f}M parameters on {rt.device} "
            f"({cfg.dtype}), {rt.world_size} process(es), {run.tokens_per_step:,} tokens per step"
        )
        if rt.device.type == "cpu":
            say(f"threads: {threads.describe()}")
    progress = tqdm(total=cfg.max_steps, initial=state.step, desc="train", unit="step",
                    file=sys.stderr, disable=not rt.is_main)  # fmt: skip
    first_step, timed_seconds, batches = state.step, 0.0, run.batches()
    with StopSignals(PROG) as stop_signals:
        while state.step < cfg.max_steps:
            threads.adapt()  # (the first call sets the count; then it follows the load)
            seconds, stop = one_step(run, batches, progress, stop_signals)
            if state.step > first_step + 1:  # the first step pays for warm-up (allocation, compile)
                timed_seconds += seconds
                if state.step == first_step + 1 + ESTIMATE_AFTER_STEPS and rt.is_main:
                    say(time_estimate(timed_seconds / ESTIMATE_AFTER_STEPS, run))
            if state.step % cfg.eval_interval == 0 or state.step == cfg.max_steps:
                eval_and_save(run)
            elif stop:
                run.save(run.files.last)
            if stop:
                break
    progress.close()
    timed_steps = state.step - first_step - 1
    return {
        "step": state.step,
        "interrupted": state.step < cfg.max_steps,
        "exit_code": stop_signals.exit_code if state.step < cfg.max_steps else 0,
        "train_loss": run.losses.get("train"),
        "val_loss": run.losses.get("val"),
        "best_val_loss": state.best_val_loss,
        "tokens_per_s": timed_steps * run.tokens_per_step / timed_seconds
        if timed_seconds
        else None,
        "run_dir": str(run.files.folder),
        "checkpoint": str(run.files.last),
    }


def time_estimate(step_seconds: float, run: Run) -> str:
    """The rest of the run, from the steps timed so far: one line a newcomer can act on.

    Evaluations are counted too: each runs eval_iters batches of both splits forward
    only, and a forward pass costs about a third of a training step's forward + backward
    (per micro-batch; a step has grad_accum_steps of them).
    """
    cfg, step = run.cfg, run.state.step
    evals = cfg.max_steps // cfg.eval_interval - step // cfg.eval_interval
    evals += cfg.max_steps % cfg.eval_interval != 0  # the final one at max_steps
    eval_seconds = 2 * cfg.eval_iters * step_seconds / (3 * cfg.grad_accum_steps)
    minutes = ((cfg.max_steps - step) * step_seconds + evals * eval_seconds) / 60
    whole = round(minutes)
    about = "under a minute" if minutes < 1 else f"about {whole} minute{'s' * (whole != 1)}"
    return (
        f"{about} on this machine for the {cfg.max_steps - step} steps left "
        f"({step_seconds:.2f} s a step over the last {ESTIMATE_AFTER_STEPS})"
    )


def one_step(
    run: Run, batches: Iterator, progress: tqdm, stop_signals: StopSignals
) -> tuple[float, bool]:
    """One optimizer step, logged: (its seconds, whether any rank was asked to stop)."""
    state = run.state
    lr = learning_rate_at(state.step, run.cfg)
    for group in state.optimizer.param_groups:
        group["lr"] = lr
    started = time.perf_counter()
    loss, grad_norm = train_step(model=run.model, optimizer=state.optimizer, scaler=state.scaler,
                                 batches=batches, cfg=run.cfg, rt=run.rt)  # fmt: skip
    # One all-reduce for both: the loss to log, and whether any rank was asked to stop.
    stop_flag = torch.tensor(float(stop_signals.signum is not None), device=run.rt.device)
    loss, stop = mean_over_ranks(torch.stack([loss, stop_flag]), run.rt).tolist()
    seconds = time.perf_counter() - started
    state.step += 1
    check_loss(loss, "training", run)
    tokens_per_s = run.tokens_per_step / seconds
    progress.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}",
                         refresh=False)  # fmt: skip
    progress.update()
    run.log.write("train", step=state.step, loss=loss, lr=lr, grad_norm=grad_norm.item(),
                  tokens_per_s=tokens_per_s)  # fmt: skip
    return seconds, bool(stop)


def check_loss(loss: float, which: str, run: Run) -> None:
    """Stop the run at the first non-finite loss, before anything of it is saved."""
    if math.isfinite(loss):
        return
    kept = f"{run.files.last} keeps its last good state" if run.files.last.exists() else (
        "nothing was saved")  # fmt: skip
    raise RoseError(
        f"the {which} loss became {loss} at step {run.state.step}; stopped, and {kept}: lower "
        f"--learning-rate, raise --warmup-steps, or set --grad-clip"
    )


def eval_and_save(run: Run) -> None:
    """Train and val loss, last.pt (and best.pt when val improved), one log line."""
    state = run.state
    run.losses = losses = evaluate(run.model, run.splits, run.cfg, run.model_cfg.block_size, run.rt)
    check_loss(losses["val"], "validation", run)
    improved = losses["val"] < state.best_val_loss
    state.best_val_loss = min(state.best_val_loss, losses["val"])
    run.save(run.files.last)
    if improved:
        run.save(run.files.best)
    train_loss, val_loss, ppl = losses["train"], losses["val"], math.exp(losses["val"])
    run.log.write("eval", step=state.step, train_loss=train_loss, val_loss=val_loss, val_ppl=ppl)
    if run.rt.is_main:
        say(f"step {state.step}: train loss {train_loss:.4f}, val loss {val_loss:.4f} "
            f"(ppl {ppl:.1f})")  # fmt: skip


def finish(summary: dict[str, Any], run: Run) -> str | None:
    """The last words of a run: where it stopped, the loss curve, a sample of text."""
    if summary["interrupted"]:
        say(f"interrupted at step {summary['step']}: saved {run.files.last}; continue with "
            f"--resume")  # fmt: skip
        return None
    val_loss, tokens_per_s = summary["val_loss"], summary["tokens_per_s"]
    speed = f"{tokens_per_s:,.0f} tokens/s; " if tokens_per_s else ""
    say(
        f"step {summary['step']}: val loss {val_loss:.4f} (ppl {math.exp(val_loss):.1f}), "
        f"best {summary['best_val_loss']:.4f}; {speed}checkpoint {run.files.last}"
    )
    if not plot_losses(run.log.read()[0], run.files.plot):
        say("matplotlib is not installed, so no loss curve (pip install matplotlib)")
    if not run.cfg.sample_tokens:
        return None
    tokenizer = Tokenizer(run.cfg.tokenizer_name)
    sample = sample_text(run.state.raw_model, tokenizer, run.cfg.sample_tokens, run.cfg.seed)
    print(f"[{PROG}] sample:\n{sample}")
    return sample
