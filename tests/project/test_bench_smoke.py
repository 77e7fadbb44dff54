"""The benchmarks (benchmarks/, beside the packages) run and print their tables (smoke tests:
no timing is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.train import bench

REPO_ROOT = Path(__file__).resolve().parents[2]  # `python -m benchmarks.X` runs from there


@pytest.mark.slow
def test_quick_bench_prints_both_checkpointing_settings_and_both_losses(
    capsys: pytest.CaptureFixture,
) -> None:
    assert bench(["--quick", "--loss", "chunked,plain"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("rose ")]
    assert [(row[3], row[4]) for row in rows] == [
        ("off", "chunked"), ("off", "plain"), ("on", "chunked"), ("on", "plain")
    ]  # fmt: skip
    for row in rows:
        tokens_per_s, total_mib = float(row[8].replace(",", "")), float(row[-1].replace(",", ""))
        assert tokens_per_s > 0 and total_mib > 0
    assert "tiny 2 x 128: checkpointing saves" in out
    assert out.count("tiny 2 x 128: the sliced loss") == 2  # checkpointing off, and on


FAKE_NANOGPT = """
import sys
args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
assert args["batch_size"] == "3" and args["block_size"] == "16" and args["dataset"] == "rose_bench"
assert args["gradient_accumulation_steps"] == "1" and args["max_iters"] == "2"
# the warm-up iteration is slow (compiling); the timed ones take 100 and 300 ms
for i, ms in enumerate([5000.0, 100.0, 300.0]):
    print(f"iter {i}: loss 10.9876, time {ms:.2f}ms, mfu -100.00%")
"""


def test_nanogpt_runs_with_the_same_shapes_and_its_own_times_are_read(tmp_path) -> None:
    """The peer's tokens/s comes from nanoGPT's own per-iteration times after the
    warm-up (here a stand-in train.py that checks the settings it is given)."""
    from benchmarks.train import run_nanogpt

    for name, text in (("train.py", FAKE_NANOGPT), ("model.py", ""), ("configurator.py", "")):
        (tmp_path / name).write_text(text)
    spec = {"preset": "tiny", "batch_size": 3, "block_size": 16, "steps": 2, "warmup_steps": 1,
            "device": "cpu", "dtype": "float32", "compile": False, "peak_tflops": None}  # fmt: skip
    result = run_nanogpt(tmp_path, spec, matched=True)
    # iteration 0 is the warm-up; 1 and 2 average 200 ms for 48 tokens
    assert result["ms_per_step"] == pytest.approx(200.0)
    assert result["tokens_per_s"] == pytest.approx(3 * 16 / 0.2)
    assert result["vocab_rows"] == 50257 and result["peer"] == "nanoGPT (rose's model)"


@pytest.mark.slow
def test_quick_inference_bench_paths_and_batches_agree_on_tokens() -> None:
    paths = ["uncached", "concat", "static"]
    command = [
        sys.executable, "-m", "benchmarks.decode", "--quick", "--json", "--plot", "",
        "--paths", ",".join(paths),
    ]  # fmt: skip
    # One thread: the quick model is tiny, and the CI machine has two shared cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=300, cwd=REPO_ROOT
    )
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    new_tokens, prompt_len = payload["args"]["new_tokens"], payload["args"]["prompt_len"]

    assert [r["path"] for r in payload["results"]] == paths
    assert payload["tokens_agree"] == {path: True for path in paths}
    for result in payload["results"]:
        assert len(result["tokens"]) == new_tokens
        assert result["tokens_per_s"] > 0

    batched = payload["batched"]
    assert [b["batch_size"] for b in batched] == [1, 4]
    for b in batched:
        assert b["tokens_agree"], f"batch of {b['batch_size']}: a row left its run alone"
        assert b["new_tokens"] == b["batch_size"] * new_tokens
        assert len(b["prompt_lengths"]) == b["batch_size"]
        assert all(prompt_len // 2 <= n <= prompt_len for n in b["prompt_lengths"])
        assert b["batched_tokens_per_s"] > 0 and b["one_by_one_tokens_per_s"] > 0
    assert len(set(batched[-1]["prompt_lengths"])) > 1  # ragged: the batch is padded


def test_decode_flops_counts_every_matrix_once_per_row_and_attention_per_key() -> None:
    from rosecourse.roofline import decode_flops
    from rosetrainer.config import GPTConfig
    from rosetrainer.model import GPT

    config = GPTConfig(vocab_size=100, block_size=16, n_layer=2, n_head=2, n_embd=8)
    model = GPT(config)
    # Per layer: c_attn 8x24, attn c_proj 8x8, c_fc 8x32, mlp c_proj 32x8; then the head 100x8.
    matrices = 2 * (8 * 24 + 8 * 8 + 8 * 32 + 32 * 8) + 100 * 8
    attention = 2 * (2 * 8 * 10)  # 2 layers x (q.k and weights.v: 8 x 10 each)
    assert decode_flops(model, kv_len=10) == 2 * (matrices + attention)
    assert decode_flops(model, kv_len=10, batch=3) == 3 * 2 * (matrices + attention)


@pytest.mark.slow
def test_tiny_offload_bench_prints_one_table_with_equal_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture, one_torch_thread: None
) -> None:
    from benchmarks import offload

    path = tmp_path / "offload.json"
    assert offload.main(["--device", "cpu", "--tiny", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    kinds = ("concat", "static", "offloaded")
    rows = [line.split()[0] for line in out.splitlines() if line.startswith(kinds)]
    assert rows == list(kinds)
    assert "tokens equal: yes" in out.splitlines()
    results = {r["kind"]: r for r in json.loads(path.read_text())["results"]}
    assert all(r["tokens_equal_oracle"] and r["tokens_equal_concat"] for r in results.values())
    assert all(r["new_tokens"] == 128 - 16 and r["tokens_per_s"] > 0 for r in results.values())
    # Two of the tiny model's four layers on the device, all four on the host; the
    # others copy nothing in.
    offloaded, static = results["offloaded"], results["static"]
    assert offloaded["device_cache_bytes"] * 2 == offloaded["host_cache_bytes"]
    assert offloaded["host_cache_bytes"] == static["device_cache_bytes"]
    assert offloaded["to_device_bytes_per_step"] > 0 == static["to_device_bytes_per_step"]
    assert offloaded["peak_device_bytes"] is None  # no CUDA here


def test_quick_kernels_bench_times_both_forms_of_every_choice(
    capsys: pytest.CaptureFixture, one_torch_thread: None
) -> None:
    from benchmarks import kernel_choices as kernels

    assert kernels.main(["--quick", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    names = [r["name"] for r in payload["results"]]
    assert names[0].startswith("argmax") and names[-1] == "decode attention (bfloat16)"
    assert "decode attention (float32)" in names  # (the kernel builds here)
    assert all(r["rose_ms"] > 0 and r["other_ms"] > 0 for r in payload["results"])
    # the packed products, or a line saying why this CPU runs none of them
    assert any(n.startswith("vocab projection") for n in names) or payload["left_out"]


@pytest.mark.slow
def test_quick_compile_bench_compiles_the_step_and_checks_its_tokens() -> None:
    """The compiled decode step (float32, the tiny model) runs in every variant and gives
    eager's tokens, its logits within the oracle's tolerance."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.compile_step", "--quick", "--part", "step",
         "--dtypes", "float32"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    ).stdout  # fmt: skip
    equal = [line for line in out.splitlines() if line.strip().startswith("equality")]
    assert len(equal) == 3, out
    for line in equal:
        tokens = line.split(": ")[1].split(" tokens")[0]  # "8/8"
        same, total = tokens.split("/")
        assert same == total and "within tolerance" in line, line


@pytest.mark.slow
def test_quick_contention_bench_prints_every_workload_alone_and_busy() -> None:
    """rose's threads (auto and one) per workload, alone and beside busy programs; the
    measured processes choose their own threads (no OMP_NUM_THREADS handed down)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    command = [sys.executable, "-m", "benchmarks.contention", "--quick", "--no-vllm"]
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=600, cwd=REPO_ROOT
    )
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()
            if line.split()[:1] in (["generate"], ["train"], ["engine"])}  # fmt: skip
    assert set(rows) == {"generate", "train", "engine"}
    for figures in rows.values():  # auto and 1, alone then busy; the busy ratio
        assert all(float(value) > 0 for value in figures[:4])
        assert figures[4].endswith("x")
    assert "cores" in done.stdout.splitlines()[0]


def test_quick_grouped_bench_prints_a_third_of_the_kv_bytes_per_token(
    capsys: pytest.CaptureFixture,
) -> None:
    """Six query heads over two key/value heads against six over six, the same width and
    workload: a third of the bytes per live token, each at its key/value heads' size times
    the same block rounding; both checked against the oracle inside the benchmark."""
    from benchmarks.grouped import main

    assert main(["--quick"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if " kv heads " in line]
    assert [(row[0], row[3]) for row in rows] == [("6", "2"), ("6", "6")]
    (grouped, heads_grouped), (plain, heads_plain) = (
        (float(row[6].replace(",", "")), float(row[7].replace(",", ""))) for row in rows
    )
    assert heads_plain == 3 * heads_grouped and plain == pytest.approx(3 * grouped, rel=0.01)
    assert grouped / heads_grouped == pytest.approx(plain / heads_plain, rel=0.01)
    assert all(float(row[-1].replace(",", "")) > 0 for row in rows)


@pytest.mark.slow
def test_gpu_script_dry_run_measures_every_stage_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks/gpu.sh --dry-run: every stage the GPU run has, on the CPU with tiny
    shapes, each figure in results.jsonl; the compiled and graph paths give the tokens
    of the oracle and of the eager engine."""
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        ["bash", "benchmarks/gpu.sh", "--dry-run"], cwd=REPO_ROOT, env=env,
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("bandwidth", "decode", "engine", "serve", "train"):
        assert f"== {name}: exit 0" in done.stdout, done.stdout
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    by_stage = {}
    for row in rows:
        by_stage.setdefault(row["stage"], []).append(row)
    assert by_stage["bandwidth"][0]["gb_per_s"] > 0
    (decode,) = by_stage["decode"]
    assert decode["tokens_equal_oracle"] and 0 < decode["fraction_of_roofline"]
    engine = {row["run"]: row for row in by_stage["engine"]}
    assert engine["tokens"]["requests_equal_to_eager"] == engine["tokens"]["requests"]
    assert engine["rose"]["tok_s"] > 0 and engine["rose eager (before)"]["tok_s"] > 0
    assert engine["transformers generate_batch"]["tok_s"] > 0
    serve = {row["run"]: row for row in by_stage["serve"]}
    for run in ("default", "enforce-eager"):
        assert serve[run]["completed"] == serve[run]["clients"]
        assert serve[run]["output_tok_s"] > 0
