"""rose generating with Hugging Face GPT-2 weights makes the tokens transformers makes.

The reference is `transformers`' own greedy `generate` (with its own KV cache) on a
random GPT2LMHeadModel; rose loads the same saved folder with `load_hf_gpt2` and runs
its oracle and both caches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models import assert_clear_margins, assert_logits_close, assert_varied

from roseinfer.cache.dense import ConcatKVCache, StaticKVCache
from roseinfer.loops.generate import generate
from roseinfer.request.sampling import SamplingParams
from rosetrainer.hf import load_hf_gpt2
from rosetrainer.tokenizer import Tokenizer

NEW_TOKENS = 48  # prompt + new tokens stay within n_positions (96): HF has no window policy
# Two implementations of one network (HF's Conv1D and its attention, rose's Linear and
# SDPA) agree to float32 rounding, like a cached path and the oracle: one tolerance.

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hf_model(hf_gpt2_dir: Path):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(hf_gpt2_dir).eval()


@pytest.fixture(scope="module")
def rose_model(hf_gpt2_dir: Path):
    return load_hf_gpt2(str(hf_gpt2_dir)).eval()


def hf_greedy(hf_model, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and raw logits per step, never stopping at end-of-text."""
    from transformers import GenerationConfig as HFGenerationConfig

    config = HFGenerationConfig(
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=None,
        pad_token_id=50256,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=config,
        )
    return out.sequences[0, len(prompt) :].tolist(), [step[0] for step in out.logits]


@pytest.mark.parametrize(
    "text", ["The quick brown fox jumps over the lazy dog", "To be, or not to be:"]
)
@pytest.mark.slow
def test_rose_greedy_equals_transformers_generate(hf_model, rose_model, text: str) -> None:
    prompt = Tokenizer("gpt2").encode(text)
    expected, hf_logits = hf_greedy(hf_model, prompt)
    assert len(expected) == NEW_TOKENS
    assert_varied(expected)

    config = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    oracle = generate(rose_model, prompt, config, use_cache=False, keep_logits=True)
    assert_clear_margins(oracle.step_logits)
    assert oracle.token_ids == expected
    max_diff = max(
        assert_logits_close(ours, theirs)
        for ours, theirs in zip(oracle.step_logits, hf_logits, strict=True)
    )
    print(f"{text!r}: max |rose - transformers logit| {max_diff:.2e}")

    for cache in (ConcatKVCache(), StaticKVCache(rose_model)):
        assert generate(rose_model, prompt, config, cache=cache).token_ids == expected
