"""Rotary positions, the sliding-window mask and its sinks, in the one model.

The rotation is held to transformers' own Llama RoPE (`LlamaRotaryEmbedding` for the
angles, `apply_rotary_pos_emb` for the turn) on the same random tensors; the banded
mask to its definition; the config to checkpoints written before these fields existed.
"""

from __future__ import annotations

import pytest
import torch
from models import assert_logits_close
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from rosetrainer import model as gpt
from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError
from rosetrainer.model import GPT

# float32: both sides compute the same angles (position * inverse frequency in float32)
# and the same products; only the order of a few roundings may differ.
ROTARY_ATOL = 1e-5


@pytest.mark.parametrize("head_dim", [8, 64])
def test_rotation_equals_transformers_llama(head_dim: int) -> None:
    torch.manual_seed(0)
    batch, n_head, seq = 2, 3, 7
    q = torch.randn(batch, n_head, seq, head_dim)
    k = torch.randn(batch, n_head, seq, head_dim)
    # Per-row positions, as a left-padded batch has them, and one far past any context.
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 7, 8, 5000]])
    llama = LlamaConfig(hidden_size=head_dim * n_head, num_attention_heads=n_head)
    hf_cos, hf_sin = LlamaRotaryEmbedding(llama)(q, pos)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)

    cos, sin = gpt.rotary_cos_sin(pos, head_dim)
    torch.testing.assert_close(cos[:, 0], hf_cos, atol=ROTARY_ATOL, rtol=0)
    torch.testing.assert_close(sin[:, 0], hf_sin, atol=ROTARY_ATOL, rtol=0)
    torch.testing.assert_close(gpt.apply_rotary(q, cos, sin), hf_q, atol=ROTARY_ATOL, rtol=0)
    torch.testing.assert_close(gpt.apply_rotary(k, cos, sin), hf_k, atol=ROTARY_ATOL, rtol=0)


def test_rotary_scores_depend_on_distance_only() -> None:
    """A query at p against a key at s scores the same as at p + d against s + d."""
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(p: int, s: int) -> float:
        turn = lambda x, at: gpt.apply_rotary(x, *gpt.rotary_cos_sin(torch.tensor([[at]]), 16))  # noqa: E731
        return float((turn(q, p) * turn(k, s)).sum())

    assert score(9, 4) == pytest.approx(score(109, 104), abs=1e-4)
    assert score(9, 4) != pytest.approx(score(9, 5), abs=1e-3)


def test_banded_mask_is_window_and_sinks() -> None:
    mask = gpt.banded_mask(6, 6, window=2, sinks=1)
    want = [[1 if (j <= i and (i - j < 2 or j < 1)) else 0 for j in range(6)] for i in range(6)]
    assert mask.int().tolist() == want
    # Bottom-right aligned like causal_mask: one decode query at position 5 of 6.
    assert gpt.banded_mask(1, 6, window=2, sinks=1).int().tolist() == [want[-1]]
    assert torch.equal(gpt.banded_mask(4, 6, None), gpt.causal_mask(4, 6))


def test_rotary_model_has_no_position_table_and_old_configs_load_learned() -> None:
    tiny = dict(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=8)
    rotary = GPT(GPTConfig(**tiny, position_embedding="rotary"))
    assert "transformer.wpe.weight" not in rotary.state_dict()
    # A config dict saved before the field existed is GPT-2's learned positions.
    old = GPTConfig.from_dict(tiny)
    assert old.position_embedding == "learned" and old.sliding_window is None
    assert "transformer.wpe.weight" in GPT(old).state_dict()
    assert GPTConfig.from_dict(rotary.config.to_dict()) == rotary.config


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(position_embedding="alibi"), "learned or rotary"),
        (dict(position_embedding="rotary", n_embd=6, n_head=2), "must be even"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(attention_sinks=2), "set sliding_window too"),
    ],
)
def test_bad_position_settings_are_refused(values: dict, message: str) -> None:
    with pytest.raises(RoseError, match=message):
        GPTConfig(**{"n_embd": 8, "n_head": 2, **values})


def test_uncached_forward_uses_the_banded_mask() -> None:
    """The model without a cache equals plain attention under banded_mask (the oracle's mask)."""
    torch.manual_seed(2)
    config = GPTConfig(
        vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=16,
        position_embedding="rotary", sliding_window=4, attention_sinks=1,
    )  # fmt: skip
    model = GPT(config).eval()
    idx = torch.randint(0, 64, (1, 20))
    mask = gpt.banded_mask(20, 20, 4, 1)
    with torch.no_grad():
        windowed = model(idx).logits
        full = GPT(GPTConfig(**{**config.to_dict(), "sliding_window": None, "attention_sinks": 0}))
        full.load_state_dict(model.state_dict())
        plain = full.eval()(idx).logits
        # A model without a window, fed banded_mask through a one-call cache, is the same model.
        banded = full(idx, cache=OneCallCache(mask)).logits
    assert_logits_close(windowed, banded)
    assert not torch.allclose(windowed, plain, atol=1e-3)  # the window matters here


class OneCallCache:
    """A cache that holds nothing: positions from 0, and the mask it was given."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask

    def prepare(self, batch: int, q_len: int, device: torch.device):
        return gpt.position_ids(0, q_len, device)[None, :], self.mask

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        return k, v


def test_positions_past_block_size_only_for_a_windowed_rotary_model() -> None:
    tiny = dict(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=8)
    idx = torch.randint(0, 64, (1, 12))
    with pytest.raises(RoseError, match="block_size"):
        GPT(GPTConfig(**tiny, position_embedding="rotary"))(idx)
    windowed = GPT(GPTConfig(**tiny, position_embedding="rotary", sliding_window=4))
    assert windowed(idx).logits.shape == (1, 12, 64)


def test_trainer_flags_choose_rotary_positions_a_window_and_sinks(tmp_path) -> None:
    from rosetrainer.train import parse_args, resolve_configs

    flags = parse_args(
        ["--preset", "tiny", "--position-embedding", "rotary", "--sliding-window", "32",
         "--attention-sinks", "4", "--checkpoint-path", str(tmp_path / "run")]
    )  # fmt: skip
    model_cfg, _ = resolve_configs(flags)
    assert (model_cfg.position_embedding, model_cfg.sliding_window) == ("rotary", 32)
    assert model_cfg.attention_sinks == 4 and model_cfg.unbounded
    with pytest.raises(RoseError, match="invalid choice: 'alibi'"):  # one line, exit code 2
        parse_args(["--position-embedding", "alibi"])
