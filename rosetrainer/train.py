"""Train a GPT from the command line: python -m rosetrainer.train (or rose-train).

Flags, a --config file, a preset and a checkpoint each say something about the run;
`resolve_configs` decides, in one place, what wins (defaults < preset < config file <
flags; on --resume the checkpoint's settings, which flags may only agree with or
extend), and `rosetrainer.trainer.train` runs it.

Where the run lives follows one rule (rosetrainer.checkpoint.RunFiles): a path ending
in .pt is that checkpoint file, with its best/metrics siblings beside it; any other
path is a run directory (last.pt, best.pt, metrics.jsonl, loss.png).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from rosetrainer.checkpoint import RunFiles, load_checkpoint
from rosetrainer.config import (
    PRESETS,
    TRAINING_VOCAB_MULTIPLE,
    GPTConfig,
    TrainConfig,
    load_config_file,
)
from rosetrainer.errors import ArgumentParser, RoseError, run_cli
from rosetrainer.runtime import exit_torchrun_worker, is_torchrun_worker
from rosetrainer.signals import Terminated
from rosetrainer.threads import Threads
from rosetrainer.trainer import train

PROG = "rosetrainer.train"

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
    "activation_checkpointing", "accept_different_data",
}  # fmt: skip
# Choices that hold for one command only, never carried over from a checkpoint.
ONE_TIME_CHOICES = {"resume": False, "overwrite": False, "accept_different_data": False}


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

    preset_values = GPTConfig.from_preset(preset).to_dict()
    del preset_values["vocab_multiple"]  # (a choice of the trainer's, below, not a shape's)
    if train_values.get("resume") is not True:  # (TrainConfig says what else it may be)
        # A new run pads its vocabulary for faster products (GPTConfig.vocab_multiple).
        padding = {"vocab_multiple": TRAINING_VOCAB_MULTIPLE}
        model_cfg = GPTConfig.from_dict({**preset_values, **padding, **model_values})
        return model_cfg, TrainConfig.from_dict(train_values)
    if train_values.get("overwrite"):
        raise RoseError("--resume continues a run, --overwrite replaces it: pass one of them")
    ckpt = load_checkpoint(RunFiles.of(train_values["checkpoint_path"]).last)
    if "preset" in flags or "preset" in config_file:  # a preset named on resume must match too
        model_values = {**preset_values, **model_values}
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
    saved_model = resumed_model(ckpt, model_values)
    saved = ckpt["train_config"]
    if not isinstance(saved, dict):
        raise RoseError("the checkpoint's train_config is damaged (not a dict); start a new run")
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
    decay_steps = saved.get("lr_decay_steps") or saved.get("max_steps")
    train_cfg = TrainConfig.from_dict(
        {**saved, "lr_decay_steps": decay_steps, **ONE_TIME_CHOICES, **train_values, "resume": True}
    )
    if not isinstance(ckpt["step"], int):
        raise RoseError(f"the checkpoint's step is damaged ({ckpt['step']!r}); start a new run")
    if ckpt["step"] >= train_cfg.max_steps:
        raise RoseError(
            f"the checkpoint is at step {ckpt['step']}, max_steps is {train_cfg.max_steps}: "
            f"pass --max-steps larger than {ckpt['step']} to train on"
        )
    return saved_model, train_cfg


def resumed_model(ckpt: dict[str, Any], model_values: dict[str, Any]) -> GPTConfig:
    """The checkpoint's model config; the flags and the file may only agree with it."""
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
    return saved_model


def build_parser() -> argparse.ArgumentParser:
    """Every flag defaults to absent (argparse.SUPPRESS), so that a given one overrides a file."""
    parser = ArgumentParser(
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
    add("--checkpoint-path", help="a run directory (default checkpoints/<preset>) or a .pt file "
        "(run/a.pt: writes run/a.pt, run/a.best.pt, run/a.metrics.jsonl)")  # fmt: skip
    add("--resume", action="store_true", help="continue the run at --checkpoint-path")
    add("--overwrite", action="store_true", help="replace the run at --checkpoint-path")
    add("--accept-different-data", action="store_true",
        help="--resume even though the training text changed since the checkpoint")  # fmt: skip
    for name in ("max_steps", "lr_decay_steps", "batch_size", "grad_accum_steps", "warmup_steps",
                 "eval_interval", "eval_iters", "sample_tokens", "seed"):  # fmt: skip
        add("--" + name.replace("_", "-"), type=int)
    for name in ("learning_rate", "min_lr", "weight_decay", "grad_clip"):
        add("--" + name.replace("_", "-"), type=float)
    for name in ("block_size", "n_layer", "n_head", "n_kv_head", "n_embd"):
        add("--" + name.replace("_", "-"), type=int, help="override the preset")
    add("--dropout", type=float, help="override the preset")
    add("--vocab-multiple", type=int,
        help=f"pad the embedding and output matrix to a multiple of N rows (default "
             f"{TRAINING_VOCAB_MULTIPLE}: faster on a GPU; the padding is no token, and "
             f"exports drop it); 1: none")  # fmt: skip
    add("--position-embedding", choices=("learned", "rotary"),
        help="learned (GPT-2's table, default) or rotary (RoPE, as in Llama)")  # fmt: skip
    add("--sliding-window", type=int, help="each token attends to the last N tokens only")
    add("--attention-sinks", type=int,
        help="the first N tokens stay visible beside the sliding window")  # fmt: skip
    add("--activation-checkpointing", action=argparse.BooleanOptionalAction,
        help="recompute each block in backward: less memory, about 1/3 more compute")  # fmt: skip
    add("--device", help="auto (default), cpu, cuda or cuda:N")
    add("--dtype", help="float32 (default), bfloat16 or float16 (CUDA only)")
    add("--compile", action=argparse.BooleanOptionalAction, help="torch.compile the model")
    add("--num-threads", type=int,
        help="CPU threads for PyTorch, fixed (default: auto, one per core while the cores are "
             "free, fewer while other programs keep them busy; OMP_NUM_THREADS fixes it too)")  # fmt: skip
    return parser


def parse_args(argv: list[str] | None = None) -> dict[str, Any]:
    """Only the flags actually given, so that they can override a file."""
    return vars(build_parser().parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    """The command line: parse, resolve the configs, train. Returns the exit code (a
    torchrun worker exits with it instead: `runtime.exit_torchrun_worker` says why)."""
    code = run_cli(lambda: _main(argv), PROG)
    if is_torchrun_worker():
        exit_torchrun_worker(code)
    return code


def _main(argv: list[str] | None) -> int:
    flags = parse_args(argv)
    model_cfg, train_cfg = resolve_configs(flags)
    # (compiled code keeps the thread count it was built for: chosen once, at the start)
    threads = Threads(flags.get("num_threads"), follow_load=not train_cfg.compile)
    try:
        summary = train(model_cfg, train_cfg, threads)
    except Terminated as stop:  # SIGTERM before training started (or a second one)
        print(f"[{PROG}] SIGTERM: interrupted; nothing saved", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:  # a second Ctrl-C, or one before training started
        print(f"[{PROG}] interrupted; nothing saved", file=sys.stderr)
        return 130
    return summary["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
