"""Model and training configuration: dataclasses, named presets, JSON/TOML files.

Config files are data: they are parsed (json / tomllib), never executed.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rosetrainer.errors import RoseError


@dataclass
class GPTConfig:
    vocab_size: int = 50257  # GPT-2's BPE: 50,000 merges + 256 bytes + <|endoftext|>
    block_size: int = 1024  # the context window: learned positions exist only up to here
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # GPT-2 has biases in its Linears and LayerNorms

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RoseError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise RoseError(
                f"model config: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise RoseError(f"model config: dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GPTConfig:
        return cls(**_known_keys(cls, values, "model config"))

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> GPTConfig:
        if name not in PRESETS:
            raise RoseError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


# Named shapes. `tiny` is the CPU quickstart model; the others are OpenAI's GPT-2 sizes.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024),
}


@dataclass
class TrainConfig:
    # data
    text_file: str | None = None  # a local text file; overrides `dataset`
    dataset: str = "tinyshakespeare"  # or a Hugging Face dataset name (needs the network)
    data_dir: str = "data"  # where the token .bin files are cached
    tokenizer_name: str = "gpt2"
    val_fraction: float = 0.1
    # batch: batch_size * grad_accum_steps sequences of block_size tokens per optimizer step
    batch_size: int = 8
    grad_accum_steps: int = 1
    # optimisation
    max_steps: int = 500
    lr_decay_steps: int | None = None  # length of the cosine decay; None: max_steps
    learning_rate: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    # evaluation, logging, checkpoints
    eval_interval: int = 100
    eval_iters: int = 10
    checkpoint_path: str = "checkpoints/tiny"  # a run directory: last.pt, best.pt, metrics
    resume: bool = False
    sample_tokens: int = 120
    # hardware
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "float32"  # float32 | bfloat16 | float16 (autocast; fp16 only on CUDA)
    compile: bool = False
    activation_checkpointing: bool = False
    seed: int = 1337
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        positive = ("batch_size", "grad_accum_steps", "max_steps", "eval_interval", "eval_iters")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RoseError(f"train config: {name} must be a positive integer, got {value!r}")
        decay = self.lr_decay_steps
        if decay is not None and (
            not isinstance(decay, int) or isinstance(decay, bool) or decay < 1
        ):
            raise RoseError(
                f"train config: lr_decay_steps must be a positive integer, got {decay!r}"
            )
        if self.warmup_steps < 0 or self.sample_tokens < 0:
            raise RoseError("train config: warmup_steps and sample_tokens must be >= 0")
        if not (self.learning_rate > 0 and 0 <= self.min_lr <= self.learning_rate):
            raise RoseError(
                f"train config: need learning_rate > 0 and 0 <= min_lr <= learning_rate, "
                f"got learning_rate={self.learning_rate}, min_lr={self.min_lr}"
            )
        if not 0.0 < self.val_fraction < 1.0:
            raise RoseError(
                f"train config: val_fraction must be in (0, 1), got {self.val_fraction}"
            )
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise RoseError("train config: grad_clip and weight_decay must be >= 0")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise RoseError(f"train config: device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise RoseError(
                f"train config: dtype must be float32, bfloat16 or float16, got {self.dtype!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values.pop("extra")
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        return cls(**_known_keys(cls, values, "train config"))


def _known_keys(cls: type, values: dict[str, Any], what: str) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls) if f.name != "extra"}
    unknown = sorted(set(values) - names)
    if unknown:
        raise RoseError(
            f"{what}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}"
        )
    return dict(values)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON or TOML config: {"preset": ..., "model": {...}, "train": {...}}."""
    path = Path(path)
    if not path.is_file():
        raise RoseError(f"config file not found: {path}")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except ValueError as err:  # json.JSONDecodeError and tomllib.TOMLDecodeError both are
        raise RoseError(f"config file {path} does not parse: {err}") from None
    if not isinstance(data, dict):
        raise RoseError(f"config file {path} must hold a table/object at the top level")
    unknown = sorted(set(data) - {"preset", "model", "train"})
    if unknown:
        raise RoseError(
            f"config file {path}: unknown section(s) {', '.join(unknown)}; use preset, model, train"
        )
    return data
