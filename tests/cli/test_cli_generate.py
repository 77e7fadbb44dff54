"""rose-generate end to end: text on stdout, status on stderr, one clear line per mistake.

A few runs are real subprocesses (what a user types); the many bad-input cases call
`main(argv)` in this process, which goes through the same `run_cli` wrapper.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models import assert_clear_margins

from rosecourse.demo import wide_random_init
from roseinfer.cli import generate as cli_generate
from roseinfer.cli.engine_flags import engine_config
from roseinfer.engine.config import EngineConfig
from roseinfer.loops.generate import generate
from roseinfer.request.sampling import SamplingParams
from rosetrainer.checkpoint import save_checkpoint
from rosetrainer.config import GPTConfig
from rosetrainer.hf import load_hf_gpt2
from rosetrainer.model import GPT
from rosetrainer.tokenizer import StreamDecoder, Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

JSON_FIELDS = {
    "prompt",
    "prompt_token_ids",
    "token_ids",
    "text",
    "finish_reason",
    "stop_reason",
    "time_to_first_token_ms",
    "tokens_per_s",
    "total_time_ms",
}


# Tiny models on a shared 2-core machine run faster on one thread.
def one_thread_env() -> dict[str, str]:
    # Read at call time: the session fixture has set TIKTOKEN_CACHE_DIR by then.
    return {**os.environ, "OMP_NUM_THREADS": "1"}


# GPT-2's vocabulary, so the gpt2 tokenizer can decode whatever it samples.
TINY = GPTConfig(vocab_size=50257, block_size=64, n_layer=1, n_head=2, n_embd=32)


def write_checkpoint(path: Path, config: GPTConfig = TINY) -> None:
    """A tiny rose checkpoint in the trainer's format."""
    torch.manual_seed(0)
    state = {
        "model": GPT(config).state_dict(),
        "model_config": config.to_dict(),
        "tokenizer_name": "gpt2",
    }
    save_checkpoint(path, state)


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A training run's directory holding best.pt."""
    directory = tmp_path_factory.mktemp("tiny_run")
    write_checkpoint(directory / "best.pt")
    return directory


def cli(*args: str | Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "roseinfer.cli_generate", *map(str, args)]
    return subprocess.run(
        command, capture_output=True, text=True, env=one_thread_env(), timeout=120
    )


def main(capsys: pytest.CaptureFixture, *args: str | Path) -> tuple[int, str, str]:
    """Run the CLI in this process: (exit code, stdout, stderr)."""
    code = cli_generate.main([str(arg) for arg in args])
    out, err = capsys.readouterr()
    return code, out, err


def json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]


# -- real processes --


@pytest.mark.slow
def test_streamed_text_equals_the_json_text(run_dir: Path) -> None:
    prompt = "Hello, 世界"
    args = [
        "--checkpoint-path", run_dir, "--prompt", prompt, "--prompt", "",
        "--max-new-tokens", "16", "--seed", "5", "--no-stop-at-eot",
    ]  # fmt: skip
    streamed = cli(*args)
    as_json = cli(*args, "--json")
    for done in (streamed, as_json):
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr

    results = json_lines(as_json.stdout)
    assert [r["prompt"] for r in results] == [prompt, ""]
    tokenizer = Tokenizer("gpt2")
    for result in results:
        assert set(result) == JSON_FIELDS
        assert len(result["token_ids"]) == 16
        assert result["finish_reason"] == "length"
        assert result["text"] == tokenizer.decode(result["token_ids"])
        assert result["time_to_first_token_ms"] > 0
        assert result["total_time_ms"] >= result["time_to_first_token_ms"]
        assert result["tokens_per_s"] > 0
    assert results[0]["prompt_token_ids"] == tokenizer.encode(prompt)
    assert results[1]["prompt_token_ids"] == [tokenizer.eot_id]  # an empty prompt
    # The stream is the prompt, then its continuation, then a newline, per prompt.
    assert streamed.stdout == "".join(r["prompt"] + r["text"] + "\n" for r in results)

    status_lines = streamed.stderr.splitlines()
    assert all(line.startswith("[roseinfer] ") for line in status_lines)
    assert "[roseinfer] device: cpu" in status_lines
    assert "[roseinfer] dtype: float32" in status_lines
    n_params = GPT(TINY).num_params(non_embedding=False)
    assert f"[roseinfer] model: {run_dir / 'best.pt'} ({n_params:,} params)" in status_lines
    assert f"[roseinfer] prompt tokens: {len(tokenizer.encode(prompt))}" in status_lines
    assert "[roseinfer] finish reason: length" in status_lines
    assert re.search(r"^\[roseinfer\] time to first token: \d+\.\d ms$", streamed.stderr, re.M)
    assert re.search(r"^\[roseinfer\] tokens/s: \d+\.\d$", streamed.stderr, re.M)


@pytest.mark.slow
def test_hugging_face_directory_greedy(hf_gpt2_dir: Path) -> None:
    prompt = "The quick brown fox"
    done = cli(
        "--hf-model", hf_gpt2_dir, "--prompt", prompt, "--temperature", "0",
        "--max-new-tokens", "12", "--no-stop-at-eot", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    [result] = json_lines(done.stdout)
    model = load_hf_gpt2(str(hf_gpt2_dir)).eval()
    config = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt_ids = Tokenizer("gpt2").encode(prompt)
    expected = generate(model, prompt_ids, config, use_cache=False, keep_logits=True)
    assert_clear_margins(expected.step_logits)
    assert result["token_ids"] == expected.token_ids
    assert f"[roseinfer] model: {hf_gpt2_dir} (" in done.stderr


@pytest.mark.slow
def test_no_checkpoint_anywhere_says_how_to_train_one(tmp_path: Path) -> None:
    console_script = Path(sys.executable).with_name("rose-generate")
    done = subprocess.run(
        [console_script],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=one_thread_env(),
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith("[roseinfer] error: no checkpoint given and none under checkpoints/")
    assert "python -m rosetrainer.train --preset tiny" in line


# -- in this process --


@pytest.fixture(scope="module")
def bad_files(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of things that are not a usable checkpoint (and no prompts.txt)."""
    folder = tmp_path_factory.mktemp("bad_files")
    (folder / "garbage.pt").write_bytes(b"not a checkpoint at all")
    real = (run_dir / "best.pt").read_bytes()
    (folder / "truncated.pt").write_bytes(real[: len(real) // 2])
    (folder / "empty_run").mkdir()
    small_vocab = GPTConfig(vocab_size=512, block_size=64, n_layer=1, n_head=2, n_embd=32)
    write_checkpoint(folder / "small_vocab.pt", small_vocab)
    return folder


BAD_INPUTS = {
    "missing checkpoint": (["--checkpoint-path", "{tmp}/nope.pt"], "checkpoint not found"),
    "corrupt checkpoint": (["--checkpoint-path", "{tmp}/garbage.pt"], "not a PyTorch checkpoint"),
    "truncated checkpoint": (["--checkpoint-path", "{tmp}/truncated.pt"], "is truncated"),
    "run dir without checkpoints": (["--checkpoint-path", "{tmp}/empty_run"], "no .pt files"),
    "unknown tokenizer": (["--tokenizer-name", "nope"], "unknown tokenizer 'nope'"),
    "tokenizer bigger than the model": (
        ["--checkpoint-path", "{tmp}/small_vocab.pt"],
        "'gpt2' has 50257 tokens but the model's vocabulary has 512",
    ),
    "top_p zero": (["--top-p", "0"], r"--top-p must be in \(0, 1\], got 0.0"),
    "top_p over one": (["--top-p", "1.5"], "--top-p must be in"),
    "negative top_k": (["--top-k", "-2"], "--top-k must be an integer >= 0"),
    "negative temperature": (["--temperature", "-0.5"], "--temperature must be a finite number"),
    "negative max_new_tokens": (["--max-new-tokens", "-1"], "^.{19}--max-new-tokens must be an"),
    "zero max_new_tokens": (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1"),
    "zero-token KV blocks with one prompt": (
        ["--kv-block-size", "0"],
        "--kv-block-size must be an integer >= 1, got 0",
    ),
    "zero batch size": (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    "batch size on the engine path": (
        ["--prompt", "a", "--prompt", "b", "--batch-size", "4"],
        "--batch-size sizes the left-padded batches .*: the engine .* takes --max-num-seqs",
    ),
    "zero running sequences": (
        ["--prompt", "a", "--prompt", "b", "--max-num-seqs", "0"],
        "--max-num-seqs must be an integer >= 1, got 0",
    ),
    "an attention the engine does not have": (
        ["--prompt", "a", "--prompt", "b", "--attention", "fast"],
        r"argument --attention: invalid choice: 'fast' \(choose from .*'kernel'",
    ),
    "float16 on CPU": (
        ["--device", "cpu", "--dtype", "float16"],
        "float16 is not supported on CPU; use bfloat16 or float32",
    ),
    "prompt over the context": (
        ["--prompt", "word " * 80],
        r"prompt 1 has \d+ tokens but the model's context \(block_size\) is 64",
    ),
    "missing prompt file": (["--prompt-file", "{tmp}/prompts.txt"], "prompts.txt not found"),
    "a device as the prompt file": (
        ["--prompt-file", "/dev/zero"],
        "prompt file /dev/zero is not a regular file",
    ),
    "a folder as the prompt file": (["--prompt-file", "{tmp}"], "is a directory"),
    "empty stop string": (["--stop", ""], "stop strings must be non-empty"),
    "compile without the static cache": (
        ["--compile", "--cache", "concat"],
        "--compile compiles the static cache's decode step",
    ),
    "compile with the offloaded cache": (
        ["--compile", "--cache", "offloaded"],
        "--compile compiles the static cache's decode step: drop --no-kv-cache and --cache "
        "offloaded",
    ),
    "offloaded cache quantized": (
        ["--cache", "offloaded", "--kv-cache-dtype", "int8"],
        "--kv-cache-dtype int8 quantizes the static cache .* drop .*--cache offloaded",
    ),
    "offloaded cache on a split model": (
        ["--cache", "offloaded", "--pipeline-parallel-size", "2"],
        "a split model keeps a static or concat cache per stage: drop --cache offloaded",
    ),
    "compile mode that does not exist": (
        ["--compile", "fast"],
        r"argument --compile: invalid choice: 'fast' \(choose from .*'max-autotune'",
    ),
    "argparse: not an int": (["--max-new-tokens", "many"], "invalid int value: 'many'"),
    "argparse: unknown device": (["--device", "tpu"], "invalid choice: 'tpu'"),
    "argparse: two model sources": (["--hf-model", "{tmp}"], "not allowed with"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_code_2(
    case: str, run_dir: Path, bad_files: Path, capsys: pytest.CaptureFixture
) -> None:
    case_args, message = BAD_INPUTS[case]
    args = ["--checkpoint-path", run_dir] + [arg.format(tmp=bad_files) for arg in case_args]
    code, out, err = main(capsys, *args)
    assert code == 2
    assert out == ""
    [line] = err.splitlines()
    assert line.startswith("[roseinfer] error: ")
    assert re.search(message, line), line


def test_serve_and_cli_generate_take_the_engine_sizes_under_the_same_flags() -> None:
    from roseinfer.cli import serve

    argv = ["--kv-block-size", "8", "--max-num-seqs", "3", "--max-num-batched-tokens", "64"]
    argv += ["--kv-cache-memory", "1MiB", "--no-prefix-caching", "--kv-cache-dtype", "int8"]
    argv += ["--kv-cache-window", "0", "--kv-cache-group-size", "16", "--no-pack-weights"]
    argv += ["--attention", "flex", "--enforce-eager"]
    wanted = EngineConfig(
        kv_block_size=8,
        max_num_seqs=3,
        max_num_batched_tokens=64,
        kv_cache_memory="1MiB",
        enable_prefix_caching=False,
        kv_cache_dtype="int8",
        kv_cache_window=0,
        kv_cache_group_size=16,
        pack_weights=False,
        attention="flex",
        enforce_eager=True,
    )
    for front_door in (serve, cli_generate):
        assert engine_config(front_door.build_parser().parse_args(argv)) == wanted
    # Unset, both take the engine's own defaults.
    for front_door in (serve, cli_generate):
        assert engine_config(front_door.build_parser().parse_args([])) == EngineConfig()


def test_cuda_asked_for_where_there_is_none(
    run_dir: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = main(capsys, "--checkpoint-path", run_dir, "--device", "cuda")
    assert code == 2
    assert err == (
        "[roseinfer] error: --device cuda, but CUDA is not available here (no GPU, or a "
        "CPU-only torch); use --device cpu or auto\n"
    )


def test_bfloat16_on_a_gpu_without_it(
    run_dir: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    code, _, err = main(
        capsys, "--checkpoint-path", run_dir, "--device", "cuda", "--dtype", "bfloat16"
    )
    assert code == 2
    assert err == (
        "[roseinfer] error: bfloat16 is not supported on Tesla T4; use float16 or float32\n"
    )


def run_json(capsys: pytest.CaptureFixture, *args: str | Path) -> list[dict]:
    code, out, err = main(capsys, "--json", *args)
    assert code == 0, err
    return json_lines(out)


def test_every_path_and_every_prompt_start_fresh(
    run_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    """Two prompts in one run equal each prompt alone, whatever cache (or none) carries them."""
    common = ["--checkpoint-path", run_dir, "--max-new-tokens", "10", "--seed", "11"]
    prompts = ["--prompt", "To be", "--prompt", "or not"]
    together = run_json(capsys, *common, *prompts)
    alone = [run_json(capsys, *common, "--prompt", p)[0] for p in ("To be", "or not")]
    assert [r["token_ids"] for r in together] == [r["token_ids"] for r in alone]
    for path in (["--cache", "concat"], ["--no-kv-cache"]):
        other = run_json(capsys, *common, *prompts, *path)
        assert [r["token_ids"] for r in other] == [r["token_ids"] for r in together]


@pytest.mark.slow
def test_a_cached_prompt_runs_on_packed_weights_with_the_oracles_tokens(
    hf_gpt2_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    """One prompt on the static cache multiplies by weights packed for oneDNN (said on
    stderr); --no-pack-weights keeps them as stored; both give the uncached tokens."""
    common = ["--hf-model", hf_gpt2_dir, "--prompt", "To be", "--max-new-tokens", "12"]
    common += ["--temperature", "0"]
    runs = {}
    for name, flags in (
        ("packed", []),
        ("plain", ["--no-pack-weights"]),
        ("oracle", ["--no-kv-cache"]),
    ):
        code, out, err = main(capsys, "--json", *common, *flags)
        assert code == 0, err
        runs[name] = json_lines(out)[0]["token_ids"]
        assert ("packed for oneDNN" in err) == (name == "packed"), err
    assert runs["packed"] == runs["plain"] == runs["oracle"]


RAGGED_PROMPTS = ["Hi", "The quick brown fox jumps over the lazy dog, again and again"]


@pytest.mark.slow
@pytest.mark.parametrize("decoding", ["greedy", "seeded"])
def test_a_ragged_batch_equals_each_prompt_alone(
    decoding: str, run_dir: Path, hf_gpt2_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    # Greedy on the wide-init HF model (clear margins: a near-tie cannot flip a token);
    # sampling on the tiny checkpoint, one seed per row.
    if decoding == "greedy":
        common = ["--hf-model", hf_gpt2_dir, "--temperature", "0", "--max-new-tokens", "12"]
    else:
        common = ["--checkpoint-path", run_dir, "--seed", "11", "--max-new-tokens", "12"]
    prompts = [arg for prompt in RAGGED_PROMPTS for arg in ("--prompt", prompt)]
    together = run_json(capsys, *common, *prompts)
    alone = [run_json(capsys, *common, "--prompt", p)[0] for p in RAGGED_PROMPTS]
    assert [r["prompt"] for r in together] == RAGGED_PROMPTS
    lengths = [len(r["prompt_token_ids"]) for r in together]
    assert lengths[0] == 1 and lengths[1] > 10  # ragged: the batch is left-padded
    assert [r["token_ids"] for r in together] == [r["token_ids"] for r in alone]
    assert all(len(r["token_ids"]) > 0 for r in together)
    if decoding == "greedy":
        model = load_hf_gpt2(str(hf_gpt2_dir)).eval()
        config = SamplingParams(max_tokens=12)
        for result in together:
            expected = generate(
                model, result["prompt_token_ids"], config, use_cache=False, keep_logits=True
            )
            assert_clear_margins(expected.step_logits)
            assert result["token_ids"] == expected.token_ids


@pytest.mark.slow
def test_the_offloaded_cache_gives_each_row_of_a_ragged_batch_the_oracles_tokens(
    hf_gpt2_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    """--cache offloaded: keys and values in host memory (on a CPU, one device), the
    ragged batch left-padded; the same tokens as the uncached path (the greedy test above
    holds these prompts' oracles to clear margins)."""
    common = ["--hf-model", hf_gpt2_dir, "--temperature", "0", "--max-new-tokens", "12"]
    prompts = [arg for prompt in RAGGED_PROMPTS for arg in ("--prompt", prompt)]
    code, out, err = main(capsys, "--json", *common, *prompts, "--cache", "offloaded")
    assert code == 0, err
    assert "[roseinfer] kv cache: offloaded" in err.splitlines()
    offloaded = [r["token_ids"] for r in json_lines(out)]
    oracle = [r["token_ids"] for r in run_json(capsys, *common, *prompts, "--no-kv-cache")]
    assert offloaded == oracle and all(len(ids) == 12 for ids in offloaded)


def test_batch_size_only_changes_how_the_text_is_printed(
    run_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    common = ["--checkpoint-path", run_dir, "--seed", "3", "--max-new-tokens", "8"]
    prompts = ["--prompt", "To be", "--prompt", "or not to be, that is", "--prompt", "Ay"]
    outputs = {}
    for batch_size in ("1", "2", None):
        size_flag = [] if batch_size is None else ["--batch-size", batch_size]
        code, out, err = main(capsys, *common, "--cache", "static", *prompts, *size_flag)
        assert code == 0, err
        outputs[batch_size] = out
        batch_sizes = re.findall(r"^\[roseinfer\] batch size: (\d+)$", err, re.M)
        batched_rates = re.findall(r"^\[roseinfer\] batched tokens/s: \d+\.\d \(", err, re.M)
        expected_sizes = {"1": ["1", "1", "1"], "2": ["2", "1"], None: ["3"]}[batch_size]
        assert batch_sizes == expected_sizes
        assert len(batched_rates) == sum(size != "1" for size in expected_sizes)
    # Streamed one by one (batch size 1), or printed per batch: the same text, in order;
    # and the same through the serving engine (several prompts, no --cache).
    code, out, err = main(capsys, *common, *prompts, "--max-num-seqs", "2")
    assert code == 0 and "[roseinfer] kv cache: paged (engine)" in err
    assert outputs["1"] == outputs["2"] == outputs[None] == out
    assert outputs[None].startswith("To be")


def test_no_prompt_is_one_empty_prompt_and_the_newest_checkpoint_is_found(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_checkpoint(tmp_path / "checkpoints" / "tiny" / "last.pt")
    monkeypatch.chdir(tmp_path)
    code, out, err = main(capsys, "--json", "--max-new-tokens", "3", "--dtype", "bfloat16")
    assert code == 0, err
    [result] = json_lines(out)
    assert result["prompt"] == ""
    assert result["prompt_token_ids"] == [50256]
    assert len(result["token_ids"]) == 3
    assert f"[roseinfer] model: {Path('checkpoints/tiny/last.pt')} (" in err
    assert "[roseinfer] dtype: bfloat16" in err


def test_prompt_file_skips_blank_lines(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first line\n\n   \nsecond, 第二\n", encoding="utf-8")
    code, out, err = main(
        capsys, "--checkpoint-path", run_dir, "--prompt-file", prompts, "--max-new-tokens", "2"
    )
    assert code == 0, err
    assert out.splitlines()[0].startswith("first line")
    assert out.splitlines()[1].startswith("second, 第二")
    assert len(out.splitlines()) == 2
    assert f"[roseinfer] prompt file: {prompts} (2 blank lines skipped)" in err.splitlines()


def test_stop_string(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    common = ["--checkpoint-path", run_dir, "--seed", "2", "--max-new-tokens", "30"]
    [full] = run_json(capsys, *common, "--prompt", "Once")
    stop = full["text"][10:13]  # three characters from the middle of the text
    [stopped] = run_json(capsys, *common, "--prompt", "Once", "--stop", stop)
    assert stopped["finish_reason"] == "stop"
    assert stop in stopped["text"]
    assert full["text"].startswith(stopped["text"])
    assert len(stopped["token_ids"]) < len(full["token_ids"])


def test_ctrl_c_while_streaming_stops_cleanly(
    run_dir: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    pushed = []
    real_push = StreamDecoder.push

    def push_then_interrupt(self: StreamDecoder, token_id: int) -> str:
        pushed.append(token_id)
        if len(pushed) == 3:
            raise KeyboardInterrupt
        return real_push(self, token_id)

    monkeypatch.setattr(StreamDecoder, "push", push_then_interrupt)
    code, out, err = main(capsys, "--checkpoint-path", run_dir, "--prompt", "Hi", "--seed", "1")
    assert code == 130
    assert out.startswith("Hi") and out.endswith("\n")
    assert err.splitlines()[-1] == "[roseinfer] interrupted: stopped by Ctrl-C"
    assert "error" not in err


# -- a sliding-window rotary model --


@pytest.fixture(scope="module")
def windowed_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rotary model with a window of 8 and 2 sinks, re-initialised as a strong oracle."""
    config = GPTConfig(
        vocab_size=50257, block_size=32, n_layer=2, n_head=2, n_embd=32,
        position_embedding="rotary", sliding_window=8, attention_sinks=2,
    )  # fmt: skip
    model = wide_random_init(GPT(config), seed=0)
    path = tmp_path_factory.mktemp("windowed") / "best.pt"
    state = {"model": model.state_dict(), "model_config": config.to_dict()}
    save_checkpoint(path, {**state, "tokenizer_name": "gpt2"})
    return path


@pytest.mark.slow
def test_a_windowed_model_gives_the_oracle_ids_on_every_path_far_past_its_context(
    windowed_checkpoint: Path, capsys: pytest.CaptureFixture
) -> None:
    """Five times the context: the rolling cache (the default for one prompt), the
    engine (several prompts) and --no-kv-cache (the banded oracle) agree token for token."""
    prompts = ["ROMEO:", "To be, or not"]
    base = ["--checkpoint-path", windowed_checkpoint, "--temperature", "0", "--json",
            "--max-new-tokens", "160", "--no-stop-at-eot"]  # fmt: skip
    ids = {}
    for name, extra in {
        "rolling": ["--prompt", prompts[0]],
        "engine": ["--prompt", prompts[0], "--prompt", prompts[1]],
        "oracle": ["--prompt", prompts[0], "--prompt", prompts[1], "--no-kv-cache"],
    }.items():
        code, out, err = main(capsys, *base, *extra)
        assert code == 0, err
        ids[name] = [line["token_ids"] for line in json_lines(out)]
        if name == "rolling":
            assert "kv cache: rolling" in err
    assert ids["rolling"][0] == ids["engine"][0] == ids["oracle"][0]
    assert ids["engine"][1] == ids["oracle"][1]
    assert len(ids["oracle"][0]) == 160 and len(set(ids["oracle"][0])) > 40


@pytest.mark.slow
def test_a_window_far_larger_than_any_run_generates_on_the_slots_the_run_needs(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Training accepts a window of 10^12 tokens (a legitimate model: its window never
    binds); generating with it allocates slots for the tokens a run holds, not for the
    window (which would be 256 TB), on the default path and with --cache rolling, and
    the tokens are the oracle's past the context."""
    config = GPTConfig(
        vocab_size=50257, block_size=32, n_layer=2, n_head=2, n_embd=32,
        position_embedding="rotary", sliding_window=10**12, attention_sinks=4,
    )  # fmt: skip
    path = tmp_path / "best.pt"
    state = {"model": wide_random_init(GPT(config), seed=0).state_dict()}
    save_checkpoint(path, {**state, "model_config": config.to_dict(), "tokenizer_name": "gpt2"})
    base = ["--checkpoint-path", path, "--prompt", "ROMEO:", "--temperature", "0", "--json",
            "--max-new-tokens", "80", "--no-stop-at-eot"]  # fmt: skip
    ids = {}
    for name, extra in {"default": [], "rolling": ["--cache", "rolling"],
                        "oracle": ["--no-kv-cache"]}.items():  # fmt: skip
        code, out, err = main(capsys, *base, *extra)
        assert code == 0, err
        ids[name] = json_lines(out)[0]["token_ids"]
    assert ids["default"] == ids["rolling"] == ids["oracle"]
    assert len(ids["oracle"]) == 80


@pytest.mark.parametrize(
    "which, extra, complaint",
    [
        ("windowed", ["--cache", "static"], "use --cache rolling"),
        ("tiny", ["--cache", "rolling"], "needs a model with a sliding window"),
    ],
)
def test_a_cache_that_does_not_fit_the_window_is_one_line(
    which: str, extra: list[str], complaint: str, request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture,
) -> None:  # fmt: skip
    path = request.getfixturevalue("windowed_checkpoint" if which == "windowed" else "run_dir")
    code, out, err = main(capsys, "--checkpoint-path", path, "--prompt", "a", *extra)
    assert code == 2 and out == ""
    assert complaint in err and len(err.strip().splitlines()) == 1


def test_the_engine_says_when_it_stops_prompts_at_the_context(
    run_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    """Offline, as vLLM's LLM does, the engine stops a request at the context window
    (finish reason length) rather than refuse it, and says so in one line (the server
    answers 400 instead: test_serve.py)."""
    short, long = "ROMEO:", " ".join(["word"] * 40)  # 3 and 40 tokens; the context is 64
    base = ["--checkpoint-path", run_dir, "--prompt", short, "--prompt", long, "--json",
            "--temperature", "0", "--no-stop-at-eot"]  # fmt: skip
    code, out, err = main(capsys, *base, "--max-new-tokens", "30")
    assert code == 0, err
    said = [line for line in err.splitlines() if line.startswith("[roseinfer] context:")]
    assert said == [
        "[roseinfer] context: 1 of 2 prompts + --max-new-tokens 30 do not fit the model's "
        "64-token context: the engine stops each when the context is full (finish reason length)"
    ]
    rows = json_lines(out)
    assert [len(row["prompt_token_ids"]) for row in rows] == [3, 40]
    # It feeds 64 tokens; the last one sampled needs no position: 40 + 25 - 1 = 64.
    assert [len(row["token_ids"]) for row in rows] == [30, 25]
    assert [row["finish_reason"] for row in rows] == ["length", "length"]
    code, out, err = main(capsys, *base, "--max-new-tokens", "25")  # fits: nothing said
    assert code == 0 and "context:" not in err
