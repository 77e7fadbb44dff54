"""Import GPT-2 weights saved by Hugging Face: a local folder, or a Hub id when online.

rose's model uses GPT-2's parameter names on purpose, so a Hugging Face state_dict
maps onto it almost name for name. The differences handled here:

* HF's attention and MLP projections are `Conv1D` layers, which store a weight as
  (in, out) where `nn.Linear` stores (out, in): those four weights are transposed;
* older files carry the causal mask as buffers (`attn.bias`, `attn.masked_bias`):
  they are not weights, and rose builds its mask itself, so they are skipped;
* `lm_head.weight` is the token embedding again (tied) or absent from the file.

Loading needs only json, safetensors and torch. `to_hf_gpt2` goes the other way, for
side-by-side comparisons, and is the one place that imports `transformers` (a dev extra).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from rosetrainer.checkpoint import check_declared_shape, check_finite, check_weights_fit
from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError
from rosetrainer.model import GPT

if TYPE_CHECKING:
    from transformers import GPT2LMHeadModel

# Hugging Face config.json key -> GPTConfig field. A key left out of config.json means
# GPT-2 small's value, which is GPTConfig's default too.
CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "n_positions": "block_size",
    "n_layer": "n_layer",
    "n_head": "n_head",
    "n_embd": "n_embd",
}
# Options of HF's GPT-2 that change the computation, and the value rose implements
# (each is also HF's default, used when config.json leaves the key out).
GPT2_ARCHITECTURE = {
    "activation_function": "gelu_new",
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": True,
    "add_cross_attention": False,
}
CONV1D_WEIGHTS = (
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
)
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # in order of preference


def load_hf_gpt2(name_or_path: str, device: str | torch.device = "cpu") -> GPT:
    """A rose GPT holding the weights of a Hugging Face GPT-2 (folder or Hub id)."""
    directory = _local_directory(name_or_path)
    config = gpt_config_from_hf(_read_config(directory))
    weight_file, hf_state = _read_weights(directory)
    state_dict = rose_names(hf_state)
    # config.json can declare any size: check it against the stored tensors before building.
    check_declared_shape(config, state_dict, f"the weights in {weight_file}")
    check_finite(state_dict, str(weight_file))
    model = GPT(config)
    check_weights_fit(state_dict, model, "Hugging Face weights")
    model.load_state_dict(state_dict)
    return model.to(device)


def read_hf_config(name_or_path: str) -> dict[str, Any]:
    """A Hugging Face GPT-2's config.json, without its weights."""
    return _read_config(_local_directory(name_or_path))


def gpt_config_from_hf(hf_config: dict[str, Any]) -> GPTConfig:
    """The GPTConfig of a Hugging Face GPT-2 config.json; other architectures are refused."""
    model_type = hf_config.get("model_type")
    if model_type != "gpt2":
        raise RoseError(
            f"not a GPT-2 model: config.json has model_type {model_type!r}; "
            f"rose imports Hugging Face GPT-2 models (model_type 'gpt2') only"
        )
    for key, supported in GPT2_ARCHITECTURE.items():
        value = hf_config.get(key, supported)
        if value != supported:
            raise RoseError(
                f"this GPT-2 variant sets {key}={value!r}; rose's GPT-2 implements "
                f"{key}={supported!r} only"
            )
    n_embd = hf_config.get("n_embd", GPTConfig.n_embd)
    n_inner = hf_config.get("n_inner")
    if n_inner not in (None, 4 * n_embd):
        raise RoseError(f"this GPT-2 variant has n_inner={n_inner}; rose's MLP is 4 * n_embd wide")
    values = {field: hf_config[key] for key, field in CONFIG_KEYS.items() if key in hf_config}
    if "block_size" not in values and "n_ctx" in hf_config:  # the oldest configs say n_ctx
        values["block_size"] = hf_config["n_ctx"]
    return GPTConfig(**values, dropout=0.0, bias=True)


def state_dict_from_hf(hf_state: dict[str, torch.Tensor], model: GPT) -> dict[str, torch.Tensor]:
    """Rename/transpose a Hugging Face GPT-2 state_dict into rose's, checked against `model`."""
    state_dict = rose_names(hf_state)
    check_weights_fit(state_dict, model, "Hugging Face weights")
    return state_dict


def rose_names(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face GPT-2 state_dict under rose's names, Conv1D weights transposed."""
    state_dict = {}
    for hf_name, tensor in hf_state.items():
        # GPT2LMHeadModel saves "transformer.h.0...", a bare GPT2Model "h.0...".
        name = hf_name.removeprefix("transformer.")
        if name.endswith(MASK_BUFFERS):
            continue
        if name.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()
        state_dict[name if name == "lm_head.weight" else f"transformer.{name}"] = tensor

    token_embedding = state_dict.get("transformer.wte.weight")
    lm_head = state_dict.pop("lm_head.weight", None)
    if token_embedding is not None:
        if lm_head is not None and not torch.equal(lm_head, token_embedding):
            raise RoseError(
                "lm_head.weight differs from the token embedding transformer.wte.weight; "
                "rose's GPT-2 ties the two, so an untied model cannot be imported"
            )
        state_dict["lm_head.weight"] = token_embedding
    return state_dict


def to_hf_gpt2(model: GPT) -> GPT2LMHeadModel:
    """The same weights in transformers' GPT2LMHeadModel, on the model's device and dtype."""
    from transformers import GPT2Config, GPT2LMHeadModel  # only comparisons need transformers

    cfg = model.config
    if not cfg.bias:
        raise RoseError("Hugging Face's GPT-2 always has biases; this model has bias=False")
    hf_config = GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.block_size,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        attn_pdrop=cfg.dropout,
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        # A rose model may carry an output matrix of its own (the chapters' random one does).
        tie_word_embeddings=model.lm_head.weight is model.transformer.wte.weight,
    )
    hf_state = {
        name: tensor.t() if name.endswith(CONV1D_WEIGHTS) else tensor
        for name, tensor in model.state_dict().items()
    }
    hf_model = GPT2LMHeadModel(hf_config)
    hf_model.load_state_dict(hf_state)
    weight = model.lm_head.weight
    return hf_model.to(device=weight.device, dtype=weight.dtype)


def _local_directory(name_or_path: str) -> Path:
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise RoseError(f"{path} is a file; pass the folder holding config.json and the weights")
    # Not a local path: a Hub id like "openai-community/gpt2". huggingface_hub comes with
    # `datasets`; it is imported here because only this online path needs it.
    from huggingface_hub import snapshot_download

    try:
        directory = Path(
            snapshot_download(name_or_path, allow_patterns=["config.json", WEIGHT_FILES[0]])
        )
        if not (directory / WEIGHT_FILES[0]).is_file():  # an older repo: pickled weights only
            directory = Path(snapshot_download(name_or_path, allow_patterns=[WEIGHT_FILES[1]]))
    except Exception as err:  # invalid id, no network, no such repo: all end the same way
        raise RoseError(
            f"{name_or_path!r} is not a local directory, and fetching it from the Hugging Face Hub "
            f"failed ({type(err).__name__}); offline, pass a local directory holding config.json "
            f"and model.safetensors (or pytorch_model.bin)"
        ) from None
    return directory


def _read_config(directory: Path) -> dict[str, Any]:
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise RoseError(f"{directory} has no config.json; pass a folder written by save_pretrained")
    try:
        hf_config = json.loads(config_file.read_text(encoding="utf-8"))
    except ValueError as err:
        raise RoseError(f"{config_file} is not valid JSON: {err}") from None
    if not isinstance(hf_config, dict):
        raise RoseError(f"{config_file} must hold a JSON object")
    return hf_config


def _read_weights(directory: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    weight_file = next((directory / n for n in WEIGHT_FILES if (directory / n).is_file()), None)
    if weight_file is None:
        raise RoseError(
            f"{directory} has neither {' nor '.join(WEIGHT_FILES)} (sharded checkpoints are "
            f"not supported); pass a folder written by save_pretrained"
        )
    try:
        if weight_file.suffix == ".safetensors":
            return weight_file, load_file(weight_file)
        # The pickled format: weights_only=True refuses to run code hidden in the file.
        return weight_file, torch.load(weight_file, map_location="cpu", weights_only=True)
    except Exception as err:  # safetensors and torch each have their own error types
        reason = (str(err).splitlines() or [type(err).__name__])[0]
        raise RoseError(f"cannot read {weight_file}: {reason}") from None
