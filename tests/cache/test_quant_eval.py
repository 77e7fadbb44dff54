"""The quantized cache from the command lines: rose-generate's flags and roseinfer.cli.eval."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from models import make_test_model

from rosecourse.demo import wide_random_init
from roseinfer.cli import eval as rose_eval
from roseinfer.cli import generate as cli_generate
from roseinfer.cli.eval import (
    CacheChoice,
    agreement_prompts,
    batches_of_equal_length,
    cached_perplexity,
    full_forward_perplexity,
    greedy_agreement,
    greedy_runs,
    teacher_forced_top1,
    windows,
)
from rosetrainer.checkpoint import save_checkpoint
from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError
from rosetrainer.model import GPT
from rosetrainer.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# GPT-2's vocabulary, so the gpt2 tokenizer reads and writes its ids; head size 16.
TINY = GPTConfig(vocab_size=50257, block_size=48, n_layer=1, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("quant") / "wide.pt"
    model = wide_random_init(GPT(TINY), 0)
    save_checkpoint(
        path,
        {"model": model.state_dict(), "model_config": TINY.to_dict(), "tokenizer_name": "gpt2"},
    )
    return path


def run_main(module, capsys: pytest.CaptureFixture, *args: object) -> tuple[int, str, str]:
    code = module.main([str(arg) for arg in args])
    out, err = capsys.readouterr()
    return code, out, err


# -- rose-generate --kv-cache-dtype ----------------------------------------------------


def test_generate_with_a_window_over_the_whole_run_equals_auto(
    checkpoint: Path, capsys: pytest.CaptureFixture
) -> None:
    common = ["--checkpoint-path", checkpoint, "--prompt", "ROMEO:", "--temperature", "0"]
    common += ["--max-new-tokens", "24", "--no-stop-at-eot", "--json"]
    code, out, _ = run_main(cli_generate, capsys, *common)
    assert code == 0
    auto = json.loads(out)["token_ids"]
    for kv_cache_dtype in ("int8", "int4"):
        quant = ["--kv-cache-dtype", kv_cache_dtype, "--kv-cache-group-size", "16"]
        code, out, err = run_main(cli_generate, capsys, *common, *quant, "--kv-cache-window", 48)
        assert code == 0
        assert f"kv cache dtype: {kv_cache_dtype} (group size 16, latest 48 tokens exact)" in err
        assert json.loads(out)["token_ids"] == auto


CLI_MISTAKES = {
    "unknown dtype": (["--kv-cache-dtype", "int3"], r"--kv-cache-dtype: invalid choice: 'int3'"),
    "group size": (
        ["--kv-cache-dtype", "int8", "--kv-cache-group-size", "5"],
        "KV cache group size 5 does not divide the head size 16: use one of 1, 2, 4, 8, 16",
    ),
    "negative window": (
        ["--kv-cache-dtype", "int4", "--kv-cache-group-size", "8", "--kv-cache-window", "-2"],
        "the KV cache window is a number of tokens >= 0, got -2",
    ),
    "not the static cache": (
        ["--kv-cache-dtype", "int8", "--cache", "concat"],
        "--kv-cache-dtype int8 quantizes the static cache",
    ),
    "compiled": (["--kv-cache-dtype", "int8", "--compile"], "--compile needs the unquantized"),
}


@pytest.mark.parametrize("case", list(CLI_MISTAKES))
def test_cli_mistakes_are_one_line(
    case: str, checkpoint: Path, capsys: pytest.CaptureFixture
) -> None:
    flags, message = CLI_MISTAKES[case]
    code, out, err = run_main(cli_generate, capsys, "--checkpoint-path", checkpoint, *flags)
    assert code == 2 and out == ""
    [line] = err.splitlines()
    assert line.startswith("[roseinfer] error: ") and re.search(message, line), line


# -- roseinfer.cli.eval's parts ------------------------------------------------------------


def test_windows_predict_every_token_once() -> None:
    ids = list(range(100))
    rows = windows(ids, 16)
    assert [len(row) for row in rows] == [17] * 6 + [4]
    assert [t for row in rows for t in row[1:]] == ids[1:]
    batches = batches_of_equal_length(rows, 4, torch.device("cpu"))
    assert [tuple(b.shape) for b in batches] == [(4, 17), (2, 17), (1, 4)]


@pytest.fixture(scope="module")
def model() -> GPT:
    return make_test_model(seed=0, block_size=64)  # head size 16


def test_cached_perplexity_of_the_unquantized_cache_is_the_forward_pass(model: GPT) -> None:
    ids = torch.randint(
        0, model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(1)
    )
    batches = batches_of_equal_length(windows(ids.tolist(), 32), 8, torch.device("cpu"))
    reference = full_forward_perplexity(model, batches)
    cached = cached_perplexity(model, batches, CacheChoice("auto"))
    assert cached.n_tokens == reference.n_tokens == 299
    assert cached.value == pytest.approx(reference.value, rel=1e-5)
    int4 = cached_perplexity(model, batches, CacheChoice("int4", window=0, group_size=8))
    assert abs(int4.value / reference.value - 1) > 1e-4  # the quantized cache is measured


@pytest.mark.slow
def test_greedy_agreement_finds_where_a_coarse_cache_departs(model: GPT) -> None:
    prompts = agreement_prompts(list(range(5, 400)), 3, 6)
    references, _ = greedy_runs(model, prompts, 56, CacheChoice("auto"))
    exact = greedy_agreement(model, prompts, references, CacheChoice("auto"))
    assert exact.first_divergence == [None, None, None] and exact.top1_agreement == 1.0
    coarse = CacheChoice("int4", window=0, group_size=16, keys_per="token")
    result = greedy_agreement(model, prompts, references, coarse)
    assert any(step is not None for step in result.first_divergence)
    assert result.top1_agreement < 1.0
    # Up to the first departure both runs saw the same tokens: teacher forcing agrees there.
    for prompt, reference, first in zip(prompts, references, result.first_divergence, strict=True):
        same = teacher_forced_top1(model, prompt, reference, coarse)
        if first is not None:
            assert all(same[:first]) and not same[first]


# -- python -m roseinfer.cli.eval ----------------------------------------------------------


def test_eval_prints_one_row_per_cache(
    checkpoint: Path, tinyshakespeare_path: Path, capsys: pytest.CaptureFixture
) -> None:
    code, out, _ = run_main(
        rose_eval,
        capsys,
        *("--checkpoint-path", checkpoint, "--text-file", tinyshakespeare_path),
        *("--max-tokens", 96, "--prompts", 2, "--steps", 8, "--kv-cache-group-size", 16),
    )
    assert code == 0
    rows = {line.split("  ")[0]: line for line in out.splitlines()}
    assert set(rows) >= {
        "none (one forward pass)",
        "auto",
        "int8 (window 32, group 16)",
        "int4 (window 32, group 16)",
    }
    assert re.search(
        r"^auto\s+256\s+1\.000\s+4,096\s+[\d,.]+\s+[+-]0\.00%\s+100\.00%\s+none", rows["auto"]
    )


def test_eval_memory_table(capsys: pytest.CaptureFixture) -> None:
    args = ("--memory-only", "--preset", "tiny", "--request-len", 128)
    code, out, _ = run_main(rose_eval, capsys, *args)
    assert code == 0
    # tiny: 4 layers x 128 channels, a key and a value each: 1,024 numbers a token. Allocated
    # per token: with the window's buffer (32 + 32 tokens in float32) spread over 128 tokens.
    assert re.search(r"^auto\s+4,096\s+1\.000\s+4,096\s+2,048$", out, re.M)
    assert re.search(r"^int8 \(window 32, group 32\)\s+1,152\s+0\.281\s+3,200\s+", out, re.M)
    assert re.search(r"^int4 \(window 32, group 32\)\s+640\s+0\.156\s+2,688\s+", out, re.M)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-cache-dtype", "auto", "int3"], "unknown KV cache dtype 'int3'"),
        (["--kv-cache-group-size", "12"], "group size 12 does not divide the head size 16"),
        ([], "--text-file is required"),
    ],
)
def test_eval_mistakes_are_one_line(
    flags: list[str], message: str, checkpoint: Path, capsys: pytest.CaptureFixture
) -> None:
    code, out, err = run_main(rose_eval, capsys, "--checkpoint-path", checkpoint, *flags)
    if "--text-file" not in message:
        code, out, err = run_main(
            rose_eval, capsys, "--checkpoint-path", checkpoint, "--text-file", __file__, *flags
        )
    assert code == 2 and out == ""
    [line] = err.splitlines()
    assert line.startswith("[roseinfer.cli.eval] error: ") and message in line, line


@pytest.mark.parametrize(
    ("path", "why"), [("/dev/null", "is not a regular file"), ("/", "is a directory")]
)
def test_a_text_file_that_is_no_file_is_named_so(path: str, why: str) -> None:
    with pytest.raises(RoseError, match=f"^text file {path} {why}$"):
        rose_eval.split_ids(path, Tokenizer("gpt2"), "val")


def test_several_prompts_run_through_a_quantized_engine(
    checkpoint: Path, capsys: pytest.CaptureFixture
) -> None:
    common = ["--checkpoint-path", checkpoint, "--temperature", "0", "--max-new-tokens", "16"]
    common += ["--prompt", "ROMEO:", "--prompt", "To be or not", "--no-stop-at-eot"]
    code, auto, err = run_main(cli_generate, capsys, *common)
    assert code == 0 and "kv cache: paged (engine)" in err
    quant = ["--kv-cache-dtype", "int8", "--kv-cache-group-size", "16"]
    code, out, err = run_main(cli_generate, capsys, *common, *quant, "--kv-cache-window", 32)
    assert code == 0 and "kv cache: paged (engine)" in err
    assert "kv cache dtype: int8 (group size 16, latest 32 tokens exact)" in err
    assert out == auto  # the window covers every token: the engine's exact tokens


def test_serve_refuses_a_bad_group_size_in_one_line(
    checkpoint: Path, capsys: pytest.CaptureFixture
) -> None:
    from roseinfer.cli import serve  # FastAPI: a slow import, for this test only

    flags = ["--kv-cache-dtype", "int4", "--kv-cache-group-size", "5", "--port", "0"]
    code, out, err = run_main(serve, capsys, "--checkpoint-path", checkpoint, *flags)
    assert code == 2 and out == ""
    [line] = err.splitlines()
    assert line.startswith("[rose-serve] error: ")
    assert "KV cache group size 5 does not divide the head size 16" in line
