"""Model and training configuration: dataclasses, named presets, JSON/TOML files.

Config files are data: they are parsed (json / tomllib), never executed.
"""

from __future__ import annotations

import dataclasses
import json
import math
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
    # "learned": GPT-2's table of block_size positions, added to the token embeddings;
    # "rotary": no table, each head's queries and keys are turned by an angle per
    # position (RoPE, as in Llama), so attention scores depend on distances only.
    position_embedding: str = "learned"
    # Each query sees only the last sliding_window keys (itself included), as in
    # Mistral; None: every earlier key. attention_sinks: the first tokens stay visible to
    # every query besides the window (StreamingLLM's sinks); needs a window.
    sliding_window: int | None = None
    attention_sinks: int = 0
    # The choices that make the block Llama-shaped (each default is GPT-2's):
    # n_kv_head: key/value heads, fewer than the query heads in grouped-query attention
    # (each serves n_head / n_kv_head query heads; 1 is multi-query); None: n_head.
    n_kv_head: int | None = None
    norm: str = "layernorm"  # or "rmsnorm": no mean subtracted, no bias (Llama)
    norm_eps: float = 1e-5
    # "gelu": GPT-2's up-projection, tanh GELU, down-projection; "swiglu": silu(gate) * up,
    # then down (Llama). mlp_hidden: the width between; None: 4 * n_embd.
    mlp: str = "gelu"
    mlp_hidden: int | None = None
    qkv_bias: bool = False  # biases on the query/key/value projection even without `bias` (Qwen2)
    tie_embeddings: bool = True  # the output matrix is the token embedding (GPT-2, SmolLM2)
    rotary_base: float = 10000.0  # the base of the rotary angles (Llama 3: 500,000)
    # The embedding and the output matrix get vocab_size rows rounded up to a multiple of
    # this: products over 50,304 rows (786 x 64) run faster on a GPU than over GPT-2's
    # 50,257. The extra rows are no token: never an input, their logits never returned nor
    # scored by the loss, and dropped on export. rose-train pads by TRAINING_VOCAB_MULTIPLE;
    # 1 (no padding) is also what a config saved before this field existed means.
    vocab_multiple: int = 1

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "vocab_multiple"):
            check_int("model config", name, getattr(self, name), minimum=1)
        if self.n_embd % self.n_head != 0:
            raise RoseError(
                f"model config: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if self.n_kv_head is not None:
            check_int("model config", "n_kv_head", self.n_kv_head, minimum=1)
            if self.n_head % self.n_kv_head:
                raise RoseError(
                    f"model config: n_head ({self.n_head}) must be divisible by n_kv_head "
                    f"({self.n_kv_head}): each key/value head serves a whole group of query heads"
                )
        check_number("model config", "dropout", self.dropout, 0.0, 1.0, "[0, 1)")
        for name in ("bias", "qkv_bias", "tie_embeddings"):
            check_bool("model config", name, getattr(self, name))
        check_choice("model config", "norm", self.norm, ("layernorm", "rmsnorm"))
        check_number("model config", "norm_eps", self.norm_eps, 0.0, 1.0, "(0, 1)")
        check_choice("model config", "mlp", self.mlp, ("gelu", "swiglu"))
        if self.mlp_hidden is not None:
            check_int("model config", "mlp_hidden", self.mlp_hidden, minimum=1)
        check_number("model config", "rotary_base", self.rotary_base, 1.0, math.inf, "(1, inf)")
        if self.position_embedding not in ("learned", "rotary"):
            raise RoseError(
                f"model config: position_embedding must be learned or rotary, "
                f"got {self.position_embedding!r}"
            )
        if self.position_embedding == "rotary" and self.head_dim % 2:
            raise RoseError(
                f"model config: rotary positions turn pairs of channels, so the head size "
                f"n_embd / n_head must be even, got {self.head_dim}"
            )
        if self.sliding_window is not None:
            check_int("model config", "sliding_window", self.sliding_window, minimum=1)
        check_int("model config", "attention_sinks", self.attention_sinks, minimum=0)
        if self.attention_sinks and self.sliding_window is None:
            raise RoseError(
                "model config: attention_sinks keep tokens visible beside a sliding window; "
                "set sliding_window too (or attention_sinks = 0)"
            )

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and the output matrix: vocab_size up to a vocab_multiple."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head, or one per query head when it is None."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def kv_width(self) -> int:
        """Channels of one token's keys (and as many of its values) in one layer: what a KV
        cache holds per token per layer, n_embd / group of them with grouped queries."""
        return self.kv_heads * self.head_dim

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width: mlp_hidden, or GPT-2's 4 * n_embd when it is None."""
        return 4 * self.n_embd if self.mlp_hidden is None else self.mlp_hidden

    @property
    def unbounded(self) -> bool:
        """Whether a sequence may grow past block_size: rotary positions have no table to
        run out of, and a window keeps every query-key distance below what training saw."""
        return self.position_embedding == "rotary" and self.sliding_window is not None

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


# rose-train's padding of the vocabulary (GPTConfig.vocab_multiple), as nanoGPT's: 64.
TRAINING_VOCAB_MULTIPLE = 64

# The Llama-shaped block: rotary positions, RMSNorm, a SwiGLU MLP, no biases.
LLAMA = dict(position_embedding="rotary", norm="rmsnorm", mlp="swiglu", bias=False)

# Named shapes. `tiny` is the CPU quickstart model; the gpt2* are OpenAI's GPT-2 sizes;
# `tiny-llama` is `tiny` made Llama-shaped (two query heads per key/value head), and the
# last two are the shapes of SmolLM2-135M and Qwen2.5-0.5B (their HF folders load too).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024),
    "tiny-llama": dict(
        **LLAMA, n_layer=4, n_head=4, n_kv_head=2, n_embd=128, mlp_hidden=352, block_size=128
    ),
    "smollm2-135m": dict(
        **LLAMA,
        n_layer=30,
        n_head=9,
        n_kv_head=3,
        n_embd=576,
        mlp_hidden=1536,
        vocab_size=49152,
        block_size=8192,
        rotary_base=100000.0,
    ),
    "qwen2.5-0.5b": dict(
        **LLAMA,
        n_layer=24,
        n_head=14,
        n_kv_head=2,
        n_embd=896,
        mlp_hidden=4864,
        vocab_size=151936,
        block_size=32768,
        rotary_base=1000000.0,
        norm_eps=1e-6,
        qkv_bias=True,
    ),
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
    checkpoint_path: str = "checkpoints/tiny"  # a run directory, or a .pt file (RunFiles)
    resume: bool = False  # continue the run at checkpoint_path
    overwrite: bool = False  # replace the run at checkpoint_path with a new one
    accept_different_data: bool = False  # resume on a text whose content changed
    sample_tokens: int = 120
    # hardware
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "float32"  # float32 | bfloat16 | float16 (autocast; fp16 only on CUDA)
    compile: bool = False
    activation_checkpointing: bool = False
    seed: int = 1337
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        what = "train config"
        for name in ("text_file", "dataset", "data_dir", "tokenizer_name", "checkpoint_path"):
            value = getattr(self, name)
            if not isinstance(value, str) and not (name == "text_file" and value is None):
                raise RoseError(f"{what}: {name} must be a string, got {value!r}")
        for name in ("resume", "overwrite", "accept_different_data", "compile"):
            check_bool(what, name, getattr(self, name))
        check_bool(what, "activation_checkpointing", self.activation_checkpointing)
        for name in ("batch_size", "grad_accum_steps", "max_steps", "eval_interval", "eval_iters"):
            check_int(what, name, getattr(self, name), minimum=1)
        if self.lr_decay_steps is not None:
            check_int(what, "lr_decay_steps", self.lr_decay_steps, minimum=1)
        check_int(what, "warmup_steps", self.warmup_steps, minimum=0)
        check_int(what, "sample_tokens", self.sample_tokens, minimum=0)
        check_int(what, "seed", self.seed, minimum=0, maximum=MAX_SEED)
        check_number(what, "val_fraction", self.val_fraction, 0.0, 1.0, "(0, 1)")
        check_number(what, "learning_rate", self.learning_rate, 0.0, 1.0, "(0, 1]")
        check_number(what, "min_lr", self.min_lr, 0.0, self.learning_rate, "[0, learning_rate]")
        for name in ("beta1", "beta2"):
            check_number(what, name, getattr(self, name), 0.0, 1.0, "[0, 1)")
        for name in ("weight_decay", "grad_clip"):
            check_number(what, name, getattr(self, name), 0.0, math.inf, ">= 0")
        if not isinstance(self.device, str) or not (
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")
        ):
            raise RoseError(
                f"{what}: device must be auto, cpu, cuda or cuda:N, got {self.device!r}"
            )
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise RoseError(
                f"{what}: dtype must be float32, bfloat16 or float16, got {self.dtype!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values.pop("extra")
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        return cls(**_known_keys(cls, values, "train config"))


# Seeds go to torch.manual_seed (at most 2**64 - 1) after adding the rank: keep far below.
MAX_SEED = 2**63 - 1


def check_int(what: str, name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    """`value` is an integer (not a bool, not 2.5, not "3") in [minimum, maximum]."""
    if maximum is not None:
        wanted = f"an integer in [{minimum}, {maximum}]"
    else:
        wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if not is_int or value < minimum or (maximum is not None and value > maximum):
        raise RoseError(f"{what}: {name} must be {wanted}, got {value!r}")


def check_number(what: str, name: str, value: Any, low: float, high: float, interval: str) -> None:
    """`value` is a finite number in `interval`, written as "(0, 1]", "[0, 1)", ">= 0"..."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise RoseError(f"{what}: {name} must be a number, got {value!r}")
    inside = (
        math.isfinite(value)
        and (value > low if interval.startswith("(") else value >= low)
        and (value < high if interval.endswith(")") else value <= high)
    )
    if not inside:
        raise RoseError(f"{what}: {name} must be a finite number {interval}, got {value!r}")


def check_choice(what: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise RoseError(f"{what}: {name} must be {' or '.join(choices)}, got {value!r}")


def check_bool(what: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise RoseError(f"{what}: {name} must be true or false, got {value!r}")


def _known_keys(cls: type, values: dict[str, Any], what: str) -> dict[str, Any]:
    if not isinstance(values, dict):
        raise RoseError(f"{what} must be a table of settings, got {type(values).__name__}")
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
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise RoseError(
            f"config file {path} is not UTF-8 text (byte {err.start}); save it as UTF-8"
        ) from None
    except OSError as err:
        raise RoseError(f"config file {path} cannot be read: {err.strerror}") from None
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
