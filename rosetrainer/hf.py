"""Hugging Face's formats: GPT-2, Llama and Qwen2 folders in (a GPT-2 also by Hub id when
online), rose's models out as a folder transformers and vLLM load.

`load_hf` reads config.json's model_type and takes the matching road: GPT-2 first, then
the Llama-shaped family below it. `save_hf` writes the format that computes the model:
GPT-2 for a GPT-2, Llama (or Qwen2, with query/key/value biases) for a Llama-shaped one.

GPT-2:

rose's model uses GPT-2's parameter names on purpose, so a Hugging Face state_dict
maps onto it almost name for name. The differences handled here:

* HF's attention and MLP projections are `Conv1D` layers, which store a weight as
  (in, out) where `nn.Linear` stores (out, in): those four weights are transposed;
* older files carry the causal mask as buffers (`attn.bias`, `attn.masked_bias`):
  they are not weights, and rose builds its mask itself, so they are skipped;
* `lm_head.weight` is the token embedding again (tied) or absent from the file.

Loading needs only json, safetensors and torch, and so does `save_hf_gpt2`, which goes
the other way: a rose model as a folder `transformers`, vLLM or llama.cpp's converter
read (weights, GPT-2's config.json, and GPT-2's tokenizer files, rosetrainer.hf_tokenizer).
`to_hf_gpt2` builds the same model in memory, for side-by-side comparisons, and is the
one place that imports `transformers` (a dev extra).

Llama and Qwen2 (LlamaForCausalLM, Qwen2ForCausalLM; SmolLM2 is a Llama): rose's
Llama-shaped choices (GPTConfig: RMSNorm, SwiGLU, rotary positions, n_kv_head) are
theirs, so the weights map one to one, with two joins: q_proj, k_proj and v_proj are
rose's one c_attn (rows one after the other, queries first), and gate_proj and up_proj
its one SwiGLU c_fc (gate first). Their rotary pairs channel i with i + head_dim / 2, as
rose does (rotate_half), so no row is permuted. Qwen2 is Llama with biases on q, k and v
(GPTConfig.qkv_bias).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tiktoken
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from rosetrainer.checkpoint import check_declared_shape, check_finite, check_weights_fit
from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError, one_line
from rosetrainer.hf_tokenizer import hf_tokenizer_files
from rosetrainer.model import GPT
from rosetrainer.tokenizer import read_json_object

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
# GPTConfig fields a GPT-2 config.json can state (CONFIG_KEYS, and dropout as the three
# *_pdrop keys), and vocab_multiple, whose padding rows an export drops (vocabulary_state);
# any other field must keep its default, which is what GPT-2 computes.
EXPORTED_FIELDS = {*CONFIG_KEYS.values(), "dropout", "vocab_multiple"}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # in order of preference


LLAMA_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def load_hf(name_or_path: str, device: str | torch.device = "cpu") -> GPT:
    """A rose GPT holding a Hugging Face model's weights: GPT-2, Llama or Qwen2 (a folder,
    or for GPT-2 a Hub id)."""
    directory = local_directory(name_or_path)
    hf_config = read_config(directory)
    if hf_config.get("model_type") not in LLAMA_TYPES:
        return load_hf_gpt2(name_or_path, device)
    config = llama_config_from_hf(hf_config)
    weight_file, hf_state = read_weights(directory)
    return built(config, rose_names_llama(hf_state, config), weight_file, device)


def config_from_hf(hf_config: dict[str, Any]) -> GPTConfig:
    """The GPTConfig of a Hugging Face config.json: GPT-2, Llama or Qwen2."""
    if hf_config.get("model_type") in LLAMA_TYPES:
        return llama_config_from_hf(hf_config)
    return gpt_config_from_hf(hf_config)


def save_hf(model: GPT, encoding: tiktoken.Encoding, directory: str | Path) -> list[str]:
    """`model` and its tokenizer as a Hugging Face folder: a GPT-2's as GPT-2, a Llama-shaped
    model's as Llama or Qwen2 (save_hf_gpt2, save_hf_llama)."""
    if (model.config.norm, model.config.mlp) != ("layernorm", "gelu"):
        return save_hf_llama(model, encoding, directory)
    return save_hf_gpt2(model, encoding, directory)


def load_hf_gpt2(name_or_path: str, device: str | torch.device = "cpu") -> GPT:
    """A rose GPT holding the weights of a Hugging Face GPT-2 (folder or Hub id)."""
    directory = local_directory(name_or_path)
    config = gpt_config_from_hf(read_config(directory))
    weight_file, hf_state = read_weights(directory)
    return built(config, rose_names(hf_state), weight_file, device)


def built(
    config: GPTConfig,
    state_dict: dict[str, torch.Tensor],
    weight_file: Path,
    device: str | torch.device,
) -> GPT:
    """The model of `config` holding `state_dict` (rose's names), each checked first."""
    # config.json can declare any size: check it against the stored tensors before building.
    check_declared_shape(config, state_dict, f"the weights in {weight_file}")
    check_finite(state_dict, str(weight_file))
    model = GPT(config)
    check_weights_fit(state_dict, model, "Hugging Face weights")
    model.load_state_dict(state_dict)
    return model.to(device)


def read_hf_config(name_or_path: str) -> dict[str, Any]:
    """A Hugging Face model's config.json, without its weights."""
    return read_config(local_directory(name_or_path))


def gpt_config_from_hf(hf_config: dict[str, Any]) -> GPTConfig:
    """The GPTConfig of a Hugging Face GPT-2 config.json; other architectures are refused."""
    model_type = hf_config.get("model_type")
    if model_type != "gpt2":
        raise RoseError(
            f"not a GPT-2 model: config.json has model_type {model_type!r}; "
            f"rose imports Hugging Face GPT-2, Llama and Qwen2 models (model_type 'gpt2', "
            f"{', '.join(repr(t) for t in LLAMA_TYPES)})"
        )
    check_architecture(hf_config, GPT2_ARCHITECTURE, "GPT-2 variant", "rose's GPT-2")
    n_embd = hf_config.get("n_embd", GPTConfig.n_embd)
    n_inner = hf_config.get("n_inner")
    if n_inner not in (None, 4 * n_embd):
        raise RoseError(f"this GPT-2 variant has n_inner={n_inner}; rose's MLP is 4 * n_embd wide")
    values = {field: hf_config[key] for key, field in CONFIG_KEYS.items() if key in hf_config}
    if "block_size" not in values and "n_ctx" in hf_config:  # the oldest configs say n_ctx
        values["block_size"] = hf_config["n_ctx"]
    return GPTConfig(**values, dropout=0.0, bias=True)


def check_architecture(
    hf_config: dict[str, Any], supported: dict[str, Any], what: str, implementer: str
) -> None:
    """Refuse, by name, the first option of config.json that changes the computation from
    what rose implements (a key left out means the supported value, HF's default)."""
    for key, value in supported.items():
        if hf_config.get(key, value) != value:
            raise RoseError(
                f"this {what} sets {key}={hf_config[key]!r}; {implementer} implements "
                f"{key}={value!r} only"
            )


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
    check_gpt2_config(cfg)
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
        tie_word_embeddings=is_tied(model),
    )
    hf_model = GPT2LMHeadModel(hf_config)
    hf_model.load_state_dict(hf_names(vocabulary_state(model)))
    weight = model.lm_head.weight
    return hf_model.to(device=weight.device, dtype=weight.dtype)


def save_hf_gpt2(model: GPT, encoding: tiktoken.Encoding, directory: str | Path) -> list[str]:
    """Write `model` and its tokenizer into `directory` as a Hugging Face GPT-2; return the
    file names. The caller makes the folder appear whole (rosetrainer.files.new_directory).

    The model's vocabulary must be its tokenizer's (roseinfer.loading.fit_vocabulary
    cuts a vocab_size declared past it), and the rows padded past vocab_size are left out
    (vocabulary_state): config.json's vocab_size, the embedding's rows and the
    tokenizer's ids then agree, as transformers and vLLM expect.
    """
    config = model.config
    check_gpt2_config(config)
    if not is_tied(model):
        # GPT-2 ties them in every runtime (vLLM's GPT-2 has no output matrix of its own).
        raise RoseError(
            "this model's output matrix lm_head differs from its token embedding; GPT-2 "
            "ties the two, so the model cannot be exported as GPT-2"
        )
    if encoding.n_vocab != config.vocab_size:
        raise RoseError(
            f"the model's vocabulary has {config.vocab_size} rows but its tokenizer "
            f"{encoding.name!r} has {encoding.n_vocab} tokens; they must be equal to export"
        )
    eot_id = encoding.eot_token
    hf_config = hf_gpt2_config(config, eot_id, model.lm_head.weight.dtype)
    # The tied output matrix is not stored: transformers ties it to transformer.wte.weight
    # when it loads (tie_word_embeddings), as save_pretrained leaves it out too.
    state = hf_names(vocabulary_state(model))
    del state["lm_head.weight"]
    return write_folder(directory, hf_config, state, encoding, config.block_size)


def write_folder(
    directory: str | Path,
    hf_config: dict[str, Any],
    state: dict[str, torch.Tensor],
    encoding: tiktoken.Encoding,
    model_max_length: int,
) -> list[str]:
    """config.json, the weights (model.safetensors), generation_config.json and the
    tokenizer's files (GPT-2's, from tiktoken: rosetrainer.hf_tokenizer) in `directory`;
    their names."""
    directory = Path(directory)
    files = hf_tokenizer_files(encoding, model_max_length=model_max_length)
    eot_id = encoding.eot_token
    files["config.json"] = _json(hf_config)
    files["generation_config.json"] = _json({"bos_token_id": eot_id, "eos_token_id": eot_id})
    for name, text in files.items():
        (directory / name).write_text(text, encoding="utf-8")
    weights = {name: tensor.detach().cpu().contiguous() for name, tensor in state.items()}
    try:
        save_file(weights, directory / WEIGHT_FILES[0], metadata={"format": "pt"})
    except SafetensorError as err:  # not an OSError, also when the OS refused the write
        raise os_error_of(err) from None
    return sorted([*files, WEIGHT_FILES[0]])


def os_error_of(err: SafetensorError) -> OSError | SafetensorError:
    """The OS error a SafetensorError reports in its text (safetensors writes through
    Rust, whose I/O errors end in "(os error N)"), so that a full disk reads like any
    other; an error of its own stays as it is."""
    code = re.search(r"\(os error (\d+)\)", str(err))
    if code is None:
        return err
    return OSError(int(code[1]), os.strerror(int(code[1])))


def hf_gpt2_config(config: GPTConfig, eot_id: int, dtype: torch.dtype) -> dict[str, Any]:
    """GPT-2's config.json for a rose model: the keys OpenAI's GPT-2 files carry, with
    every option that changes the computation spelled out."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        **{key: getattr(config, field) for key, field in CONFIG_KEYS.items()},
        "n_ctx": config.block_size,  # the oldest readers look for the context length here
        "n_inner": None,  # 4 * n_embd
        **GPT2_ARCHITECTURE,
        "attn_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "resid_pdrop": config.dropout,
        "initializer_range": 0.02,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def check_gpt2_config(config: GPTConfig) -> None:
    """Refuse a model Hugging Face's GPT-2 cannot compute: any GPTConfig field outside
    EXPORTED_FIELDS that differs from its default (no biases, rotary positions, ...)."""
    for field in dataclasses.fields(config):
        if field.name in EXPORTED_FIELDS:
            continue
        default = field.default
        if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        value = getattr(config, field.name)
        if value != default:
            raise RoseError(
                f"this model has {field.name}={value!r}; Hugging Face's GPT-2 has only "
                f"{field.name}={default!r}, so the model cannot be exported as GPT-2"
            )


def vocabulary_state(model: GPT) -> dict[str, torch.Tensor]:
    """The model's state_dict with its vocabulary's rows only: the rows a padded embedding
    and output matrix hold past vocab_size (GPTConfig.vocab_multiple) are no token, and
    config.json's vocab_size counts the rows a Hugging Face model reads."""
    state, vocab_size = model.state_dict(), model.config.vocab_size
    for name in ("transformer.wte.weight", "lm_head.weight"):
        state[name] = state[name][:vocab_size]
    return state


def is_tied(model: GPT) -> bool:
    return model.lm_head.weight is model.transformer.wte.weight


def hf_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """rose's state_dict under GPT2LMHeadModel's names: the four Conv1D weights transposed
    (the other names are already the same)."""
    return {
        name: tensor.t() if name.endswith(CONV1D_WEIGHTS) else tensor
        for name, tensor in state_dict.items()
    }


def _json(value: dict[str, Any]) -> str:
    return json.dumps(value, indent=2) + "\n"


def local_directory(name_or_path: str) -> Path:
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


def read_config(directory: Path) -> dict[str, Any]:
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise RoseError(f"{directory} has no config.json; pass a folder written by save_pretrained")
    return read_json_object(config_file)


def read_weights(directory: Path) -> tuple[Path, dict[str, torch.Tensor]]:
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
        raise RoseError(f"cannot read {weight_file}: {one_line(err, False)}") from None


# ---------------------------------------------------------------------------
# Llama and Qwen2
# ---------------------------------------------------------------------------

# Options of HF's Llama/Qwen2 that change the computation, and the value rose implements.
LLAMA_ARCHITECTURE = {
    "hidden_act": "silu",
    "mlp_bias": False,
    "attention_bias": False,  # (Llama's: q, k, v *and* o biases; Qwen2 has q, k, v ones)
    "use_sliding_window": False,
    "pretraining_tp": 1,
}


def llama_config_from_hf(hf_config: dict[str, Any]) -> GPTConfig:
    """The GPTConfig of a Llama or Qwen2 config.json; variants rose does not compute are
    refused, each by name."""
    model_type = hf_config.get("model_type")
    if model_type not in LLAMA_TYPES:
        raise RoseError(f"not a Llama or Qwen2 model: config.json has model_type {model_type!r}")
    needed = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    needed += ("num_attention_heads", "max_position_embeddings")
    missing = [key for key in needed if key not in hf_config]
    if missing:
        raise RoseError(f"this {model_type} config.json has no {', '.join(missing)}")
    check_architecture(hf_config, LLAMA_ARCHITECTURE, f"{model_type} model", "rose")
    # transformers 5 keeps the rotary settings in rope_parameters, earlier ones beside
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise RoseError(
            f"this {model_type} model scales its rotary positions ({rope}); rose implements "
            f"plain rotary positions (rope_type 'default') only"
        )
    n_embd, n_head = hf_config["hidden_size"], hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or n_embd // n_head
    if head_dim * n_head != n_embd:
        raise RoseError(
            f"this {model_type} model has head_dim {head_dim} with {n_head} heads of a "
            f"{n_embd}-wide stream; rose's heads split the stream (head_dim = hidden / heads)"
        )
    return GPTConfig(
        vocab_size=hf_config["vocab_size"],
        block_size=hf_config["max_position_embeddings"],
        n_layer=hf_config["num_hidden_layers"],
        n_head=n_head,
        n_kv_head=hf_config.get("num_key_value_heads") or n_head,
        n_embd=n_embd,
        position_embedding="rotary",
        norm="rmsnorm",
        norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        mlp="swiglu",
        mlp_hidden=hf_config["intermediate_size"],
        bias=False,
        qkv_bias=model_type == "qwen2",
        tie_embeddings=hf_config.get("tie_word_embeddings", False),
        rotary_base=float(rope.get("rope_theta", hf_config.get("rope_theta", 10000.0))),
    )


# rose's name -> Llama's, per layer (after "transformer.h.{i}." / "model.layers.{i}.")
LLAMA_LAYER_NAMES = {
    "ln_1.weight": "input_layernorm.weight",
    "attn.c_proj.weight": "self_attn.o_proj.weight",
    "ln_2.weight": "post_attention_layernorm.weight",
    "mlp.c_proj.weight": "mlp.down_proj.weight",
}
LLAMA_JOINED = {  # rose's one matrix -> Llama's, stacked along the rows in this order
    "attn.c_attn": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.c_fc": ("mlp.gate_proj", "mlp.up_proj"),
}
LLAMA_OUTER_NAMES = {
    "transformer.wte.weight": "model.embed_tokens.weight",
    "transformer.ln_f.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def rose_names_llama(
    hf_state: dict[str, torch.Tensor], config: GPTConfig
) -> dict[str, torch.Tensor]:
    """A Llama/Qwen2 state_dict under rose's names, q/k/v and gate/up joined; a name rose
    does not know is kept as it is (check_weights_fit then names it)."""
    hf_state = dict(hf_state)
    state = {}
    for rose, hf in LLAMA_OUTER_NAMES.items():
        if hf in hf_state:
            state[rose] = hf_state.pop(hf)
    for i in range(config.n_layer):
        rose_layer, hf_layer = f"transformer.h.{i}.", f"model.layers.{i}."
        for rose, hf in LLAMA_LAYER_NAMES.items():
            if hf_layer + hf in hf_state:
                state[rose_layer + rose] = hf_state.pop(hf_layer + hf)
        for rose, parts in LLAMA_JOINED.items():
            for kind in ("weight", "bias"):
                names = [f"{hf_layer}{part}.{kind}" for part in parts]
                if all(name in hf_state for name in names):
                    state[f"{rose_layer}{rose}.{kind}"] = torch.cat(
                        [hf_state.pop(n) for n in names]
                    )
    if config.tie_embeddings:  # the output matrix is the embedding (stored or not)
        head = state.pop("lm_head.weight", None)
        wte = state.get("transformer.wte.weight")
        if head is not None and wte is not None and not torch.equal(head, wte):
            raise RoseError(
                "lm_head.weight differs from the token embedding though config.json ties them "
                "(tie_word_embeddings)"
            )
        if wte is not None:
            state["lm_head.weight"] = wte
    state.update(hf_state)  # whatever is left: unexpected, named by check_weights_fit
    return state


def hf_names_llama(model: GPT) -> dict[str, torch.Tensor]:
    """The model's state_dict under Llama's names, c_attn and c_fc split; a tied output
    matrix left out (transformers ties it on load, as save_pretrained leaves it out)."""
    config, state = model.config, vocabulary_state(model)
    hf_state = {hf: state[rose] for rose, hf in LLAMA_OUTER_NAMES.items()}
    if config.tie_embeddings:
        del hf_state["lm_head.weight"]
    widths = {"attn.c_attn": [config.n_embd, config.kv_width, config.kv_width], "mlp.c_fc": None}
    for i in range(config.n_layer):
        rose_layer, hf_layer = f"transformer.h.{i}.", f"model.layers.{i}."
        for rose, hf in LLAMA_LAYER_NAMES.items():
            hf_state[hf_layer + hf] = state[rose_layer + rose]
        for rose, parts in LLAMA_JOINED.items():
            for kind in ("weight", "bias"):
                joined = state.get(f"{rose_layer}{rose}.{kind}")
                if joined is None:
                    continue
                pieces = joined.split(widths[rose]) if widths[rose] else joined.chunk(2)
                for part, piece in zip(parts, pieces, strict=True):
                    hf_state[f"{hf_layer}{part}.{kind}"] = piece
    return hf_state


def check_llama_config(config: GPTConfig) -> str:
    """The Hugging Face model_type that computes `config` ("llama", or "qwen2" with q/k/v
    biases), or a RoseError naming the first choice neither has."""
    needed = dict(position_embedding="rotary", norm="rmsnorm", mlp="swiglu", bias=False)
    needed.update(sliding_window=None, attention_sinks=0, dropout=0.0)
    for name, value in needed.items():
        if getattr(config, name) != value:
            raise RoseError(
                f"this model has {name}={getattr(config, name)!r}; Hugging Face's Llama and "
                f"Qwen2 have {name}={value!r}, so the model cannot be exported as either"
            )
    return "qwen2" if config.qkv_bias else "llama"


def hf_llama_config(config: GPTConfig, eot_id: int, dtype: torch.dtype) -> dict[str, Any]:
    """Llama's (or Qwen2's) config.json for a Llama-shaped rose model, every option that
    changes the computation spelled out."""
    model_type = check_llama_config(config)
    return {
        "architectures": [LLAMA_TYPES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.block_size,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.kv_heads,
        "hidden_size": config.n_embd,
        "head_dim": config.head_dim,
        "intermediate_size": config.mlp_width,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rotary_base,  # (transformers 4 and vLLM read it here)
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rotary_base},
        "tie_word_embeddings": config.tie_embeddings,
        **LLAMA_ARCHITECTURE,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def save_hf_llama(model: GPT, encoding: tiktoken.Encoding, directory: str | Path) -> list[str]:
    """Write a Llama-shaped `model` and its tokenizer into `directory` as a Hugging Face
    Llama (or Qwen2); return the file names. As save_hf_gpt2: the caller makes the folder
    appear whole, and the vocabulary must be the tokenizer's."""
    config = model.config
    hf_config = hf_llama_config(config, encoding.eot_token, model.lm_head.weight.dtype)
    if config.tie_embeddings != is_tied(model):
        raise RoseError(
            "this model's output matrix is tied to its embedding though its config says "
            "otherwise (or the reverse); export a model as it was built"
        )
    if encoding.n_vocab != config.vocab_size:
        raise RoseError(
            f"the model's vocabulary has {config.vocab_size} rows but its tokenizer "
            f"{encoding.name!r} has {encoding.n_vocab} tokens; they must be equal to export"
        )
    return write_folder(directory, hf_config, hf_names_llama(model), encoding, config.block_size)
