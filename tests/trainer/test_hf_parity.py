"""Hugging Face GPT-2 import: rose's logits and loss equal transformers' on the same weights.

No weights can be downloaded here, so a randomly initialised GPT2LMHeadModel is saved
with save_pretrained and loaded back by rose. A large initializer_range makes every
weight matter to the logits, so a wrong transpose or position table cannot hide.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from models import assert_logits_close

from rosetrainer.errors import RoseError
from rosetrainer.hf import gpt_config_from_hf, load_hf_gpt2, state_dict_from_hf, to_hf_gpt2
from rosetrainer.model import GPT

if TYPE_CHECKING:  # transformers is imported by the fixture (a slow import, once)
    from transformers import GPT2LMHeadModel

BLOCK_SIZE = 96


@pytest.fixture(scope="module")
def hf_model() -> GPT2LMHeadModel:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=3,
        n_head=6,
        n_embd=192,
        n_positions=BLOCK_SIZE,
        vocab_size=50257,
        initializer_range=0.2,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    )
    return GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def safetensors_dir(hf_model, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("hf_safetensors")
    hf_model.save_pretrained(directory)
    assert (directory / "model.safetensors").is_file()
    return directory


@pytest.fixture(scope="module")
def pickled_dir(hf_model, safetensors_dir, tmp_path_factory) -> Path:
    """pytorch_model.bin in the layout of the original Hub files.

    transformers 5 writes safetensors only (safe_serialization=False is gone), so the
    file is written here the way the old GPT-2 uploads were: GPT2Model names without
    "transformer.", the causal-mask buffers, no lm_head.
    """
    directory = tmp_path_factory.mktemp("hf_pickled")
    shutil.copy(safetensors_dir / "config.json", directory / "config.json")
    legacy = {}
    for name, tensor in hf_model.transformer.state_dict().items():
        legacy[name] = tensor
        if name.endswith("attn.c_attn.weight"):
            layer = name.removesuffix(".c_attn.weight")
            legacy[f"{layer}.bias"] = torch.tril(torch.ones(BLOCK_SIZE, BLOCK_SIZE))[None, None]
            legacy[f"{layer}.masked_bias"] = torch.tensor(-1e4)
    torch.save(legacy, directory / "pytorch_model.bin")
    return directory


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(50257, (2, BLOCK_SIZE), generator=torch.Generator().manual_seed(1))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["safetensors_dir", "pickled_dir"])
def test_logits_and_loss_equal_hugging_face(request, layout, hf_model, tokens):
    model = load_hf_gpt2(str(request.getfixturevalue(layout))).eval()
    targets = torch.cat([tokens[:, 1:], torch.full((2, 1), -100)], dim=1)
    with torch.no_grad():
        hf_out = hf_model(tokens, labels=tokens)  # HF shifts the labels itself
        rose_logits = model(tokens).logits
        rose_loss = model(tokens, targets=targets).loss  # (computed without whole logits)
    assert rose_logits.shape == hf_out.logits.shape == (2, BLOCK_SIZE, 50257)
    # float32 rounding: with weights this large the residual stream reaches ~30, and each
    # model lands ~6e-5 from the float64 logits (their gap measured 1.7e-5); the float64
    # test below shows the arithmetic is the same.
    assert_logits_close(rose_logits, hf_out.logits)
    torch.testing.assert_close(rose_loss, hf_out.loss, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_float64_logits_agree_to_rounding(safetensors_dir, hf_model, tokens):
    model = load_hf_gpt2(str(safetensors_dir)).eval().double()
    with torch.no_grad():
        hf_logits = copy.deepcopy(hf_model).double()(tokens).logits
        rose_logits = model(tokens).logits
    torch.testing.assert_close(rose_logits, hf_logits, atol=1e-10, rtol=0)


def test_comparison_is_sensitive_to_positions(safetensors_dir, hf_model, tokens):
    """The logits depend on where each token sits, so a wrong position table would show."""
    model = load_hf_gpt2(str(safetensors_dir)).eval()
    with torch.no_grad():
        reference = hf_model(tokens).logits
        same_token_everywhere = model(torch.full((1, BLOCK_SIZE), 42)).logits[0]
        model.transformer.wpe.weight.copy_(model.transformer.wpe.weight.roll(1, dims=0))
        shifted_positions = model(tokens).logits
    assert (same_token_everywhere[1:] - same_token_everywhere[:-1]).abs().amax() > 1e-2
    assert (shifted_positions - reference).abs().amax() > 1e-2


def test_export_back_to_hugging_face_gives_the_original_model(safetensors_dir, hf_model, tokens):
    exported = to_hf_gpt2(load_hf_gpt2(str(safetensors_dir))).eval()
    original = hf_model.state_dict()
    assert exported.state_dict().keys() == original.keys()
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    with torch.no_grad():
        assert torch.equal(exported(tokens).logits, hf_model(tokens).logits)


def test_tied_lm_head_in_the_file_is_accepted_and_an_untied_one_refused(hf_model):
    hf_state = dict(hf_model.state_dict())  # includes lm_head.weight, the same tensor as wte
    config = gpt_config_from_hf(hf_model.config.to_dict())
    converted = state_dict_from_hf(hf_state, GPT(config))
    assert torch.equal(converted["lm_head.weight"], hf_state["transformer.wte.weight"])
    assert torch.equal(
        converted["transformer.h.0.mlp.c_fc.weight"],
        hf_state["transformer.h.0.mlp.c_fc.weight"].t(),
    )
    hf_state["lm_head.weight"] = hf_state["lm_head.weight"] + 1.0
    with pytest.raises(RoseError, match="lm_head.weight differs from the token embedding"):
        state_dict_from_hf(hf_state, GPT(config))


def test_weights_of_another_shape_are_named(hf_model):
    config = gpt_config_from_hf({**hf_model.config.to_dict(), "n_layer": 2})
    with pytest.raises(RoseError, match=r"unexpected: transformer\.h\.2\."):
        state_dict_from_hf(hf_model.state_dict(), GPT(config))


@pytest.mark.parametrize(
    "edit, expected",
    [
        ({"model_type": "llama"}, "not a GPT-2 model: config.json has model_type 'llama'"),
        ({"activation_function": "relu"}, "activation_function='relu'"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
        ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn=True"),
        ({"n_inner": 100}, "n_inner=100"),
    ],
)
def test_other_architectures_are_refused(safetensors_dir, tmp_path, edit, expected):
    config = json.loads((safetensors_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **edit}))
    shutil.copy(safetensors_dir / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(RoseError, match="rose") as info:
        load_hf_gpt2(str(tmp_path))
    assert expected in str(info.value)


def test_old_config_keys_and_defaults(hf_model):
    """The oldest configs say n_ctx, and leave out keys whose value is GPT-2's default."""
    old = {"model_type": "gpt2", "n_ctx": 64, "n_embd": 32, "n_head": 4, "n_layer": 2}
    config = gpt_config_from_hf(old)
    assert (config.block_size, config.n_embd, config.vocab_size, config.dropout) == (
        64,
        32,
        50257,
        0.0,
    )


def test_unreadable_sources_give_clear_errors(tmp_path, monkeypatch):
    import huggingface_hub.constants

    with pytest.raises(RoseError, match="has no config.json"):
        load_hf_gpt2(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(RoseError, match="has neither model.safetensors nor pytorch_model.bin"):
        load_hf_gpt2(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(RoseError, match="cannot read .*model.safetensors"):
        load_hf_gpt2(str(tmp_path))
    # Neither a folder nor a reachable Hub id: the message tells offline users what to do.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for missing in (str(tmp_path / "no-such-folder"), "nobody/no-such-model"):
        with pytest.raises(RoseError, match="offline, pass a local directory"):
            load_hf_gpt2(missing)
