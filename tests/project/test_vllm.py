"""A rose model in vLLM: the folder rose-export-hf writes runs in vLLM's CPU build, offline
(`vllm.LLM`) and served (`vllm serve` with the official openai client), and vLLM's greedy
tokens are rose's uncached greedy tokens, prompt for prompt.

vLLM lives in a venv of its own (.ci/vllm-venv makes it; .ci/run exports its python as
ROSE_VLLM_PYTHON), and the offline run is benchmarks/vllm_runner.py in that python.
Without the venv these tests fail in CI (CI=true, or ROSE_VLLM_PYTHON set) and skip
elsewhere, saying how to make it. Docs: docs/vllm.md shows the same steps by hand.

The model is conftest's tiny_hf_export, the one tests/trainer/test_export_hf.py checks in
transformers: the `tiny` preset (the CPU quickstart's shape; vLLM's CPU attention wants
heads of 32 or more) with random weights of std 0.2, greedy text with clear margins.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from models import assert_clear_margins, assert_varied
from openai import OpenAI

from benchmarks import vllm_venv
from benchmarks.serving_compare import free_port, server_process
from roseinfer.loading import load_model_and_tokenizer
from roseinfer.loops.generate import GenerationResult, generate
from roseinfer.request.sampling import SamplingParams
from rosetrainer.numerics import logit_tolerance
from rosetrainer.tokenizer import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = [
    "ROMEO: But, soft! what light through yonder window breaks?",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "Ünïcödé, 日本語, emoji 🌹",
    "a",
]
NEW_TOKENS = 24
MODEL_NAME = "rose-tiny"
# vLLM's pool, allocated whole at startup: the tiny model's 4 prompts need a few MiB.
KV_CACHE_GIB = 1
# float32, the oracle's dtype (vLLM's `auto` runs float32 weights in bfloat16 on a CPU);
# the context the export's config.json states; eager: the test checks vLLM's arithmetic,
# not its compiler, and torch.compile would add tens of seconds to each start.
ENGINE_ARGS = {"dtype": "float32", "max_model_len": 128, "enforce_eager": True}


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    python = vllm_venv.vllm_python()
    if python is not None and python.is_file():
        return python
    why = (
        f"vLLM's venv: {python} does not exist" if python else "no vLLM venv"
    ) + " (make it with .ci/vllm-venv, then export ROSE_VLLM_PYTHON=<the python it prints>)"
    if os.environ.get("CI") == "true" or os.environ.get("ROSE_VLLM_PYTHON"):
        pytest.fail(why)  # CI promised vLLM: its absence is a failure, never a skip
    pytest.skip(why)


@pytest.fixture(scope="module")
def oracle(tiny_run_dir: Path) -> list[GenerationResult]:
    """rose's uncached greedy run of each prompt, from the checkpoint (not the export),
    end-of-text an ordinary token as vLLM's ignore_eos makes it."""
    model, tokenizer, _ = load_model_and_tokenizer(str(tiny_run_dir))
    results = []
    for text in PROMPTS:
        params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
        with torch.no_grad():
            result = generate(
                model, tokenizer.encode(text), params, use_cache=False, keep_logits=True
            )
        assert len(result.token_ids) == NEW_TOKENS
        assert_varied(result.token_ids)
        assert_clear_margins(result.step_logits)
        results.append(result)
    return results


@pytest.mark.oracle
def test_vllm_offline_generates_roses_greedy_tokens(
    vllm_python: Path, tiny_hf_export: Path, oracle: list[GenerationResult]
) -> None:
    run = vllm_venv.run_offline(
        tiny_hf_export,
        PROMPTS,  # text: vLLM tokenizes it with the tiny_hf_export tokenizer
        [NEW_TOKENS] * len(PROMPTS),
        engine_args=ENGINE_ARGS,
        kv_cache_gib=KV_CACHE_GIB,
        logprobs=0,  # the chosen token's log-probability
    )
    print(f"vLLM offline: started in {run.startup_s:.1f} s, generated in {run.generate_s:.1f} s")
    tokenizer = Tokenizer()
    for text, want, got in zip(PROMPTS, oracle, run.outputs, strict=True):
        assert got.prompt_token_ids == tokenizer.encode(text)
        assert got.token_ids == want.token_ids, f"prompt {text!r}"
        assert got.text == tokenizer.decode(want.token_ids)
        # float32 through and through: each chosen token's log-probability is rose's within
        # the one float32 tolerance (bfloat16 would miss it by orders of magnitude).
        for step, (logits, token, logprob) in enumerate(
            zip(want.step_logits, want.token_ids, got.logprobs, strict=True)
        ):
            rose_logprob = float(torch.log_softmax(logits.double(), -1)[token])
            gap = abs(logprob - rose_logprob)
            assert gap <= logit_tolerance(logits), f"prompt {text!r} step {step}: {gap:.1e}"


def test_vllm_serve_answers_with_roses_greedy_tokens(
    vllm_python: Path, tiny_hf_export: Path, oracle: list[GenerationResult], tmp_path: Path
) -> None:
    port = free_port()
    command = vllm_venv.serve_command(
        vllm_python, tiny_hf_export, port, "--served-model-name", MODEL_NAME,
        "--dtype", "float32", "--max-model-len", "128", "--enforce-eager",
    )  # fmt: skip
    env = vllm_venv.vllm_env(vllm_python, KV_CACHE_GIB)
    url = f"http://127.0.0.1:{port}/v1"
    tokenizer = Tokenizer()
    with server_process(command, tmp_path / "vllm.log", base_url=url, env=env):
        client = OpenAI(base_url=url, api_key="unused")
        assert [model.id for model in client.models.list()] == [MODEL_NAME]
        for text, want in zip(PROMPTS, oracle, strict=True):
            completion = client.completions.create(
                model=MODEL_NAME,
                prompt=text,
                max_tokens=NEW_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},  # vLLM's own fields
            )
            (choice,) = completion.choices
            assert choice.prompt_token_ids == tokenizer.encode(text)
            assert choice.token_ids == want.token_ids, f"prompt {text!r}"
            assert choice.text == tokenizer.decode(want.token_ids)
            assert choice.finish_reason == "length"
            assert completion.usage.completion_tokens == NEW_TOKENS
        # Streamed, the chunks add up to the same text.
        stream = client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS[0],
            max_tokens=NEW_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert streamed == tokenizer.decode(oracle[0].token_ids)


@pytest.mark.oracle
def test_vllm_runs_an_exported_llama_shaped_checkpoint_with_roses_greedy_tokens(
    vllm_python: Path, tmp_path: Path
) -> None:
    """The tiny-llama preset (4 query heads over 2 key/value heads, RMSNorm, SwiGLU, rotary
    base 500,000, untied), exported as a LlamaForCausalLM: vLLM's greedy tokens are rose's
    uncached ones."""
    from models import write_random_checkpoint

    from roseinfer.cli.export_hf import main as export_main
    from rosetrainer.config import GPTConfig

    config = GPTConfig.from_preset("tiny-llama", rotary_base=500000.0, tie_embeddings=False)
    checkpoint = write_random_checkpoint(tmp_path / "run.pt", config)
    folder = tmp_path / "hf"
    assert export_main(["--checkpoint-path", str(checkpoint), "--out", str(folder)]) == 0
    model, tokenizer, _ = load_model_and_tokenizer(str(checkpoint))
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    oracle = []
    for text in PROMPTS:
        with torch.no_grad():
            result = generate(
                model, tokenizer.encode(text), params, use_cache=False, keep_logits=True
            )
        assert_clear_margins(result.step_logits)
        oracle.append(result.token_ids)
    run = vllm_venv.run_offline(
        folder,
        PROMPTS,
        [NEW_TOKENS] * len(PROMPTS),
        engine_args=ENGINE_ARGS,
        kv_cache_gib=KV_CACHE_GIB,
        logprobs=0,
    )
    assert [got.token_ids for got in run.outputs] == oracle
